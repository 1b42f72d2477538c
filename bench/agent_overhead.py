"""Per-turn overhead Sprout adds to an agent rollout (checkpoint + journal write), measured in one run.

    .venv/bin/python bench/agent_overhead.py [--turns 30] [--model-latency 1.0]

A scripted model drives a real 30-turn rollout (each command edits a file and runs python) in a real
sandbox through sprout-runtime. From the journal: checkpoint time and command time per turn; the
journal write (JSON line + fsync) is timed by rewriting the same records. The overhead is reported
in ms and as a share of a turn whose model call takes --model-latency seconds.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sprout.agent.journal import JournalWriter, read_journal
from sprout.agent.models import Endpoint
from sprout.agent.runner import RolloutSpec, run_rollout
from sprout.sandbox import Store
from sprout.testing.scripted_model import ScriptedModelServer

REPO = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--model-latency", type=float, default=1.0, help="seconds per model call to compare against")
    args = parser.parse_args()
    steps = [{"thought": f"step {i}", "command": f"echo 'x = {i}' >> /tmp/work.py && python3 /tmp/work.py"}
             for i in range(args.turns - 1)] + [{"thought": "done", "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]
    store = Store(runtime_bin=REPO / "runtime" / "sprout-runtime")
    with tempfile.TemporaryDirectory() as tmp, ScriptedModelServer(steps) as server:
        os.environ.setdefault("SPROUT_BENCH_KEY", "k")
        journal_path = Path(tmp) / "bench.jsonl"
        spec = RolloutSpec(task="bench", model="scripted", endpoint=Endpoint(server.base_url, "SPROUT_BENCH_KEY"),
                           journal=journal_path, step_limit=args.turns + 5)
        started = time.perf_counter()
        result = run_rollout(spec, store)
        wall = time.perf_counter() - started
        journal = read_journal(journal_path)
        writes = []
        writer = JournalWriter(Path(tmp) / "rewrite.jsonl")
        for turn in journal.turns:
            t = time.perf_counter()
            writer.write(turn)
            writes.append((time.perf_counter() - t) * 1000)
        writer.close()
    for checkpoint in result.checkpoints:
        store.remove_checkpoint(checkpoint, force=True)
    ckpt = [t.checkpoint_ms for t in journal.turns]
    cmd = [t.command_s * 1000 for t in journal.turns]
    model = [t.model_latency_s * 1000 for t in journal.turns]
    overhead = [c + w for c, w in zip(ckpt, writes)]
    turn_ms = args.model_latency * 1000 + pct(cmd, .5) + pct(overhead, .5)
    table = Table("per turn", "p50 ms", "p95 ms", "share of a turn", title=f"Sprout agent overhead, {len(journal.turns)}-turn scripted run")
    table.add_row("checkpoint (flush + snapshot)", f"{pct(ckpt, .5):.1f}", f"{pct(ckpt, .95):.1f}", "")
    table.add_row("journal line (write + fsync)", f"{pct(writes, .5):.2f}", f"{pct(writes, .95):.2f}", "")
    table.add_row("[bold]Sprout overhead[/bold]", f"{pct(overhead, .5):.1f}", f"{pct(overhead, .95):.1f}",
                  f"{pct(overhead, .5) / turn_ms:.1%} at {args.model_latency:g} s model latency (target <= 5%)")
    table.add_row("command itself (via sprout-runtime)", f"{pct(cmd, .5):.1f}", f"{pct(cmd, .95):.1f}",
                  f"overhead = {pct(overhead, .5) / pct(cmd, .5):.2f}x the command")
    table.add_row("scripted model call (local server)", f"{pct(model, .5):.1f}", f"{pct(model, .95):.1f}", "")
    Console().print(table)
    Console().print(f"outcome {result.outcome.status}, {len(journal.turns)} turns in {wall:.1f}s wall")


if __name__ == "__main__":
    main()
