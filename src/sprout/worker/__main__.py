"""python -m sprout.worker: what a worker host does. `doctor` checks the host; `run` runs the agent with a
checkpoint per turn; `serve` claims and runs Run Store jobs (`python -m sprout.worker serve --help`)."""

import argparse
import json
from pathlib import Path

from ..console import console, run_cli
from ..sandbox import backends
from . import doctor
from . import run as run_command


def cmd_doctor(args) -> int:
    checks = doctor.run_checks(args.store, args.runtime_bin, args.backend)
    if args.json:
        print(json.dumps(doctor.as_json(checks), indent=2))
    else:
        for check in checks:
            mark = "[green]PASS[/green]" if check.ok else "[red]FAIL[/red]"
            console.print(f"{mark}  {check.name:<12} {check.detail}", markup=True, soft_wrap=True)
    return 0 if all(c.ok for c in checks) else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sprout.worker", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("doctor", help="check this host: btrfs store, podman, rlimits, images, runtime, smoke test")
    s.add_argument("--store", type=Path, help="btrfs store (default: $SPROUT_STORE or ~/sprout-btrfs)")
    s.add_argument("--runtime-bin", type=Path, help=f"sprout-runtime to check (default {doctor.DEFAULT_RUNTIME})")
    s.add_argument("--backend", choices=backends.names(), default=backends.DEFAULT, help=backends.help_text())
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_doctor)
    run_command.add_parser(sub)
    sub.add_parser("serve", help="claim and run Run Store jobs (rollout, grade, review, gate) on this host",
                   add_help=False)  # its own parser: sprout.worker.serve
    return p


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        from . import serve

        return serve.main(argv[1:])
    parsed = parser().parse_args(argv)
    return parsed.func(parsed)


if __name__ == "__main__":
    run_cli(main)
