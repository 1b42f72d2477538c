"""docs/cli.md, generated from the parsers themselves (`python -m sprout.cli.reference > docs/cli.md`; a test
keeps the page equal to this)."""

import argparse
import os

from . import parser

INTRO = """# Command line

Everything Sprout does is a subcommand of `sprout` (the seed's `python -m sprout.worker ...`,
`python -m sprout.eval.gate ...` and the other `python -m` forms still work, as aliases). The flags several
commands share are defined once and mean the same everywhere: a list is space-separated (`--tasks a b`; an
item holding commas is split at them too), a duration is in seconds, `-o/--output` names what a command
writes, `--store` and `--runtime-bin` go on the command that uses them. Exit status: **0** done, **1** failed,
**2** usage (a flag the parser refuses, or flags that cannot go together); an error is one line on stderr.

This page is generated from the parsers (`python -m sprout.cli.reference`).
"""


def _commands(p: argparse.ArgumentParser, path: list[str]) -> list[tuple[list[str], argparse.ArgumentParser]]:
    """Every (sub)command under `p`, depth first, in the order `--help` lists them."""
    found = [(path, p)]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {choice.dest for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if name in listed:  # hidden ones (`services _supervise`) stay out
                    found += _commands(sub, [*path, name])
    return found


def reference_markdown() -> str:
    os.environ["COLUMNS"] = "110"  # argparse wraps help to the terminal's width: the page must not vary
    parts = [INTRO]
    for path, command in _commands(parser(), ["sprout"]):
        if len(path) > 1:
            parts.append(f"{'#' * min(len(path) + 1, 4)} {' '.join(path)}\n")
        parts.append(f"```text\n{command.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(reference_markdown(), end="")
