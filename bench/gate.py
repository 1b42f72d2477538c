"""Gate benchmark: the gate's wall time over the fixture dataset with 1 and 4 workers; the gate over the
benchmark-like fixtures (tests/fixtures/bench-like: images pulled from a registry on 127.0.0.1, per task
verdict, time and where its image came from); and the cost of one grade as Sprout does it, live in the
attempt's own sandbox (the default) or in a branch of a stored checkpoint, against grading in a fresh
container started from the task's image, the way a Docker runner does.

    .venv/bin/python bench/gate.py [--n 5] [--tasks-dir tests/fixtures/tasks]

The benchmark-like gate needs Debian's docker-registry (ops/setup_podman.sh installs it).

The baseline grade: `podman run` of the task image, `podman cp` of the attempt's changed file in,
`podman cp` of tests/ to /tests, chmod and test.sh through `podman exec`, `podman cp` of
/logs/verifier out, `podman rm`. Both grade the same solved py-bugfix attempt and must agree.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from rich.table import Table

from sprout.console import console
from sprout.eval.gate import GateConfig, run_gate
from sprout.sandbox import Store
from sprout.sandbox.podman import command as podman_command
from sprout.sandbox.podman import ulimit_flags
from sprout.tasks import ensure_image, load_task, load_tasks
from sprout.tasks.grade import grade

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.bench_like import bench_like_dataset  # noqa: E402 - the repository's tests package
from tests.registry import LocalRegistry  # noqa: E402

RUNTIME_BIN = REPO / "runtime" / "sprout-runtime"
GRADED_TASK = REPO / "tests" / "fixtures" / "tasks" / "py-bugfix"
CHANGED_FILE = "/app/calc.py"  # what the oracle of py-bugfix changes


def podman(*args: str) -> str:
    return subprocess.run([*podman_command(), *args], check=True, capture_output=True, text=True).stdout.strip()


def gate_seconds(tasks_dir: Path, workers: int) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as out:
        summary = run_gate(GateConfig(tasks_dir=tasks_dir, output=Path(out), workers=workers, runtime_bin=RUNTIME_BIN))
    return summary.wall_s, f"{summary.passed} pass, {summary.failed} fail, {summary.errors} error"


def bench_like_rows(table: Table) -> None:
    """The gate over the benchmark-like fixtures, one row per task; their images start out absent."""
    with LocalRegistry() as registry, tempfile.TemporaryDirectory() as tmp:
        with bench_like_dataset(registry, Path(tmp)) as (tasks, env):
            saved = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            try:
                summary = run_gate(GateConfig(tasks_dir=tasks, output=Path(tmp) / "gate", workers=3,
                                              runtime_bin=RUNTIME_BIN))
            finally:
                for key, value in saved.items():
                    os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    for r in summary.results:
        grade_s = sum(a.grade.duration_s for a in (r.oracle, r.nop) if a and a.grade)
        table.add_row(f"gate {r.task} (bench-like)", f"{r.verdict}, {r.duration_s:.1f} s",
                      f"image {r.image_source} in {r.image_s:.1f} s; oracle+nop graded live in {grade_s:.1f} s")
    table.add_row("gate over the bench-like fixtures, --workers 3", f"{summary.wall_s:.1f} s",
                  f"{summary.passed}/{len(summary.results)} pass")


def solved_sandbox(store: Store, task, reference: str):
    """A running sandbox of py-bugfix after its oracle, its final checkpoint, and the changed file's
    content for the baseline."""
    sandbox = store.create_sandbox(store.resolve_image(reference), label="bench-gate")
    sandbox.exec((GRADED_TASK / "solution" / "solve.sh").read_text())
    return sandbox, sandbox.checkpoint(label="bench-gate"), (sandbox.path / CHANGED_FILE.lstrip("/")).read_bytes()


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
            subprocess.run([*podman_command(), "rm", "-f", "-t", "0", name], capture_output=True)


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
    bench_like_rows(table)

    task = load_task(GRADED_TASK)
    reference = ensure_image(fast, task.paths.environment_dir, task.config.environment, name="py-bugfix").reference
    sandbox, checkpoint, changed = solved_sandbox(fast, task, reference)
    try:
        rows = {}
        for label, store, source in (("live", fast, sandbox), ("runtime", fast, checkpoint),
                                     ("podman exec", Store(fast.root, runtime_bin=None), checkpoint)):
            runs = [timed(lambda: grade(store, source, task)) for _ in range(args.n)]
            assert all(result.reward == 1.0 for _, result in runs), runs
            rows[label] = statistics.median(ms for ms, _ in runs)
        runs = [timed(lambda: baseline_grade(reference, changed, task.paths.tests_dir)) for _ in range(args.n)]
        assert all(reward == 1.0 for _, reward in runs), runs
        baseline = statistics.median(ms for ms, _ in runs)
    finally:
        sandbox.destroy()
        fast.remove_checkpoint(checkpoint.id, force=True)
    table.add_row("grade: live in the attempt's sandbox + Harbor Verifier (sprout-runtime), p50",
                  f"{rows['live']:.0f} ms", f"n={args.n}; the default at the end of an attempt")
    table.add_row("grade: Sprout branch + Harbor Verifier (sprout-runtime), p50", f"{rows['runtime']:.0f} ms",
                  f"n={args.n}")
    table.add_row("grade: Sprout branch + Harbor Verifier (podman exec), p50", f"{rows['podman exec']:.0f} ms",
                  f"n={args.n}")
    table.add_row("grade: fresh podman container from the image, p50", f"{baseline:.0f} ms",
                  f"n={args.n}; run + cp state + cp tests + exec + cp logs + rm")
    table.add_row("ratio branch / live grade (runtime)", f"{rows['runtime'] / rows['live']:.2f}x",
                  "what grading live saves against grading in a branch")
    table.add_row("ratio fresh container / Sprout branch grade (runtime)", f"{baseline / rows['runtime']:.2f}x", "")
    console.print(table)


if __name__ == "__main__":
    main()
