"""`sprout`: one command for everything Sprout does, a thin shell over the library.

Each subcommand parses its flags, builds the library's typed config (or calls the SDK), calls one
function and prints. The flags several commands share are defined once (sprout.cli.flags). Exit status:
0 done, 1 failed, 2 usage; an error a user can cause is one line on stderr, never a traceback.

The seed's `python -m sprout.worker ...`, `python -m sprout.sandbox ...`, `python -m sprout.eval.gate ...`
(and the other `python -m` forms) are aliases of these subcommands (`alias`).

Why argparse and not typer (which Harbor and mini-swe-agent use): the seed's sixteen parsers were argparse,
so keeping it moved them without changing one flag's behaviour; it needs no dependency; and its parsers
are plain objects that the CLI reference (docs/cli.md) is generated from.
"""

import argparse
import sys
from collections.abc import Callable

from .. import __version__, rootless
from ..console import run_cli

Command = Callable[[argparse.Namespace], int | None]


def adders() -> list[Callable[[argparse._SubParsersAction], None]]:
    """What adds each subcommand, in the order `sprout --help` lists them (each module imports what its
    commands need when they run, not when the parser is built)."""
    from . import (
        agent,
        datasets,
        doctor,
        evaluation,
        report,
        rl_driver,
        runstore,
        sandbox,
        services,
        swe_rebench,
        view,
        worker,
    )

    return [doctor.add, agent.add, sandbox.add, sandbox.add_checkpoint, datasets.add, evaluation.add, report.add,
            view.add, services.add, worker.add,
            runstore.add, rl_driver.add, swe_rebench.add, agent.add_tools]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sprout", description=(
        "Checkpoint every turn of a coding agent's rollout and branch new attempts from any turn. "
        "Exit status: 0 done, 1 failed, 2 usage."))
    p.add_argument("--version", action="version", version=f"sprout {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in adders():
        add(sub)
    return p


def run(argv: list[str]) -> int | None:
    parsed = parser().parse_args(argv)
    return parsed.func(parsed)


def main(argv: list[str] | None = None) -> None:
    """The console script `sprout` (and `python -m sprout`)."""
    if argv is None:
        rootless.enter()
    run_cli(run, sys.argv[1:] if argv is None else argv)


def alias(module: str) -> None:
    """Runs the seed's `python -m MODULE ARGS` as the `sprout` subcommand it stands for (sprout.cli.aliases)."""
    from .aliases import SEED_FORMS

    prefix, translate = SEED_FORMS[module]
    rootless.enter()
    run_cli(lambda argv: run([*prefix, *translate(argv)]), sys.argv[1:])
