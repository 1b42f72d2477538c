"""Gate benchmark: the gate's wall time over the fixture dataset with 1 and 4 workers, and the cost
of one grade as Sprout does it (branch the final checkpoint + Harbor's verifier + delete the branch)
against grading in a fresh container started from the task's image, the way a Docker runner does.

    .venv/bin/python bench/gate.py [--n 5] [--tasks-dir tests/fixtures/tasks]

The baseline grade: `podman run` of the task image, `podman cp` of the attempt's changed file in,
`podman cp` of tests/ to /tests, chmod and test.sh through `podman exec`, `podman cp` of
/logs/verifier out, `podman rm`. Both grade the same solved py-bugfix attempt and must agree.
"""

import argparse
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from rich.table import Table

from sprout.console import console
from sprout.eval.gate import run_gate
from sprout.sandbox import Store
from sprout.sandbox.podman import PODMAN, ulimit_flags
from sprout.tasks import ensure_image, grade, load_task, load_tasks

REPO = Path(__file__).resolve().parents[1]
RUNTIME_BIN = REPO / "runtime" / "sprout-runtime"
GRADED_TASK = REPO / "tests" / "fixtures" / "tasks" / "py-bugfix"
CHANGED_FILE = "/app/calc.py"  # what the oracle of py-bugfix changes


def podman(*args: str) -> str:
    return subprocess.run([*PODMAN, *args], check=True, capture_output=True, text=True).stdout.strip()


def gate_seconds(tasks_dir: Path, workers: int) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as out:
        summary = run_gate(tasks_dir, Path(out), workers=workers, runtime_bin=RUNTIME_BIN)
    return summary.wall_s, f"{summary.passed} pass, {summary.failed} fail, {summary.errors} error"


def solved_checkpoint(store: Store, task, reference: str):
    """A checkpoint of py-bugfix after its oracle, and the changed file's content for the baseline."""
    sandbox = store.create_sandbox(store.resolve_image(reference), label="bench-gate")
    try:
        sandbox.exec((GRADED_TASK / "solution" / "solve.sh").read_text())
        return sandbox.checkpoint(label="bench-gate"), (sandbox.path / CHANGED_FILE.lstrip("/")).read_bytes()
    finally:
        sandbox.destroy()


def baseline_grade(reference: str, changed: bytes, tests_dir: Path) -> float:
    """Grades in a fresh podman container of the image; returns the reward."""
    name = f"sprout-bench-grade-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "calc.py"
        state.write_bytes(changed)
        podman("run", "-d", "--init", "--name", name, *ulimit_flags(), reference, "sleep", "infinity")
        try:
            podman("cp", str(state), f"{name}:{CHANGED_FILE}")
            podman("exec", name, "mkdir", "-p", "/tests", "/logs/verifier")
            podman("cp", f"{tests_dir}/.", f"{name}:/tests")
            podman("exec", "--user", "root", name, "chmod", "+x", "/tests/test.sh")
            podman("exec", "--workdir", "/app", name, "bash", "-c",
                   "(/tests/test.sh) > /logs/verifier/test-stdout.txt 2>&1")
            podman("cp", f"{name}:/logs/verifier/.", tmp)
            return float((Path(tmp) / "reward.txt").read_text())
        finally:
            subprocess.run([*PODMAN, "rm", "-f", "-t", "0", name], capture_output=True)


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    value = fn()
    return (time.perf_counter() - started) * 1000, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=5, help="grades per measurement")
    parser.add_argument("--tasks-dir", type=Path, default=REPO / "tests" / "fixtures" / "tasks")
    args = parser.parse_args()
    fast = Store(runtime_bin=RUNTIME_BIN)
    for task in load_tasks(args.tasks_dir).tasks:  # build images first: the gate runs time the gate itself
        ensure_image(fast, task.paths.environment_dir, task.config.environment, name=task.task_dir.name)

    table = Table("measurement", "value", "note", title="gate benchmark")
    one, verdicts = gate_seconds(args.tasks_dir, 1)
    four, _ = gate_seconds(args.tasks_dir, 4)
    table.add_row("gate wall time, --workers 1", f"{one:.1f} s", verdicts)
    table.add_row("gate wall time, --workers 4", f"{four:.1f} s", f"{one / four:.2f}x faster")

    task = load_task(GRADED_TASK)
    reference = ensure_image(fast, task.paths.environment_dir, task.config.environment, name="py-bugfix").reference
    checkpoint, changed = solved_checkpoint(fast, task, reference)
    try:
        rows = {}
        for label, store in (("runtime", fast), ("podman exec", Store(fast.root, runtime_bin=None))):
            runs = [timed(lambda: grade(store, checkpoint, task)) for _ in range(args.n)]
            assert all(result.reward == 1.0 for _, result in runs), runs
            rows[label] = statistics.median(ms for ms, _ in runs)
        runs = [timed(lambda: baseline_grade(reference, changed, task.paths.tests_dir)) for _ in range(args.n)]
        assert all(reward == 1.0 for _, reward in runs), runs
        baseline = statistics.median(ms for ms, _ in runs)
    finally:
        fast.remove_checkpoint(checkpoint.id, force=True)
    table.add_row("grade: Sprout branch + Harbor Verifier (sprout-runtime), p50", f"{rows['runtime']:.0f} ms",
                  f"n={args.n}")
    table.add_row("grade: Sprout branch + Harbor Verifier (podman exec), p50", f"{rows['podman exec']:.0f} ms",
                  f"n={args.n}")
    table.add_row("grade: fresh podman container from the image, p50", f"{baseline:.0f} ms",
                  f"n={args.n}; run + cp state + cp tests + exec + cp logs + rm")
    table.add_row("ratio fresh container / Sprout grade (runtime)", f"{baseline / rows['runtime']:.2f}x", "")
    console.print(table)


if __name__ == "__main__":
    main()
