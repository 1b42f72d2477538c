"""What every Sprout command line shares: its consoles, and one clear error line with the error's exit status
(1 failed, 2 usage; 130 interrupted), never a traceback."""

import os
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
    except BrokenPipeError:  # the reader went away (`| head`): not an error of ours to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code or 0)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)
