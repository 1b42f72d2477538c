"""Sprout's RL driver: Miles rollout groups over /rollout-groups."""
