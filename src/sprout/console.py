"""What every Sprout command line shares: one clear error line and a non-zero exit, never a traceback."""

import argparse
import sys
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape

from .errors import SproutError

# Piped output (logs, tests, CI) gets wide tables instead of ids wrapped at 80 columns.
console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
errors = Console(stderr=True, highlight=False, soft_wrap=True)  # one line per error, however long


def run_cli(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> None:
    try:
        code = main(sys.argv[1:] if argv is None else argv)
    except SproutError as e:
        errors.print(f"[red]error:[/red] {escape(str(e))}", markup=True)  # a path may hold "[...]"
        code = e.exit_code
    except KeyboardInterrupt:
        errors.print("interrupted")
        code = 130
    sys.exit(code or 0)


def run_parser(build: Callable[[], argparse.ArgumentParser], argv: list[str] | None = None) -> None:
    """`run_cli` for a parser whose subcommands set `func(args) -> exit code`."""

    def main(args: list[str]) -> int | None:
        parsed = build().parse_args(args)
        return parsed.func(parsed)

    run_cli(main, argv)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
