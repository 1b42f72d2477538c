"""`sprout report`: journals as tables and Markdown, evaluations (and benchmarks) as trees."""

import argparse
import sys
from pathlib import Path

from ..console import console, errors
from ..errors import SproutError


def cmd_snapshots(args: argparse.Namespace) -> int:
    from ..agent.journal import read_journal
    from ..report.journal import journal_lines, snapshots_table

    journal = read_journal(args.journal)
    console.print(snapshots_table(journal, str(args.journal)))
    for line in journal_lines(journal):
        console.print(line, markup=False)
    for problem in journal.problems:
        errors.print(f"warning: {problem}", markup=False)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..agent.journal import read_journal
    from ..report.journal import to_markdown

    markdown = to_markdown(read_journal(args.journal))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(markdown)
        console.print(f"wrote {args.output}", markup=False)
    else:
        sys.stdout.write(markdown)
    return 0


def cmd_task(args: argparse.Namespace) -> int:
    from ..eval.results import (
        find_summaries,
        method_rows,
        pass_markdown,
        pass_table,
        task_markdown,
        task_table,
    )
    from ..report.tree import render_tree, tree_markdown

    summaries = find_summaries(args.dir)
    if not summaries:
        raise SproutError(f"no evaluation in {args.dir} (no summary.json in it or its subdirectories)")
    several = len(summaries) > 1
    if args.format == "md":
        parts = [tree_markdown(s) for s in summaries]
        if several:
            parts += ["## Results", "", task_markdown(summaries), "", pass_markdown(method_rows(summaries))]
        sys.stdout.write("\n".join(parts))
        return 0
    for s in summaries:
        console.print(render_tree(s))
    if several:
        console.print(task_table(summaries))
        console.print(pass_table(method_rows(summaries)))
    return 0


def add(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("report", help="journals as tables and Markdown, evaluations as trees",
                           description="Reads journals and evaluation outputs; changes nothing.")
    commands = group.add_subparsers(dest="report_command", required=True, metavar="COMMAND")
    s = commands.add_parser("snapshots", help="a journal's turns and their checkpoints, as a table")
    s.add_argument("journal", type=Path)
    s.set_defaults(func=cmd_snapshots)
    s = commands.add_parser("export", help="a journal as readable Markdown")
    s.add_argument("journal", type=Path)
    s.add_argument("-o", "--output", type=Path, metavar="PATH", help="the file to write (default: stdout)")
    s.set_defaults(func=cmd_export)
    s = commands.add_parser("task", help="the tree of an evaluation's attempts (or of a directory of evaluations)",
                            description="Each branch hangs under the turn of the attempt it branched from, with the "
                            "review's reason and the mistake it named; every attempt shows its turns and reward. DIR "
                            "is one evaluation's output (it holds summary.json) or a directory of them (e.g. a "
                            "benchmark's output, which adds the per-task and pass@budget tables).")
    s.add_argument("dir", type=Path, help="an evaluation's output (with summary.json) or a directory of them")
    s.add_argument("--format", choices=["rich", "md"], default="rich", help="a rich tree (default) or Markdown")
    s.set_defaults(func=cmd_task)
