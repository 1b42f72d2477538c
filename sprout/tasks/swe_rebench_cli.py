"""python -m sprout.tasks.swe_rebench_cli: check a SWE-rebench V2 dataset file, grade a diff as the
official harness does.

    python -m sprout.tasks.swe_rebench_cli check DATA.jsonl [--sha256 HEX]
    python -m sprout.tasks.swe_rebench_cli prepare DATA.jsonl -o miles.jsonl [--sha256 HEX]
    python -m sprout.tasks.swe_rebench_cli grade DATA.jsonl --instance-id ID --diff PATCH \\
        --parsers log_parsers.py [--parsers-sha256 HEX] [--timeout 1800] [--rule exact|lenient]

`check` loads every row (bad rows are listed by line and id) and prints the file's sha256 (pin it).
`prepare` writes Miles' prompt file: one line per instance, {"prompt": [{"role": "user", "content":
"Work in /<repo> and fix this issue:\n\n<problem_statement>"}], "metadata": {"task_id", "image"}}.
`grade` applies PATCH (the agent's change against the instance's base_commit; `-` reads stdin) and the
instance's test_patch in a fresh sandbox of its image, runs its test commands, parses the log with the
instance's parser from the parsers file (the official log_parsers.py, pinned by sha256) and prints the
grade as JSON; exit 0 resolved, 1 not resolved, 2 no verdict.
"""

import argparse
import json
import sys
from pathlib import Path

from ..console import console, errors, run_parser
from ..sandbox import Store
from .pull import PULL_HELP, PULL_POLICIES
from .swe_rebench import load_instances, task_prompt
from .swe_rebench_grade import grade_instance, load_parsers


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
    for problem in loaded.problems:
        errors.print(f"skipped row {problem.row}" + (f" ({problem.instance_id})" if problem.instance_id else "")
                     + f": {problem.problem}", markup=False)
    console.print(f"wrote {len(lines)} prompts to {args.output} (dataset sha256 {loaded.sha256})", markup=False)
    return 0 if lines else 1


def cmd_grade(args) -> int:
    instance = load_instances(args.data, args.sha256).get(args.instance_id)
    parsers = load_parsers(args.parsers, args.parsers_sha256)
    diff = sys.stdin.read() if str(args.diff) == "-" else args.diff.read_text()
    grade = grade_instance(Store(args.store), instance, diff, parsers, timeout_s=args.timeout, rule=args.rule,
                           pull=args.pull)
    print(grade.model_dump_json(indent=2))
    return 2 if grade.resolved is None else (0 if grade.resolved else 1)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sprout.tasks.swe_rebench_cli", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, func, text in (("check", cmd_check, "load a dataset file, list its bad rows, print its sha256"),
                             ("prepare", cmd_prepare, "write Miles' prompt file (miles.jsonl) for a dataset file"),
                             ("grade", cmd_grade, "grade a diff against one instance, as the official harness")):
        s = sub.add_parser(name, help=text)
        s.add_argument("data", type=Path, help="the dataset file (JSONL, JSON list or parquet)")
        s.add_argument("--sha256", help="the file's expected sha256 (refused when it differs)")
        s.set_defaults(func=func)
        if name == "prepare":
            s.add_argument("-o", "--output", type=Path, required=True, help="the prompt file to write")
    s.add_argument("--instance-id", required=True)
    s.add_argument("--diff", type=Path, required=True, help="the agent's change as a git diff ('-': stdin)")
    s.add_argument("--parsers", type=Path, required=True, help="the official log_parsers.py (downloaded by you)")
    s.add_argument("--parsers-sha256", help="its expected sha256 (the grader revision)")
    s.add_argument("--timeout", type=float, default=1800.0, help="seconds for the test commands (default 1800)")
    s.add_argument("--rule", choices=["exact", "lenient"], default="exact",
                   help="what decides resolved: exact (official: PASSED == FAIL_TO_PASS + PASS_TO_PASS) or "
                        "lenient (every expected test PASSED); both are reported")
    s.add_argument("--pull", choices=PULL_POLICIES, default=None, help=PULL_HELP)
    s.add_argument("--store", type=Path, help="btrfs store (default: $SPROUT_STORE or ~/sprout-btrfs)")
    return p


if __name__ == "__main__":
    run_parser(parser)
