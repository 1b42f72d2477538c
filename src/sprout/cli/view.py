"""`sprout view`: the attempt trees of evaluations and benchmarks in a browser, each turn with what it changed."""

import argparse
import ipaddress
from pathlib import Path

from ..console import console, errors, human_bytes


def cmd_view(args: argparse.Namespace) -> int:
    from ..report.view import Runs
    from ..report.viewer import app, write_static

    runs = Runs(args.runs)
    for problem in runs.problems:
        errors.print(f"skipped: {problem}", markup=False)
    if args.html:
        size = write_static(runs, args.html)
        console.print(f"wrote {args.html} ({human_bytes(size)}): {len(runs.evaluations)} evaluation(s), one file "
                      "to open or share", markup=False)
        return 0
    import uvicorn

    if not _loopback(args.host):
        errors.print(f"warning: serving on {args.host}: anyone who reaches this host can read these runs", markup=False)
    console.print(f"serving {len(runs.evaluations)} evaluation(s) at http://{args.host}:{args.port}/ (Ctrl-C stops)",
                  markup=False)
    # a page following a running evaluation holds its event stream open: stopping waits for none of them
    uvicorn.run(app(runs), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)
    return 0


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def add(sub: argparse._SubParsersAction) -> None:
    text = ("The attempt tree of each evaluation (rounds, the checkpoint each branch came from, the review's chosen "
            "turns and notes, rewards, cancelled siblings), each attempt turn by turn with what the turn changed on "
            "disk, and for a benchmark directory a table of tasks and the tasks solved against turns spent per method; "
            "an RL group's search tree (roots, students, repairs with their inserted turns, rewards, the outcome). "
            "A live run is followed as it is written.")
    s = sub.add_parser("view", help="the runs' attempt trees and trajectories in a browser", description=text)
    s.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR",
                   help="an evaluation's output directory, a benchmark's (its evaluations in subdirectories), an RL "
                        "group's directory or the RL driver's data directory (its groups)")
    s.add_argument("--host", default="127.0.0.1", help="the address to serve on (default 127.0.0.1: this host only)")
    s.add_argument("--port", type=int, default=8765, help="the port (default 8765)")
    s.add_argument("--html", type=Path, metavar="OUT",
                   help="write one static page with everything embedded (turn diffs where the checkpoints still "
                        "exist) instead of serving")
    s.set_defaults(func=cmd_view)



