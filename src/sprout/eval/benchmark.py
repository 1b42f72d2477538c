"""python -m sprout.eval.benchmark: evaluate every task of a dataset with one or more methods.

    python -m sprout.eval.benchmark --tasks-dir DIR --output runs/bench --dataset-digest sha256:... \\
        --preparation-manifest runs/prep.json --methods sprout restarts --model M --workers 4

Each (task, method) is one `python -m sprout.eval.evaluate` process writing OUT/<task>-<method>/ (its
log: OUT/logs/<task>-<method>.log), at most --workers at a time. Run it again to resume: finished
evaluations are kept, interrupted ones continue. Tasks the manifest marks as not runnable are
skipped. --tasks or --task-ids-file (one task directory name a line, e.g. SWE-bench Pro's
v2/hard51_ids.txt) pick a subset of the manifest's tasks. At the end: OUT/results.md and
OUT/results.json, a table per task (solved by which attempt, turns, tokens) and per method (solve rate
and pass@budget at equal budget); results.json records the task-ids file that chose the tasks (this
run's, else the manifest's). All the evaluation flags below are passed to every evaluation.
"""

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..console import console, errors, run_cli
from ..errors import SproutError
from ..tasks.dataset import TaskIdsFile, describe, load_task_ids
from . import evaluate
from .provenance import check_source, dataset_digest, read_manifest
from .results import find_summaries, method_rows, pass_markdown, pass_table, task_markdown, task_table
from .summary import SUMMARY, read_summary

METHODS = ("sprout", "restarts", "single")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sprout.eval.benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks-dir", type=Path, required=True, help="the dataset: a directory of Harbor tasks")
    p.add_argument("--output", type=Path, required=True, help="benchmark output directory (resumed if it exists)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=["sprout", "restarts"],
                   help="methods to compare (default: sprout restarts)")
    chosen = p.add_mutually_exclusive_group()
    chosen.add_argument("--tasks", nargs="+", metavar="NAME", help="only these tasks (directory names)")
    chosen.add_argument("--task-ids-file", type=Path, metavar="IDS",
                        help="only the tasks named in this file (one directory name a line, # comments)")
    p.add_argument("--workers", type=int, default=4,
                   help="evaluations running at once (default 4); their attempts share the host's slots "
                        "($SPROUT_HOST_SLOTS), so workers x --parallel never oversubscribe the host")
    shared = evaluate.add_arguments(p.add_argument_group("evaluation flags (passed to every evaluation)"),
                                    single_task=False)
    p.set_defaults(shared_actions=shared)
    return p


def shared_argv(args: argparse.Namespace) -> list[str]:
    """The evaluation flags that differ from their defaults, as a command line."""
    argv: list[str] = []
    for action in args.shared_actions:
        value = getattr(args, action.dest)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:  # store_true / store_false
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def _run_one(task_dir: Path, method: str, out: Path, log: Path, argv: list[str]) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "sprout.eval.evaluate", "--task-dir", str(task_dir), "--output", str(out),
           "--method", method, "--quiet", *argv]
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode


def _selection(args: argparse.Namespace) -> tuple[list[str] | None, TaskIdsFile | None]:
    """The task names --tasks or --task-ids-file choose (None: all), and the ids file's record."""
    if args.task_ids_file is None:
        return args.tasks, None
    task_ids = load_task_ids(args.task_ids_file, args.tasks_dir)
    return task_ids.ids, task_ids.record


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    return lines[-1] if lines else "(no output)"


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    evaluate.check_rounds(args.rounds, args.branches)
    if args.workers < 1:
        raise SproutError(f"--workers must be at least 1, got {args.workers}")
    only, ids_record = _selection(args)
    check_source(args.allow_dirty)
    computed = dataset_digest(args.tasks_dir)
    if computed != args.dataset_digest:
        raise SproutError(f"dataset digest mismatch: --dataset-digest is {args.dataset_digest} but the tasks "
                          f"directory {args.tasks_dir} has {computed}")
    manifest = read_manifest(args.preparation_manifest)
    tasks = [t for t in manifest.tasks if not only or t.name in only]
    missing = sorted(set(only or []) - {t.name for t in manifest.tasks})
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise SproutError(f"the manifest {args.preparation_manifest} does not list {len(missing)} of the "
                          f"chosen tasks: {shown} (prepare them: python -m sprout.eval.prepare)")
    if ids_record is None and not args.tasks:
        ids_record = manifest.task_ids  # the subset the manifest was prepared for
    if ids_record:
        console.print(f"tasks: {describe(ids_record)}", markup=False)
    for task in tasks:
        if task.problem:
            errors.print(f"skipped: {task.problem}")
    jobs = [(t.name, m) for t in tasks if not t.problem for m in args.methods]
    if not jobs:
        raise SproutError("no runnable task to evaluate")
    argv_shared = shared_argv(args)
    console.print(f"[bold]benchmark[/bold] {manifest.dataset.name} ({len(jobs)} evaluations: "
                  f"{len(jobs) // len(args.methods)} tasks x {' '.join(args.methods)}) · {args.workers} workers · "
                  f"output {args.output}", markup=True)
    failed: list[str] = []
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("evaluating", total=len(jobs))

        def job(name: str, method: str) -> None:
            out, log = args.output / f"{name}-{method}", args.output / "logs" / f"{name}-{method}.log"
            code = _run_one(args.tasks_dir / name, method, out, log, argv_shared)
            summary = read_summary(out) if (out / SUMMARY).exists() else None
            if code != 0 or summary is None or summary.status not in ("solved", "unsolved"):
                failed.append(f"{name}-{method}")
                progress.console.print(f"[red]{name} {method}: failed[/red] ({_last_line(log)}; log {log})",
                                       markup=True)
            else:
                result = f"solved by {summary.solved_by}" if summary.solved_by else "unsolved"
                progress.console.print(f"{name} {method}: {result} · {summary.totals.turns} turns", markup=False)
            progress.advance(bar)

        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            for future in [pool.submit(job, name, method) for name, method in jobs]:
                future.result()
    summaries = [s for s in find_summaries(args.output) if (s.config.task, s.config.method) in set(jobs)]
    if summaries:
        console.print(task_table(summaries))
        rows = method_rows(summaries)
        console.print(pass_table(rows))
        title = f"# Benchmark {manifest.dataset.name} ({manifest.dataset.digest})\n\n"
        subset = f"Tasks: {describe(ids_record)}\n\n" if ids_record else ""
        (args.output / "results.md").write_text(title + subset + task_markdown(summaries) + "\n"
                                                + pass_markdown(rows))
        (args.output / "results.json").write_text(json.dumps(
            {"dataset": manifest.dataset.model_dump(),
             "task_ids": ids_record.model_dump() if ids_record else None,
             "methods": [r.__dict__ for r in rows],
             "evaluations": [{"task": s.config.task, "method": s.config.method, "status": s.status,
                              "solved_by": s.solved_by, "best_reward": s.best_reward, **s.totals.model_dump()}
                             for s in summaries]}, indent=2))
        console.print(f"wrote {args.output / 'results.md'} and results.json; trees: python -m ops.report task "
                      f"{args.output}", markup=False)
    if failed:
        errors.print(f"{len(failed)} evaluation(s) failed: {', '.join(failed)} (run again to resume them)")
    return 1 if failed else 0


if __name__ == "__main__":
    run_cli(main)
