"""`sprout swe-rebench`: check a SWE-rebench V2 dataset file, write Miles' prompts or Harbor task
directories for it, grade a diff as the official harness does.

`check` loads every row (bad rows are listed by line and id) and prints the file's sha256 (pin it).
`prepare` writes Miles' prompt file: one line per instance, {"prompt": [{"role": "user", "content":
"Work in /<repo> and fix this issue:\n\n<problem_statement>"}], "metadata": {"task_id", "image"}}.
`to-harbor` writes one Harbor task directory per instance (named by its id) for `sprout.eval` and the
RL driver's --tasks-dir: the agent in the instance's image, a separate verifier grading the agent's diff
in a fresh container of that image with the official steps and verdict (it needs python3 in the image),
and the reference patch as the oracle's solution.
`grade` applies PATCH (the agent's change against the instance's base_commit; `-` reads stdin) and the
instance's test_patch in a fresh sandbox of its image, runs its test commands, parses the log with the
instance's parser from the parsers file (the official log_parsers.py, pinned by sha256) and prints the
grade as JSON; exit 0 resolved, 1 not resolved, 2 no verdict.
"""

import argparse
import json
import sys
from pathlib import Path

from ..console import console, errors
from ..sandbox import Store
from ..tasks.swe_rebench.grade import grade_instance
from ..tasks.swe_rebench.harbor import write_task
from ..tasks.swe_rebench.instances import InstanceSet, load_instances, task_prompt
from ..tasks.swe_rebench.verdict import load_parsers
from . import flags


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
    instance = load_instances(args.data, args.sha256).get(args.instance_id)
    if args.image:
        instance = instance.model_copy(update={"image_name": args.image})
    parsers = load_parsers(args.parsers, args.parsers_sha256)
    raw = sys.stdin.buffer.read() if str(args.diff) == "-" else args.diff.read_bytes()
    diff = raw.decode("utf-8", "surrogateescape")  # a diff may hold any bytes; they are applied as they are
    grade = grade_instance(Store(args.store), instance, diff, parsers, timeout_s=args.timeout, rule=args.rule,
                           pull=args.pull)
    print(grade.model_dump_json(indent=2))
    return 2 if grade.resolved is None else (0 if grade.resolved else 1)


def add(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("swe-rebench", help="SWE-rebench V2: check a dataset, write prompts or Harbor tasks, grade",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = group.add_subparsers(dest="swe_command", required=True, metavar="COMMAND")
    made = {}
    for name, func, text in (
            ("check", cmd_check, "load a dataset file, list its bad rows, print its sha256"),
            ("prepare", cmd_prepare, "write Miles' prompt file (miles.jsonl) for a dataset file"),
            ("to-harbor", cmd_to_harbor, "write Harbor task directories for sprout.eval"),
            ("grade", cmd_grade, "grade a diff against one instance, as the official harness")):
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
    made["grade"].add_argument("--instance-id", required=True)
    made["grade"].add_argument("--diff", type=Path, required=True,
                               help="the agent's change as a git diff ('-': stdin)")
    made["grade"].add_argument("--image", help="a stand-in for the instance's image_name (e.g. a local build)")
    flags.add(made["grade"], "pull", "store")
    for s in (made["to-harbor"], made["grade"]):
        s.add_argument("--parsers", type=Path, required=True, help="the official log_parsers.py (downloaded by you)")
        s.add_argument("--parsers-sha256", help="its expected sha256 (the grader revision)")
        s.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
                       help="the test commands, at most (default 1800)")
        s.add_argument("--rule", choices=["exact", "lenient"], default="exact",
                       help="what decides resolved: exact (official: PASSED == FAIL_TO_PASS + PASS_TO_PASS) or "
                            "lenient (every expected test PASSED); both are reported")
