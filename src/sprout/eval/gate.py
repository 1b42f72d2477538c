"""python -m sprout.eval.gate: a dataset's sanity gate. For every task, the reference solution
(oracle) must score 1 and doing nothing (nop) must score 0, each graded by Harbor's own verifier in
its live sandbox after its final checkpoint.

    python -m sprout.eval.gate --tasks-dir DIR --output runs/gate --workers 8 \
        [--tasks a,b | --task-ids-file IDS] [--no-build-cache]

runs/gate/<task>/ holds gate.log, build.log, oracle/ and nop/ (Harbor's trial layout: agent/oracle.txt,
verifier/test-stdout.txt, verifier/reward.*) and result.json; runs/gate/summary.json holds them all.
"""

import argparse
import asyncio
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone
from pathlib import Path

from harbor.models.task.task import Task
from pydantic import BaseModel
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..console import console, run_cli
from ..jobs.payloads import GatePayload
from ..jobs.remote import configured_client, run_job
from ..sandbox import SproutError, Store, backends
from ..sandbox.slots import HostSlots
from ..tasks import load_tasks, task_name
from ..tasks.dataset import TaskIds, TaskIdsFile, describe, load_task_ids
from ..tasks.gate import Attempt, TaskGate, gate_task
from ..tasks.pull import PULL_HELP, PULL_POLICIES, PullPolicy, pull_policy


class GateSummary(BaseModel):
    tasks_dir: str
    workers: int
    started_at: str
    wall_s: float
    passed: int
    failed: int
    errors: int
    task_ids: TaskIdsFile | None = None  # the --task-ids-file that chose the tasks (None: all or --tasks)
    results: list[TaskGate]


def _error_result(name: str, reason: str, output: Path) -> TaskGate:
    """The result of a task the gate could not run (malformed, or an unexpected failure); its result.json too."""
    log_dir = output / name
    result = TaskGate(task=name, verdict="error", reason=reason, log_dir=str(log_dir))
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "result.json").write_text(result.model_dump_json(indent=2))
    return result


def run_gate(tasks_dir: Path, output: Path, *, workers: int, only: list[str] | None = None,
             task_ids: TaskIds | None = None, no_build_cache: bool = False, store_root: Path | None = None,
             runtime_bin: Path | None = None, pull: PullPolicy | None = None, backend: str = "container",
             progress: Progress | None = None) -> GateSummary:
    """Gates every task of a dataset (those in `only`, or in `task_ids`) with a bounded pool of `workers`
    threads; writes output/summary.json."""
    started, started_at = time.monotonic(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    out, source = output.resolve(), Path(tasks_dir).resolve()
    if out == source or source in out.parents or out in source.parents:
        raise SproutError(f"--output {output} must be outside the tasks directory {tasks_dir}")
    tasks = load_tasks(tasks_dir, task_ids.ids if task_ids else only)
    if not tasks.tasks and not tasks.problems:
        raise SproutError(f"no tasks in {tasks_dir} (a task is a directory with a task.toml)")
    output.mkdir(parents=True, exist_ok=True)
    client = configured_client()  # a Run Store: each task becomes a `gate` job for its workers
    if client is None:
        # fails early and clearly without a store
        store_root = Store(store_root, runtime_bin=runtime_bin, backend=backend).root
    rebuild_before = time.time() if no_build_cache else None
    group_id = f"gate-{uuid.uuid4().hex[:12]}"
    results = []
    for problem in tasks.problems:
        shutil.rmtree(output / problem.name, ignore_errors=True)
        results.append(_error_result(problem.name, problem.problem, output))
        _report(progress, results[-1])

    def one(task: Task) -> TaskGate:
        row = progress.add_task(f"{task_name(task)}: waiting", total=None) if progress else None

        def on_phase(phase: str) -> None:
            if progress is not None:
                progress.update(row, description=f"{task_name(task)}: {phase}")

        try:
            if client is not None:
                on_phase("queued as a Run Store job")
                payload = GatePayload(task_dir=str(Path(task.task_dir).resolve()), pull=pull,
                                      log_dir=str((output / task_name(task)).resolve()),
                                      rebuild_before=rebuild_before, backend=backend)
                result = run_job(client, payload, group_id=group_id)
                return TaskGate.model_validate(result)
            # one per thread: its SQLite connection too
            store = Store(store_root, runtime_bin=runtime_bin, backend=backend)
            with HostSlots(store.root).hold(on_wait=lambda: on_phase("waiting for a free slot on this host")):
                return asyncio.run(gate_task(store, task, output / task_name(task), rebuild_before=rebuild_before,
                                             pull=pull, on_phase=on_phase))
        except Exception as e:  # noqa: BLE001 - not the task's fault (e.g. the store); the other tasks go on
            return _error_result(task_name(task), f"gate failed: {type(e).__name__}: {e}", output)
        finally:
            if progress is not None:
                progress.remove_task(row)

    total = len(tasks.tasks) + len(tasks.problems)
    overall = progress.add_task(f"gate: {len(results)}/{total} done", total=None) if progress else None
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="gate") as pool:
        for future in as_completed([pool.submit(one, task) for task in tasks.tasks]):
            results.append(future.result())
            _report(progress, results[-1])
            if progress is not None:
                progress.update(overall, description=f"gate: {len(results)}/{total} done")
    if progress is not None:
        progress.remove_task(overall)
    results.sort(key=lambda r: r.task)
    counts = {v: sum(r.verdict == v for r in results) for v in ("pass", "fail", "error")}
    summary = GateSummary(tasks_dir=str(tasks_dir), workers=workers, started_at=started_at,
                          wall_s=time.monotonic() - started, passed=counts["pass"], failed=counts["fail"],
                          errors=counts["error"], task_ids=task_ids.record if task_ids else None,
                          results=results)
    (output / "summary.json").write_text(summary.model_dump_json(indent=2))
    return summary


MARKS = {"pass": "[green]pass[/green]", "fail": "[red]FAIL[/red]", "error": "[yellow]ERROR[/yellow]"}


def _reward(attempt: Attempt | None) -> str:
    if attempt is None or attempt.grade is None or attempt.grade.reward is None:
        return "-"
    return f"{attempt.grade.reward:g}"


def _report(progress: Progress | None, result: TaskGate) -> None:
    if progress is not None:
        progress.console.print(f"{MARKS[result.verdict]} {result.task}  oracle={_reward(result.oracle)} "
                               f"nop={_reward(result.nop)}  {result.duration_s:.1f}s"
                               + (f"  {result.reason}" if result.reason else ""), markup=True)


def summary_table(summary: GateSummary) -> Table:
    table = Table("task", "oracle reward", "nop reward", "verdict", "time", "reason", title="gate")
    for r in summary.results:
        reason = (r.reason or "").removeprefix(f"task {r.task}: ")  # the row names the task already
        table.add_row(r.task, _reward(r.oracle), _reward(r.nop), MARKS[r.verdict], f"{r.duration_s:.1f}s", reason)
    return table


def summary_line(summary: GateSummary) -> str:
    total = len(summary.results)
    return (f"gate: {summary.passed}/{total} passed, {summary.failed} failed, {summary.errors} error(s) "
            f"in {summary.wall_s:.1f}s with {summary.workers} worker(s)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sprout.eval.gate", description=(
        "Gate a dataset of Harbor tasks: each task's oracle (solution/solve.sh) must score 1 and doing "
        "nothing must score 0, graded by Harbor's verifier in the live sandbox after the final checkpoint."))
    p.add_argument("--tasks-dir", type=Path, required=True, help="directory of Harbor task directories")
    p.add_argument("--output", type=Path, default=Path("runs/gate"), help="per-task logs and summary.json")
    p.add_argument("--workers", type=int, default=8,
                   help="tasks gated in parallel (in-process: at most the host's slots, $SPROUT_HOST_SLOTS, "
                        "shared with evaluations on this host)")
    chosen = p.add_mutually_exclusive_group()
    chosen.add_argument("--tasks", help="comma-separated task (directory) names to gate; default: all")
    chosen.add_argument("--task-ids-file", type=Path, metavar="IDS",
                        help="gate the tasks named in this file (one directory name a line, # comments), "
                             "e.g. SWE-bench Pro's v2/hard51_ids.txt; recorded in summary.json")
    p.add_argument("--no-build-cache", action="store_true", help="rebuild task images without podman's cache")
    p.add_argument("--pull", choices=PULL_POLICIES, default=None, help=PULL_HELP)
    p.add_argument("--runtime-bin", type=Path, default=None,
                   help="run commands through this sprout-runtime (default: $SPROUT_RUNTIME_BIN, else podman exec)")
    p.add_argument("--store", type=Path, default=None, help="btrfs store (default: $SPROUT_STORE or ~/sprout-btrfs)")
    p.add_argument("--backend", choices=backends.names(), default=backends.DEFAULT, help=backends.help_text())
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.workers < 1:
        raise SproutError("--workers must be at least 1")
    only = [name.strip() for name in args.tasks.split(",") if name.strip()] if args.tasks else None
    task_ids = load_task_ids(args.task_ids_file, args.tasks_dir) if args.task_ids_file else None
    if task_ids:
        console.print(f"gate: {describe(task_ids.record)}")
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        summary = run_gate(args.tasks_dir, args.output, workers=args.workers, only=only, task_ids=task_ids,
                           no_build_cache=args.no_build_cache, store_root=args.store,
                           runtime_bin=args.runtime_bin, pull=pull_policy(args.pull), backend=args.backend,
                           progress=progress)
    console.print(summary_table(summary))
    console.print(summary_line(summary))
    console.print(f"logs: {args.output}/<task>/, summary: {args.output / 'summary.json'}")
    return 0 if summary.passed == len(summary.results) and summary.results else 1


if __name__ == "__main__":
    run_cli(main)
