"""Qwen (e.g. Qwen3-Coder) served by any OpenAI-compatible endpoint: prepare a dataset, run the benchmark."""
