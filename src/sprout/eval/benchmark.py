"""Every task of a dataset with one or more methods: `run_benchmark(BenchmarkConfig)`.

Each (task, method) is one evaluation (sprout.eval.evaluate) writing OUT/<task>-<method>/, run in a
process of its own (its log: OUT/logs/<task>-<method>.log), at most `workers` at a time. Run it again to
resume: finished evaluations are kept, interrupted ones continue. Tasks the manifest marks as not
runnable are skipped. `tasks` or `task_ids_file` (one task directory name a line, e.g. SWE-bench Pro's
v2/hard51_ids.txt) pick a subset of the manifest's tasks. At the end: OUT/results.md and OUT/results.json,
a table per task (solved by which attempt, turns, tokens) and per method (solve rate and pass@budget at
equal budget); results.json records the task-ids file that chose the tasks (this run's, else the
manifest's).
"""

import json
import multiprocessing
import traceback
from concurrent.futures import ProcessPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..console import console, errors
from ..errors import SproutError, UsageError
from ..method.search import Method
from ..tasks.dataset import TaskIdsFile, describe, load_task_ids
from .evaluate import EvaluateConfig, EvaluationOptions, check_rounds, evaluate
from .gate import describe_exclusion, flaky_exclusion
from .provenance import FlakyExclusion, PreparationManifest, check_source, dataset_digest, read_manifest
from .results import find_summaries, method_rows, pass_markdown, pass_table, task_markdown, task_table
from .summary import SUMMARY, EvaluationSummary, read_summary

METHODS: tuple[Method, ...] = ("sprout", "restarts", "single")


class BenchmarkConfig(BaseModel):
    """A benchmark: which tasks and methods, where its output goes, and how every evaluation runs."""

    model_config = ConfigDict(extra="forbid")

    tasks_dir: Path = Field(description="the dataset: a directory of Harbor tasks")
    output: Path = Field(description="the benchmark's output directory (resumed if it exists)")
    methods: list[Method] = Field(["sprout", "restarts"], description="the methods to compare")
    tasks: list[str] | None = Field(None, description="only these tasks (directory names)")
    task_ids_file: Path | None = Field(None, description="only the tasks this file names")
    exclude_flaky: Path | None = Field(None, description="leave out the tasks this gate summary found flaky "
                                       "(else those the manifest left out); recorded in results.json")
    workers: int = Field(4, description="evaluations at once (their attempts share the host's slots)")
    evaluation: EvaluationOptions = Field(description="how every evaluation runs")


def run_benchmark(config: BenchmarkConfig) -> list[str]:
    """Runs (or resumes) every evaluation; writes results.md and results.json; returns the evaluations that
    failed (`<task>-<method>`)."""
    check_rounds(config.evaluation.rounds, config.evaluation.branches)
    if config.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {config.workers}")
    if config.tasks and config.task_ids_file:
        raise UsageError("pass --tasks or --task-ids-file, not both")
    manifest, jobs, ids_record, exclusion = _plan(config)
    console.print(f"[bold]benchmark[/bold] {manifest.dataset.name} ({len(jobs)} evaluations: "
                  f"{len(jobs) // len(config.methods)} tasks x {' '.join(config.methods)}) · {config.workers} workers · "
                  f"output {config.output}", markup=True)
    failed = _run_all(config, jobs)
    summaries = [s for s in find_summaries(config.output) if (s.config.task, s.config.method) in set(jobs)]
    if summaries:
        _write_results(config, manifest, ids_record, exclusion, summaries)
    if failed:
        errors.print(f"{len(failed)} evaluation(s) failed: {', '.join(failed)} (run again to resume them)")
    return failed


def _plan(config: BenchmarkConfig) -> tuple[PreparationManifest, list[tuple[str, Method]], TaskIdsFile | None,
                                            FlakyExclusion | None]:
    """The manifest, the (task, method) evaluations to run, the task-ids record and the flaky tasks left out."""
    only, ids_record = config.tasks, None
    if config.task_ids_file is not None:
        task_ids = load_task_ids(config.task_ids_file, config.tasks_dir)
        only, ids_record = task_ids.ids, task_ids.record
    check_source(config.evaluation.allow_dirty)
    computed = dataset_digest(config.tasks_dir)
    if computed != config.evaluation.dataset_digest:
        raise SproutError(f"dataset digest mismatch: --dataset-digest is {config.evaluation.dataset_digest} but the "
                          f"tasks directory {config.tasks_dir} has {computed}")
    manifest = read_manifest(config.evaluation.preparation_manifest)
    tasks = [t for t in manifest.tasks if not only or t.name in only]
    missing = sorted(set(only or []) - {t.name for t in manifest.tasks})
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise SproutError(f"the manifest {config.evaluation.preparation_manifest} does not list {len(missing)} of "
                          f"the chosen tasks: {shown} (prepare them: sprout prepare)")
    if ids_record is None and not config.tasks:
        ids_record = manifest.task_ids  # the subset the manifest was prepared for
    if ids_record:
        console.print(f"tasks: {describe(ids_record)}", markup=False)
    exclusion = flaky_exclusion(config.exclude_flaky) if config.exclude_flaky else manifest.excluded_flaky
    if exclusion:
        tasks = [t for t in tasks if t.name not in exclusion.tasks]
        console.print(describe_exclusion(exclusion), markup=False)
    for task in tasks:
        if task.problem:
            errors.print(f"skipped: {task.problem}")
    jobs = [(t.name, m) for t in tasks if not t.problem for m in config.methods]
    if not jobs:
        raise SproutError("no runnable task to evaluate")
    return manifest, jobs, ids_record, exclusion


def _run_all(config: BenchmarkConfig, jobs: list[tuple[str, Method]]) -> list[str]:
    """Each evaluation in a process of its own (a fresh interpreter: its own store connections, its output
    into its log), at most `workers` at once."""
    failed: list[str] = []
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    context = multiprocessing.get_context("spawn")
    with Progress(*columns, console=console) as progress, \
            ProcessPoolExecutor(max_workers=config.workers, mp_context=context) as pool:
        bar = progress.add_task("evaluating", total=len(jobs))
        futures = {(name, method): pool.submit(evaluate_logged, _evaluation(config, name, method),
                                               config.output / "logs" / f"{name}-{method}.log")
                   for name, method in jobs}
        for (name, method), future in futures.items():
            summary, last_line = future.result()
            if summary is not None and summary.status == "lost":
                failed.append(f"{name}-{method}")
                progress.console.print(f"[yellow]{name} {method}: attempts lost to infrastructure[/yellow] (the others "
                                       "are recorded; running the benchmark again reruns the lost ones)", markup=True)
            elif summary is None or summary.status not in ("solved", "unsolved"):
                failed.append(f"{name}-{method}")
                progress.console.print(f"[red]{name} {method}: failed[/red] ({last_line}; log "
                                       f"{config.output / 'logs' / f'{name}-{method}.log'})", markup=True)
            else:
                result = f"solved by {summary.solved_by}" if summary.solved_by else "unsolved"
                progress.console.print(f"{name} {method}: {result} · {summary.totals.turns} turns", markup=False)
            progress.advance(bar)
    return failed


def _evaluation(config: BenchmarkConfig, task: str, method: Method) -> EvaluateConfig:
    return EvaluateConfig(**(config.evaluation.model_dump() | {"quiet": True}), task_dir=config.tasks_dir / task,
                          output=config.output / f"{task}-{method}", method=method)


def evaluate_logged(config: EvaluateConfig, log: Path) -> tuple[EvaluationSummary | None, str]:
    """One evaluation with its output in `log` (appended: a resumed one adds a session): its summary (None
    when it ended without one) and the log's last line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as sink, redirect_stdout(sink), redirect_stderr(sink):  # this process's consoles too
        print(f"evaluate {config.model_dump_json(exclude_defaults=True)}", flush=True)
        summary: EvaluationSummary | None = None
        try:
            summary = evaluate(config)
        except SproutError as e:
            print(f"error: {e}")
        except Exception:  # noqa: BLE001 - a bug in one evaluation is its failure, kept in its log
            traceback.print_exc()
        if summary is None and (config.output / SUMMARY).exists():
            summary = read_summary(config.output)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return summary, lines[-1] if lines else "(no output)"


def _write_results(config: BenchmarkConfig, manifest: PreparationManifest, ids_record: TaskIdsFile | None,
                   exclusion: FlakyExclusion | None, summaries: list[EvaluationSummary]) -> None:
    console.print(task_table(summaries))
    rows = method_rows(summaries)
    console.print(pass_table(rows))
    title = f"# Benchmark {manifest.dataset.name} ({manifest.dataset.digest})\n\n"
    subset = f"Tasks: {describe(ids_record)}\n\n" if ids_record else ""
    (config.output / "results.md").write_text(title + subset + task_markdown(summaries) + "\n" + pass_markdown(rows))
    (config.output / "results.json").write_text(json.dumps(
        {"dataset": manifest.dataset.model_dump(), "task_ids": ids_record.model_dump() if ids_record else None,
         "excluded_flaky": exclusion.model_dump() if exclusion else None,
         "stand_in_tasks": sorted({s.config.task for s in summaries if s.image.stand_in}),
         "methods": [r.__dict__ for r in rows],
         "evaluations": [{"task": s.config.task, "method": s.config.method, "status": s.status,
                          "solved_by": s.solved_by, "best_reward": s.best_reward, **s.totals.model_dump()}
                         for s in summaries]}, indent=2))
    console.print(f"wrote {config.output / 'results.md'} and results.json; trees: sprout report task {config.output}",
                  markup=False)


if __name__ == "__main__":  # the seed's form of `sprout benchmark`
    from ..cli import alias

    alias("sprout.eval.benchmark")
