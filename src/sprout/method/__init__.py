"""Layer 4: the SPROUT method (review a failed rollout, branch from the turns before the mistake) and the
restarts baseline at equal budget. `search` decides, `executor` runs attempts and reviews for real."""
