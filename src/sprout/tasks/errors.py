"""Errors of the task layer; each message is one line meant for the user (it names the task)."""

from ..errors import SproutError


class TaskError(SproutError):
    """Base class for problems with a Harbor task."""


class TaskLoadError(TaskError):
    """A task directory that cannot be read: bad task.toml, missing files, no environment."""


class UnsupportedTaskError(TaskError):
    """A valid Harbor task that needs something a single Sprout sandbox does not provide."""


class TaskImageError(TaskError):
    """The task's image could not be built or found (e.g. a missing FROM image)."""
