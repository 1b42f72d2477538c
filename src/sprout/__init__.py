"""Sprout: checkpoint every turn of a coding agent's rollout and branch from any turn."""

__version__ = "0.1.0"
