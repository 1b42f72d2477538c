"""python -m sprout.demo: a dry run without a model endpoint.

Starts the scripted model server (a real OpenAI-compatible HTTP server replaying a fixed script),
runs the fizzbuzz task end to end in a real sandbox with a checkpoint per turn, then prints the
journal's snapshots table, so you can see what Sprout does before you have an endpoint.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .checkout import RUNTIME_LAUNCHER
from .console import console, run_cli

SCRIPT = Path(__file__).parent / "demo_data" / "fizzbuzz.json"
TASK = "write fizzbuzz.py, run it, and check that 15 prints FizzBuzz"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m sprout.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--journal", type=Path, default=Path("runs/demo.jsonl"), help="(replaced if it exists)")
    p.add_argument("--runtime-bin", type=Path, default=RUNTIME_LAUNCHER if RUNTIME_LAUNCHER.exists() else None)
    args = p.parse_args(argv)
    from .agent.models import Endpoint
    from .agent.runner import RolloutSpec, run_rollout
    from .sandbox import Store
    from .testing.scripted_model import ScriptedModelServer

    store = Store(runtime_bin=args.runtime_bin)
    _forget(args.journal, store)
    os.environ.setdefault("SPROUT_DEMO_KEY", "demo")
    with ScriptedModelServer(SCRIPT, api_key="demo") as server:
        console.print(f"scripted model server on {server.base_url} ({len(server.remaining)} steps)")
        spec = RolloutSpec(task=TASK, model="scripted", endpoint=Endpoint(server.base_url, "SPROUT_DEMO_KEY"),
                           journal=args.journal)
        result = run_rollout(spec, store,
                             on_event=lambda e: console.print(f"  turn {e.turn.turn}: {e.turn.commands[:1]} -> "
                                                              f"checkpoint {e.turn.checkpoint}"))
    console.print(f"{result.outcome.status} after {result.outcome.turns} turns; journal {args.journal}\n")
    subprocess.run([sys.executable, "-m", "ops.report", "snapshots", str(args.journal)], check=False)
    console.print(f"\nnext: python -m ops.report export {args.journal}   |   "
                  f"python -m sprout.worker run --from {args.journal} --turn 1 ...")
    return 0 if result.outcome.status == "submitted" else 1


def _forget(journal: Path, store) -> None:
    """Removes an earlier demo journal and the checkpoints it made."""
    from .agent.journal import read_journal
    from .errors import SproutError

    if not journal.exists():
        return
    try:
        for turn in read_journal(journal).turns:
            if turn.checkpoint:
                store.remove_checkpoint(turn.checkpoint)
    except SproutError:
        pass  # already gone, or something branches from it: leave it
    journal.unlink()


if __name__ == "__main__":
    run_cli(main)
