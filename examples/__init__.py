"""Worked examples of Sprout on real models."""
