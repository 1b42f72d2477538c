"""A dataset's sanity gate, `run_gate(GateConfig)`: for every task, the reference solution (oracle) must
score 1 and doing nothing (nop) must score 0, each graded by Harbor's own verifier in its live sandbox after
its final checkpoint.

OUTPUT/<task>/ holds gate.log, build.log, oracle/ and nop/ (Harbor's trial layout: agent/oracle.txt,
verifier/test-stdout.txt, verifier/reward.*) and result.json; OUTPUT/summary.json holds them all. With
`trials` K > 1 each task's gate runs K times (concurrently, each trial in a slot of its own or as a Run
Store job), in OUTPUT/<task>/trial-<k>/, and OUTPUT/<task>/result.json gives the verdict over them: a
task whose trials disagree is `flaky`, with the share of trials in which its oracle scored 1 and its nop 0.
OUTPUT/harbor/<name>/ is the same gate as a Harbor job (`harbor view OUTPUT/harbor`; see harbor_job).
"""

import asyncio
import hashlib
import logging
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone
from pathlib import Path

from harbor.models.task.task import Task
from pydantic import BaseModel, ConfigDict, Field
from rich.progress import Progress
from rich.table import Table

from ..errors import UsageError
from ..jobs.payloads import GatePayload
from ..jobs.remote import configured_client, run_job
from ..sandbox import SproutError, Store, backends
from ..sandbox.backends import BackendName
from ..sandbox.slots import HostSlots
from ..tasks import load_tasks, task_name
from ..tasks.dataset import TaskIdsFile, load_task_ids
from ..tasks.gate import Attempt, TaskGate, combine_trials, gate_task
from ..tasks.pull import PullPolicy, pull_policy
from .harbor_job import write_harbor_gate
from .provenance import FlakyExclusion


class FlakyTask(BaseModel):
    task: str
    oracle_pass_rate: float  # the share of trials in which the oracle scored 1
    nop_zero_rate: float  # the share of trials in which doing nothing scored 0


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
    trials: int = 1
    flaky: int = 0
    flaky_tasks: list[FlakyTask] = []
    stand_in_tasks: list[str] = []  # tasks whose image is, or is built on, an offline stand-in base image

    def flaky_names(self) -> list[str]:
        return [f.task for f in self.flaky_tasks]


def flaky_exclusion(path: Path) -> FlakyExclusion:
    """The flaky tasks of a gate summary (`sprout gate --trials K`'s summary.json), to leave out."""
    try:
        data = Path(path).read_bytes()
        summary = GateSummary.model_validate_json(data)
    except OSError as e:
        raise SproutError(f"--exclude-flaky: cannot read {path}: {e.strerror}") from None
    except ValueError:
        raise SproutError(f"--exclude-flaky: {path} is not a gate summary (sprout gate's summary.json)") from None
    if summary.trials < 2:
        raise SproutError(f"--exclude-flaky: the gate summary {path} ran each task once, which cannot tell a flaky "
                          "task: gate with --trials K (K >= 2)")
    return FlakyExclusion(gate_summary=str(path), sha256=hashlib.sha256(data).hexdigest(), trials=summary.trials,
                          tasks=summary.flaky_names())


def describe_exclusion(exclusion: FlakyExclusion) -> str:
    return (f"left out as flaky by {exclusion.gate_summary} ({exclusion.trials} trials): "
            f"{', '.join(exclusion.tasks) or 'none'}")


def _error_result(name: str, reason: str, log_dir: Path) -> TaskGate:
    """The result of a task the gate could not run (malformed, or an unexpected failure); its result.json too."""
    result = TaskGate(task=name, verdict="error", reason=reason, log_dir=str(log_dir))
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "result.json").write_text(result.model_dump_json(indent=2))
    return result


class GateConfig(BaseModel):
    """A gate of a dataset: which tasks, where its logs go, and where its sandboxes run."""

    model_config = ConfigDict(extra="forbid")

    tasks_dir: Path = Field(description="the dataset: a directory of Harbor task directories")
    output: Path = Field(Path("runs/gate"), description="per-task logs and summary.json")
    workers: int = Field(8, ge=1, description="tasks gated at once (here: at most the host's slots)")
    tasks: list[str] | None = Field(None, description="only these tasks (directory names)")
    task_ids_file: Path | None = Field(None, description="only the tasks this file names (recorded)")
    no_build_cache: bool = Field(False, description="rebuild task images without podman's cache")
    pull: PullPolicy | None = Field(None, description="when task images are pulled (default $SPROUT_PULL_POLICY)")
    store: Path | None = Field(None, description="the btrfs store (default $SPROUT_STORE)")
    runtime_bin: Path | None = Field(None, description="the confined runtime (default $SPROUT_RUNTIME_BIN)")
    backend: BackendName = Field(backends.DEFAULT, description="the sandboxes' backend")
    trials: int = Field(1, ge=1, description="runs of each task's gate (oracle and nop), concurrently; trials "
                        "that disagree make the task flaky")


def run_gate(config: GateConfig, *, progress: Progress | None = None) -> GateSummary:
    """Gates every task of the dataset (or the chosen ones) with a bounded pool of `workers` threads, here
    or as Run Store gate jobs; writes OUTPUT/summary.json."""
    if config.tasks and config.task_ids_file:
        raise UsageError("pass --tasks or --task-ids-file, not both")
    task_ids = load_task_ids(config.task_ids_file, config.tasks_dir) if config.task_ids_file else None
    started, started_at = time.monotonic(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    out, source = config.output.resolve(), config.tasks_dir.resolve()
    if out == source or source in out.parents or out in source.parents:
        raise SproutError(f"--output {config.output} must be outside the tasks directory {config.tasks_dir}")
    tasks = load_tasks(config.tasks_dir, task_ids.ids if task_ids else config.tasks)
    if not tasks.tasks and not tasks.problems:
        raise SproutError(f"no tasks in {config.tasks_dir} (a task is a directory with a task.toml)")
    config.output.mkdir(parents=True, exist_ok=True)
    gate = _TaskGates(config, progress)
    results = []
    for problem in tasks.problems:
        shutil.rmtree(config.output / problem.name, ignore_errors=True)
        results.append(_error_result(problem.name, problem.problem, config.output / problem.name))
        _report(progress, results[-1])
    total = len(tasks.tasks) + len(tasks.problems)
    overall = progress.add_task(f"gate: {len(results)}/{total} done", total=None) if progress else None
    trials: dict[str, list[TaskGate]] = {task_name(task): [] for task in tasks.tasks}
    if config.trials > 1:  # a task's trials go in its directory: nothing of an earlier gate stays beside them
        for name in trials:
            shutil.rmtree(config.output / name, ignore_errors=True)
    with ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="gate") as pool:
        runs = [pool.submit(gate.one, task, k) for k in range(1, config.trials + 1) for task in tasks.tasks]
        for future in as_completed(runs):
            name, trial = future.result()
            trials[name].append(trial)
            if len(trials[name]) < config.trials:
                continue
            results.append(_task_result(trials[name], config.output / name))
            _report(progress, results[-1])
            if progress is not None and overall is not None:
                progress.update(overall, description=f"gate: {len(results)}/{total} done")
    if progress is not None and overall is not None:
        progress.remove_task(overall)
    summary = _summary(config, results, task_ids.record if task_ids else None, started_at, time.monotonic() - started)
    every_trial = [r for r in results if r.task not in trials] + [t for ts in trials.values() for t in ts]
    task_dirs = {task_name(task): Path(task.task_dir).resolve() for task in tasks.tasks}
    task_dirs |= {problem.name: (config.tasks_dir / problem.name).resolve() for problem in tasks.problems}
    _write_harbor_gate(config, every_trial, task_dirs, datetime.fromisoformat(started_at), progress)
    return summary


def _write_harbor_gate(config: GateConfig, trials: list[TaskGate], task_dirs: dict[str, Path],
                       started_at: datetime, progress: Progress | None) -> None:
    """The gate as a Harbor job too (OUTPUT/harbor/); a failure there is a warning, never the gate's end."""
    try:
        write_harbor_gate(config.output, trials, task_dirs, started_at)
    except (ValueError, OSError) as e:  # pydantic's ValidationError is a ValueError
        warning = f"warning: the Harbor job files were not written: {' '.join(str(e).split())[:300]}"
        if progress is not None:
            progress.console.print(warning, markup=False)
        else:
            logging.getLogger(__name__).warning(warning)


def _task_result(trials: list[TaskGate], log_dir: Path) -> TaskGate:
    """A task's result: its one gate, or its verdict over K trials (written to its result.json)."""
    if len(trials) == 1:
        return trials[0]
    result = combine_trials(sorted(trials, key=lambda t: t.log_dir), log_dir)
    (log_dir / "result.json").write_text(result.model_dump_json(indent=2))
    return result


def _summary(config: GateConfig, results: list[TaskGate], task_ids: TaskIdsFile | None, started_at: str,
             wall_s: float) -> GateSummary:
    """The summary of every task's result, written to OUTPUT/summary.json."""
    results.sort(key=lambda r: r.task)
    counts = {v: sum(r.verdict == v for r in results) for v in ("pass", "fail", "flaky", "error")}
    flaky = [FlakyTask(task=r.task, oracle_pass_rate=r.oracle_pass_rate or 0.0, nop_zero_rate=r.nop_zero_rate or 0.0)
             for r in results if r.verdict == "flaky"]
    summary = GateSummary(tasks_dir=str(config.tasks_dir), workers=config.workers, started_at=started_at,
                          wall_s=wall_s, passed=counts["pass"], failed=counts["fail"], errors=counts["error"],
                          task_ids=task_ids, results=results, trials=config.trials, flaky=counts["flaky"],
                          flaky_tasks=flaky, stand_in_tasks=[r.task for r in results if r.image_stand_in])
    (config.output / "summary.json").write_text(summary.model_dump_json(indent=2))
    return summary


class _TaskGates:
    """Gates one task at a time (a thread each): here in one of the host's slots, or as a Run Store job."""

    def __init__(self, config: GateConfig, progress: Progress | None):
        self.config, self.progress, self.pull = config, progress, pull_policy(config.pull)
        self.client = configured_client()  # a Run Store: each task becomes a `gate` job for its workers
        self.store_root = config.store
        if self.client is None:  # fails early and clearly without a store
            self.store_root = Store(config.store, runtime_bin=config.runtime_bin, backend=config.backend).root
        self.rebuild_before = time.time() if config.no_build_cache else None
        self.group_id = f"gate-{uuid.uuid4().hex[:12]}"

    def one(self, task: Task, trial: int) -> tuple[str, TaskGate]:
        """(the task's name, its gate's `trial`-th run: OUTPUT/<task>/, or OUTPUT/<task>/trial-<k>/ with trials)."""
        name, progress = task_name(task), self.progress
        shown = name if self.config.trials == 1 else f"{name} (trial {trial})"
        log_dir = self.config.output / name
        if self.config.trials > 1:
            log_dir = log_dir / f"trial-{trial}"
        row = progress.add_task(f"{shown}: waiting", total=None) if progress else None

        def on_phase(phase: str) -> None:
            if progress is not None and row is not None:
                progress.update(row, description=f"{shown}: {phase}")

        try:
            if self.client is not None:
                return name, self._remote(task, log_dir, on_phase)
            return name, self._here(task, log_dir, on_phase)
        except Exception as e:  # noqa: BLE001 - not the task's fault (e.g. the store); the other tasks go on
            return name, _error_result(name, f"gate failed: {type(e).__name__}: {e}", log_dir)
        finally:
            if progress is not None and row is not None:
                progress.remove_task(row)

    def _remote(self, task: Task, log_dir: Path, on_phase) -> TaskGate:
        on_phase("queued as a Run Store job")
        payload = GatePayload(task_dir=str(Path(task.task_dir).resolve()), pull=self.pull,
                              log_dir=str(log_dir.resolve()), rebuild_before=self.rebuild_before,
                              backend=self.config.backend)
        return TaskGate.model_validate(run_job(self.client, payload, group_id=self.group_id))

    def _here(self, task: Task, log_dir: Path, on_phase) -> TaskGate:
        config = self.config  # a Store per thread: its SQLite connection too
        store = Store(self.store_root, runtime_bin=config.runtime_bin, backend=config.backend)
        with HostSlots(store.root).hold(on_wait=lambda: on_phase("waiting for a free slot on this host")):
            return asyncio.run(gate_task(store, task, log_dir, rebuild_before=self.rebuild_before, pull=self.pull,
                                         on_phase=on_phase))


MARKS = {"pass": "[green]pass[/green]", "fail": "[red]FAIL[/red]", "flaky": "[magenta]FLAKY[/magenta]",
         "error": "[yellow]ERROR[/yellow]"}


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
    flaky = f", {summary.flaky} flaky" if summary.trials > 1 else ""
    trials = f", {summary.trials} trials each" if summary.trials > 1 else ""
    return (f"gate: {summary.passed}/{total} passed, {summary.failed} failed{flaky}, {summary.errors} error(s) "
            f"in {summary.wall_s:.1f}s with {summary.workers} worker(s){trials}")


if __name__ == "__main__":  # the seed's form of `sprout gate`
    from ..cli import alias

    alias("sprout.eval.gate")
