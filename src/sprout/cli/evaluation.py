"""`sprout prepare`, `sprout gate`, `sprout evaluate`, `sprout benchmark`: datasets pinned and gated, tasks
evaluated with SPROUT or a baseline at equal budget."""

import argparse
import os
from pathlib import Path

from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..console import console, errors
from ..method.search import Method
from . import flags

METHODS: list[Method] = ["sprout", "restarts", "single"]
EVALUATE = (
    "Evaluates one task, pinned (its dataset's digest and preparation manifest), with SPROUT (the first attempt; "
    "when it fails, a reviewer picks turns before the mistake and each round branches from them) or a baseline "
    "(restarts at SPROUT's budget, or a single attempt). Attempts run here, or as Run Store jobs when "
    "SPROUT_RUNSTORE_URL and SPROUT_RUNSTORE_TOKEN are set. The same run into the same --output resumes. Output: "
    "summary.json, attempts/, reviews/, verifier/ (`sprout report task OUTPUT`).")
BENCHMARK = (
    "Evaluates every runnable task of a prepared dataset with each method, each evaluation in a process of its "
    "own logging to OUTPUT/logs/, at most --workers at once; run again to resume. Writes OUTPUT/results.md and "
    "results.json: a table per task and per method (solve rate, pass@budget at equal budget).")


def cmd_prepare(args: argparse.Namespace) -> int:
    from ..eval.gate import describe_exclusion, flaky_exclusion
    from ..eval.prepare import prepare
    from ..sandbox import Store
    from ..tasks.dataset import describe, load_task_ids

    task_ids = load_task_ids(args.task_ids_file, args.tasks_dir) if args.task_ids_file else None
    exclusion = flaky_exclusion(args.exclude_flaky) if args.exclude_flaky else None
    store = None if args.no_images else Store(args.store)
    manifest = prepare(args.tasks_dir, args.output, name=args.name, store=store, task_ids=task_ids, pull=args.pull,
                       exclude_flaky=exclusion)
    if manifest.task_ids:
        console.print(f"tasks: {describe(manifest.task_ids)}")
    if exclusion:
        console.print(describe_exclusion(exclusion), markup=False)
    for task in manifest.tasks:
        if task.problem:
            errors.print(f"skipped: {task.problem}")
    ready = sum(1 for t in manifest.tasks if not t.problem)
    console.print(f"{manifest.dataset.name}: {ready} of {len(manifest.tasks)} tasks ready; wrote {args.output}")
    console.print(f"dataset digest {manifest.dataset.digest}")
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    from ..eval.gate import GateConfig, run_gate, summary_line, summary_table
    from ..tasks.dataset import describe, load_task_ids

    config = flags.build(GateConfig, tasks_dir=args.tasks_dir, output=args.output, workers=args.workers,
                        tasks=flags.flatten(args.tasks), task_ids_file=args.task_ids_file,
                        no_build_cache=args.no_build_cache, pull=args.pull, store=args.store,
                        runtime_bin=args.runtime_bin, backend=args.backend, trials=args.trials)
    if config.task_ids_file:
        console.print(f"gate: {describe(load_task_ids(config.task_ids_file, config.tasks_dir).record)}")
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        summary = run_gate(config, progress=progress)
    console.print(summary_table(summary))
    console.print(summary_line(summary))
    console.print(f"logs: {args.output}/<task>/, summary: {args.output / 'summary.json'}")
    return 0 if summary.passed == len(summary.results) and summary.results else 1


def evaluation_options(args: argparse.Namespace) -> dict:
    """The evaluation flags as EvaluationOptions' fields (what `add_evaluation_flags` added)."""
    from ..eval.evaluate import EvaluationOptions

    return {name: getattr(args, name) for name in EvaluationOptions.model_fields if hasattr(args, name)}


def cmd_evaluate(args: argparse.Namespace) -> int:
    from ..eval.evaluate import EvaluateConfig, evaluate

    _set_model_retries(args.model_retries)
    config = flags.build(EvaluateConfig, task_dir=args.task_dir, output=args.output, method=args.method,
                            **evaluation_options(args))
    return 1 if evaluate(config).status == "error" else 0


def cmd_benchmark(args: argparse.Namespace) -> int:
    from ..eval.benchmark import BenchmarkConfig, run_benchmark
    from ..eval.evaluate import EvaluationOptions

    _set_model_retries(args.model_retries)
    config = flags.build(BenchmarkConfig, tasks_dir=args.tasks_dir, output=args.output, methods=args.methods,
                             tasks=flags.flatten(args.tasks), task_ids_file=args.task_ids_file, workers=args.workers,
                             exclude_flaky=args.exclude_flaky, evaluation=flags.build(EvaluationOptions, **evaluation_options(args)))
    return 1 if run_benchmark(config) else 0


def _set_model_retries(retries: int) -> None:
    """mini-swe-agent reads its model calls' tries from the environment (evaluations in other processes of
    this command inherit it)."""
    os.environ["MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT"] = str(max(1, retries))


def add_evaluation_flags(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The flags an evaluation and a benchmark share (sprout.eval.evaluate.EvaluationOptions)."""
    flags.add(group, "dataset_digest", "preparation_manifest", "model", "model_endpoint", "model_key_env",
              "model_endpoint_name", "model_class")
    group.add_argument("--rounds", type=int, default=2, help="SPROUT's review and branch rounds (default 2)")
    group.add_argument("--branches", type=int, nargs="+", default=[4, 3], metavar="B",
                       help="branches per round, one number per round (default 4 3); also sets the restarts budget")
    group.add_argument("--review-model", help="the reviewer's model (default: --model)")
    group.add_argument("--review-endpoint", metavar="URL", help="the reviewer's base URL (default: the agent's)")
    group.add_argument("--review-key-env", metavar="VAR",
                       help="the variable holding the reviewer's key (default: the agent's); in this process only")
    group.add_argument("--review-endpoint-name", metavar="NAME",
                       help="over a Run Store: the reviewer's endpoint configured on the workers (default: the agent's)")
    group.add_argument("--review-retries", type=int, default=2, metavar="N",
                       help="calls again after an unusable review answer, before the fallback rule (default 2)")
    group.add_argument("--review-changes", action="store_true",
                       help="the reviewer also reads what each turn changed on disk (files added, changed, removed); "
                            "off by default, recorded in the summary")
    group.add_argument("--no-early-stop", dest="early_stop", action="store_false",
                       help="run every planned attempt even after one scores 1 (by default the first to score 1 "
                            "cancels its running siblings)")
    group.add_argument("--parallel", type=int, metavar="N", help=(
        "attempts at once: a round's branches in threads here, or jobs submitted at once to a Run Store (default: the "
        "round's branch count; restarts: the largest --branches value, in waves); here, at most the host's slots "
        "($SPROUT_HOST_SLOTS), shared by every evaluation and gate on the host"))
    group.add_argument("--budget-by", choices=["turns", "tokens"], default="turns",
                       help="what the restarts baseline's equal budget counts (default turns): limit x (1 + sum(branches))")
    flags.add(group, "step_limit", "token_limit", "wall_time_limit", "command_timeout", "model_retries")
    group.add_argument("--seed", type=int, default=0, help="the sampling seed sent to the reviewer (default 0)")
    flags.add(group, "store", "runtime_bin", "backend", "pull")
    group.add_argument("--keep-checkpoints", action="store_true",
                       help="keep the attempts' checkpoints after a finished evaluation (to branch from them later)")
    group.add_argument("--regrade", type=int, default=0, metavar="N", help=(
        "grade each graded attempt N more times from its final checkpoint, in branches, and record its pass rate "
        "(a 'solved' that is the verifier's luck shows below 100%%; not over a Run Store; default 0)"))
    group.add_argument("--allow-dirty", action="store_true",
                       help="run from a checkout with uncommitted changes (development; recorded in the summary)")
    group.add_argument("--overwrite", action="store_true", help=(
        "start afresh: remove what --output holds (and its checkpoints) instead of resuming or refusing"))
    group.add_argument("--affinity-timeout", type=float, default=60.0, metavar="SECONDS", help=(
        "over a Run Store: how long a branch or grade waits for the host holding its checkpoint before any worker "
        "takes it and ships the checkpoint (default 60)"))
    flags.add(group, "quiet")


def _task_choice(parser: argparse.ArgumentParser) -> None:
    chosen = parser.add_mutually_exclusive_group()
    flags.add(chosen, "tasks")
    flags.add(chosen, "task_ids_file")


def add(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("prepare", help="pin a dataset: Harbor digests, task images, a preparation manifest",
                       description="Computes every task's Harbor digest and the dataset's, builds each runnable task's "
                       "image and writes the manifest `sprout evaluate` and `sprout benchmark` check; prints the "
                       "dataset digest (pass it as --dataset-digest).")
    flags.add(s, "tasks_dir")
    flags.output(s, "the manifest to write (JSON)")
    s.add_argument("--name", help="the dataset's name, org/name (default: dataset.toml's, else local/<dir name>)")
    flags.add(s, "task_ids_file", "exclude_flaky")
    s.add_argument("--no-images", action="store_true", help="only digests: do not pull or build the task images")
    flags.add(s, "pull", "store")
    s.set_defaults(func=cmd_prepare)

    s = sub.add_parser("gate", help="gate a dataset: each task's oracle must score 1 and doing nothing 0",
                       description="Gates a dataset of Harbor tasks: each task's oracle (solution/solve.sh) must score 1 "
                       "and doing nothing must score 0, graded by Harbor's verifier in the live sandbox after the "
                       "final checkpoint; as Run Store jobs when a Run Store is configured.")
    flags.add(s, "tasks_dir")
    flags.output(s, "the per-task logs and summary.json (default runs/gate)", default=Path("runs/gate"))
    s.add_argument("--workers", type=int, default=8, help=(
        "tasks gated at once (here: at most the host's slots, $SPROUT_HOST_SLOTS, shared with evaluations; default 8)"))
    _task_choice(s)
    s.add_argument("--no-build-cache", action="store_true", help="rebuild task images without podman's cache")
    s.add_argument("--trials", type=int, default=1, metavar="K", help=(
        "run each task's gate K times, concurrently within --workers and the host's slots: a task whose trials "
        "disagree is flaky, and the summary lists each flaky task's pass rates (default 1)"))
    flags.add(s, "pull", "store", "runtime_bin", "backend")
    s.set_defaults(func=cmd_gate)

    s = sub.add_parser("evaluate", help="evaluate one task with SPROUT (review + branch rounds) or a baseline",
                       description=EVALUATE)
    s.add_argument("--task-dir", type=Path, required=True, help="the Harbor task directory to evaluate")
    flags.output(s, "the output directory (e.g. runs/<task>-sprout); resumed when it holds the same run")
    s.add_argument("--method", choices=METHODS, default="sprout", help=(
        "sprout: review and branch rounds (default); restarts: fresh attempts at equal budget; single: one attempt"))
    add_evaluation_flags(s)
    s.set_defaults(func=cmd_evaluate)

    s = sub.add_parser("benchmark", help="evaluate every task of a dataset with one or more methods",
                       description=BENCHMARK)
    flags.add(s, "tasks_dir")
    flags.output(s, "the benchmark's output directory (resumed if it exists)")
    s.add_argument("--methods", nargs="+", choices=METHODS, default=["sprout", "restarts"],
                   help="the methods to compare (default: sprout restarts)")
    _task_choice(s)
    flags.add(s, "exclude_flaky")
    s.add_argument("--workers", type=int, default=4, help=(
        "evaluations running at once (default 4); their attempts share the host's slots ($SPROUT_HOST_SLOTS)"))
    add_evaluation_flags(s.add_argument_group("evaluation flags (passed to every evaluation)"))
    s.set_defaults(func=cmd_benchmark)

