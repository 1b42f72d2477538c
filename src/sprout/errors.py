"""Sprout's errors. Every error a user or an agent can cause is a SproutError whose message is meant for
the user: the command line prints it as one line, without a traceback, and exits with its `exit_code`."""


class SproutError(Exception):
    """Base class of every error Sprout raises on purpose; the message says what went wrong and what to do."""

    exit_code = 1


class UsageError(SproutError):
    """The command line asks for something it cannot mean (flags that need each other, a value out of
    range): exit status 2, as for a flag the parser refuses."""

    exit_code = 2
