"""A rollout's defaults, in one place: every command line, job and driver takes these unless told otherwise."""

IMAGE = "docker.io/library/python:3.11-slim"  # the sandbox of a rollout that names no image (no task)
STEP_LIMIT = 50  # model calls
TOKEN_LIMIT = 2_000_000  # prompt and completion tokens, all calls together
WALL_TIME_S = 3600  # of the agent's run (a task's [agent].timeout_sec takes precedence in evaluations)
COMMAND_TIMEOUT_S = 120  # per command; its whole process tree is killed then
