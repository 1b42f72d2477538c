"""`sprout swe-rebench`: check a SWE-rebench V2 dataset file, write Miles' prompts or Harbor task
directories for it, grade a diff as the official harness does.

`check` loads every row (bad rows are listed by line and id) and prints the file's sha256 (pin it).
`prepare` writes Miles' prompt file: one line per instance, {"prompt": [{"role": "user", "content":
"Work in /<repo> and fix this issue:\n\n<problem_statement>"}], "metadata": {"task_id", "image"}}.
`to-harbor` writes one Harbor task directory per instance (named by its id) for `sprout.eval` and the
RL driver's --tasks-dir: the agent in the instance's image, a separate verifier grading the agent's diff
in a fresh container of that image with the official steps and verdict (it needs python3 in the image),
and the reference patch as the oracle's solution.
`grade` grades patches as the official harness (scripts/eval.py) does: `--diff PATCH` for one
`--instance-id`, `--patches FILE` in the official format (a JSON list of {"instance_id", "patch"}), or
`--golden-eval` (each instance's own reference `patch`); `--instance-id` picks instances from the last
two. Each is applied with the instance's test_patch in a fresh sandbox of its image, its test commands
run, and the log parsed with the instance's parser from the parsers file (the official log_parsers.py,
pinned by sha256). One line per instance (`--verbose`: every test's status), `-o` the grades as JSON,
`--log-dir` each whole log. Exit 0 when every grade ran, whatever the verdicts (`--fail-unresolved`:
1 unless every instance is resolved); 1 when a grade could not run.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..console import console, errors
from ..errors import UsageError
from ..tasks.swe_rebench.instances import (
    Instance,
    InstanceSet,
    SweRebenchError,
    load_instances,
    read_patches,
    task_prompt,
)
from . import flags

if TYPE_CHECKING:
    from ..tasks.swe_rebench.grade import SweGrade


def cmd_check(args) -> int:
    loaded = load_instances(args.data, args.sha256)
    for problem in loaded.problems:
        errors.print(f"row {problem.row}" + (f" ({problem.instance_id})" if problem.instance_id else "")
                     + f": {problem.problem}", markup=False)
    console.print(f"{len(loaded.instances)} instances, {len(loaded.problems)} bad rows; sha256 {loaded.sha256}",
                  markup=False)
    return 1 if loaded.problems else 0


def cmd_prepare(args) -> int:
    loaded = load_instances(args.data, args.sha256)
    lines = [json.dumps({"prompt": [{"role": "user", "content": task_prompt(i)}],
                         "metadata": {"task_id": i.instance_id, "image": i.image_name}}) for i in loaded.instances]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(line + "\n" for line in lines))
    _report_skipped(loaded)
    console.print(f"wrote {len(lines)} prompts to {args.output} (dataset sha256 {loaded.sha256})", markup=False)
    return 0 if lines else 1


def _report_skipped(loaded: InstanceSet) -> None:
    for problem in loaded.problems:
        errors.print(f"skipped row {problem.row}" + (f" ({problem.instance_id})" if problem.instance_id else "")
                     + f": {problem.problem}", markup=False)


def cmd_to_harbor(args) -> int:
    from ..tasks.swe_rebench.harbor import write_task
    from ..tasks.swe_rebench.verdict import load_parsers

    loaded = load_instances(args.data, args.sha256)
    parsers = load_parsers(args.parsers, args.parsers_sha256)
    instances = [loaded.get(i) for i in flags.flatten(args.instance_id) or []] or loaded.instances
    for instance in instances:
        parsers.get(instance.install_config.log_parser)  # a parser the file lacks stops here, not in a grade
    for instance in instances:
        write_task(instance, parsers, args.output, dataset_sha256=loaded.sha256, rule=args.rule,
                   timeout_s=args.timeout, verifier_network=args.verifier_network == "allow")
    _report_skipped(loaded)
    console.print(f"wrote {len(instances)} Harbor tasks to {args.output} (dataset sha256 {loaded.sha256}, "
                  f"parsers {parsers.grader_revision})", markup=False)
    return 0 if instances else 1


def cmd_grade(args) -> int:
    from ..sandbox import Store
    from ..tasks.swe_rebench.grade import grade_instance
    from ..tasks.swe_rebench.verdict import load_parsers

    loaded = load_instances(args.data, args.sha256)
    parsers = load_parsers(args.parsers, args.parsers_sha256)
    work = _patches(args, loaded)
    if args.image and len(work) != 1:
        raise UsageError("--image stands in for one instance's image: grade one instance with it")
    for instance, _ in work:
        parsers.get(instance.install_config.log_parser)  # a parser the file lacks stops here, not mid-run
    store, grades = Store(args.store), []
    for instance, patch in work:
        if args.image:
            instance = instance.model_copy(update={"image_name": args.image})
        log_path = args.log_dir / f"{instance.instance_id}_log.txt" if args.log_dir else None
        grade = grade_instance(store, instance, patch, parsers, timeout_s=args.timeout, rule=args.rule,
                               pull=args.pull, log_path=log_path)
        grades.append(grade)
        console.print(_grade_line(grade), markup=False)
        if args.verbose:
            for name, status in sorted(grade.statuses.items()):
                console.print(f"    {status:<7} {name}", markup=False)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps([g.model_dump(mode="json") for g in grades], indent=2) + "\n")
    resolved, failed = sum(bool(g.resolved) for g in grades), sum(g.resolved is None for g in grades)
    console.print(f"{len(grades)} graded (rule {args.rule}): {resolved} resolved, "
                  f"{len(grades) - resolved - failed} not resolved, {failed} without a verdict", markup=False)
    return 1 if failed or (args.fail_unresolved and resolved < len(grades)) else 0


def _grade_line(grade: "SweGrade") -> str:
    if grade.resolved is None:
        return f"{grade.instance_id}: no verdict: {grade.error}"
    f2p = f"{len(grade.fail_to_pass_missing)} FAIL_TO_PASS missing, {len(grade.pass_to_pass_failed)} " \
          f"PASS_TO_PASS failed"
    verdict = "resolved" if grade.resolved else f"not resolved ({grade.zero_reason}: {grade.error or f2p})"
    differs = f" [differs from the official harness: {', '.join(grade.differences)}]" if grade.differences else ""
    return f"{grade.instance_id}: {verdict} in {grade.duration_s:.1f}s{differs}"


def _patches(args, loaded: InstanceSet) -> list[tuple[Instance, str]]:
    """(instance, patch) for each instance to grade, from --diff, --patches or --golden-eval."""
    wanted = flags.flatten(args.instance_id)
    if args.diff is not None:
        if not wanted or len(wanted) != 1:
            raise UsageError("--diff grades one instance: name it with --instance-id")
        raw = sys.stdin.buffer.read() if str(args.diff) == "-" else args.diff.read_bytes()
        return [(loaded.get(wanted[0]), raw.decode("utf-8", "surrogateescape"))]  # applied byte for byte
    if args.golden_eval:
        chosen = [loaded.get(i) for i in wanted] if wanted else loaded.instances
        if missing := [i.instance_id for i in chosen if not i.patch.strip()]:
            raise SweRebenchError(f"--golden-eval: no reference patch in the dataset for {', '.join(missing)}")
        return [(i, i.patch) for i in chosen]
    patches = read_patches(args.patches)
    for instance_id in wanted or []:
        if instance_id not in patches:
            raise SweRebenchError(f"{args.patches} has no patch for {instance_id}")
    return [(loaded.get(i), patches[i]) for i in (wanted or patches)]


def add(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("swe-rebench", help="SWE-rebench V2: check a dataset, write prompts or Harbor tasks, grade",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = group.add_subparsers(dest="swe_command", required=True, metavar="COMMAND")
    made = {}
    for name, func, text in (
            ("check", cmd_check, "load a dataset file, list its bad rows, print its sha256"),
            ("prepare", cmd_prepare, "write Miles' prompt file (miles.jsonl) for a dataset file"),
            ("to-harbor", cmd_to_harbor, "write Harbor task directories for sprout.eval"),
            ("grade", cmd_grade, "grade patches (one diff, a patches file or the reference patches) as the "
                                 "official harness")):
        made[name] = s = commands.add_parser(name, help=text, description=text)
        s.add_argument("data", type=Path, help="the dataset file (JSONL, JSON list or parquet)")
        s.add_argument("--sha256", help="the file's expected sha256 (refused when it differs)")
        s.set_defaults(func=func)
    flags.output(made["prepare"], "the prompt file to write (miles.jsonl)")
    flags.output(made["to-harbor"], "the directory to write the tasks into (one per instance)")
    made["to-harbor"].add_argument("--instance-id", type=flags.names_list, nargs="+", action="extend", metavar="ID",
                                   help="only these instances (default: every instance)")
    made["to-harbor"].add_argument("--verifier-network", choices=["allow", "deny"], default="allow",
                                   help="the verifier's network (default allow, as the official harness)")
    grade = made["grade"]
    patch = grade.add_mutually_exclusive_group(required=True)
    patch.add_argument("--diff", type=Path, metavar="PATCH", help="one instance's patch, a git diff against its "
                       "base_commit ('-': stdin); name the instance with --instance-id")
    patch.add_argument("--patches", type=Path, metavar="FILE", help="patches in the official format: a JSON list "
                       'of {"instance_id": ..., "patch": ...} (every instance listed, or those of --instance-id)')
    patch.add_argument("--golden-eval", action="store_true", help="grade each instance's own reference patch "
                       "(every instance, or those of --instance-id)")
    grade.add_argument("--instance-id", type=flags.names_list, nargs="+", action="extend", metavar="ID",
                       help="the instances to grade")
    grade.add_argument("--image", help="a stand-in for the instance's image_name (e.g. a local build)")
    grade.add_argument("--log-dir", type=Path, metavar="DIR", help="keep each whole test log, as "
                       "DIR/<instance_id>_log.txt (the grade itself keeps the last 64,000 characters)")
    flags.output(grade, "write the grades as JSON (a list, one per instance, with every test's status)",
                 required=False)
    grade.add_argument("--verbose", action="store_true", help="print every test's status under its instance")
    grade.add_argument("--fail-unresolved", action="store_true",
                       help="exit 1 unless every instance is resolved (default: 0 once every grade ran)")
    flags.add(grade, "pull", help="pull policy for each instance's image_name: missing (pull what podman lacks; "
              "the default, or $SPROUT_PULL_POLICY), always, never")
    flags.add(grade, "store")
    for s in (made["to-harbor"], made["grade"]):
        s.add_argument("--parsers", type=Path, required=True, help="the official log_parsers.py (downloaded by you)")
        s.add_argument("--parsers-sha256", help="its expected sha256 (the grader revision)")
        s.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
                       help="the test commands, at most (default 1800)")
        s.add_argument("--rule", choices=["exact", "lenient"], default="exact",
                       help="what decides resolved: exact (official: PASSED == FAIL_TO_PASS + PASS_TO_PASS) or "
                            "lenient (every expected test PASSED); both are reported")
