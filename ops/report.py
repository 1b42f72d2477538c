"""python -m ops.report: read journals (and evaluation outputs) as tables, Markdown and trees.

    python -m ops.report snapshots runs/first.jsonl        # a table of turns and their checkpoints
    python -m ops.report export runs/first.jsonl -o x.md   # the trajectory as Markdown (stdout without -o)
    python -m ops.report task runs/<task>-sprout           # the tree of an evaluation's attempts
"""

import argparse
import sys
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from ops.report_task import add_task_parser
from sprout.agent.journal import Journal, read_journal
from sprout.console import console, errors, human_bytes, run_parser
from sprout.sandbox import Store
from sprout.sandbox.errors import SproutError


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _checkpoint_state(store: Store | None, checkpoint_id: str | None) -> tuple[str, int | None]:
    if checkpoint_id is None:
        return "-", None
    if store is None:
        return "store missing", None
    try:
        checkpoint = store.checkpoint(checkpoint_id)
    except SproutError:
        return "deleted", None
    if not checkpoint.exists:
        return "MISSING", None
    return "yes", store.size_of(checkpoint)


def cmd_snapshots(args) -> int:
    journal = read_journal(args.journal)
    try:
        store = Store(Path(journal.header.store))
    except SproutError:
        store = None
    header = journal.header
    title = escape(f"{args.journal}: {_short(header.task, 70)}")  # rich markup: a path may hold "[...]"
    table = Table("turn", "checkpoint", "command", "exit", "ckpt ms", "exclusive", "exists", title=title)
    for turn in journal.turns:
        state, size = _checkpoint_state(store, turn.checkpoint)
        command = escape(_short(turn.commands[0] if turn.commands else "-", 50))  # the agent's text, not markup
        table.add_row(str(turn.turn), turn.checkpoint or "-", command,
                      "-" if turn.exit_code is None else str(turn.exit_code),
                      "-" if turn.checkpoint_ms is None else f"{turn.checkpoint_ms:.1f}", human_bytes(size), state)
    console.print(table)
    outcome = journal.outcome
    if outcome:
        console.print(f"outcome: {outcome.status} ({outcome.exit_status}), {outcome.turns} turns, "
                      f"{outcome.tokens_in + outcome.tokens_out:,} tokens, {outcome.wall_s:.1f}s, "
                      f"final checkpoint {outcome.final_checkpoint}")
    if header.parent:
        console.print(f"branched from {header.parent.journal} turn {header.parent.turn} ({header.parent.checkpoint})",
                      markup=False)
    for problem in journal.problems:
        errors.print(f"warning: {problem}", markup=False)
    return 0


def to_markdown(journal: Journal) -> str:
    h = journal.header
    lines = [f"# Sprout rollout: {_short(h.task, 80)}", "",
             "| | |", "|---|---|",
             f"| task | {h.task.replace('|', '/')} |", f"| model | `{h.model}` ({h.model_class}) @ {h.endpoint_host} |",
             f"| image | `{h.image}` ({h.image_key}) |", f"| cwd | `{h.cwd}` |",
             f"| started | {h.started.isoformat(timespec='seconds')} |",
             f"| sprout | {h.sprout_version} (commit `{h.git_commit or 'unknown'}`) |",
             f"| limits | {h.limits.step_limit} steps, {h.limits.token_limit:,} tokens, {h.limits.wall_time_s}s |"]
    if h.parent:
        lines.append(f"| branched from | `{h.parent.journal}` turn {h.parent.turn} (`{h.parent.checkpoint}`) |")
        if h.parent.note:
            lines.append(f"| note | {h.parent.note} |")
    for turn in journal.turns:
        lines += ["", f"## Turn {turn.turn}", "",
                  (f"checkpoint `{turn.checkpoint}` · exit {turn.exit_code} · {turn.tokens_in}+{turn.tokens_out} "
                   f"tokens · model {turn.model_latency_s:.2f}s · command {turn.command_s:.2f}s"), ""]
        if turn.thought.strip():
            lines += [turn.thought.strip(), ""]
        for command in turn.commands:
            lines += ["```bash", command, "```", ""]
        fence = "````" if "```" in turn.observation else "```"
        lines += ["<details><summary>observation</summary>", "", fence, turn.observation.rstrip(), fence, "",
                  "</details>"]
    o = journal.outcome
    lines += ["", "## Outcome", ""]
    if o:
        lines += [(f"**{o.status}** ({o.exit_status}) after {o.turns} turns, {o.tokens_in + o.tokens_out:,} "
                   f"tokens, {o.wall_s:.1f}s; final checkpoint `{o.final_checkpoint}`.")]
        if o.message:
            lines += ["", f"> {o.message}"]
        if o.submission.strip():
            lines += ["", "Submission:", "", "```", o.submission.rstrip(), "```"]
    else:
        lines.append("No outcome recorded (the run crashed or is still going).")
    for problem in journal.problems:
        lines += ["", f"> warning: {problem}"]
    return "\n".join(lines) + "\n"


def cmd_export(args) -> int:
    markdown = to_markdown(read_journal(args.journal))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(markdown)
        console.print(f"wrote {args.output}", markup=False)
    else:
        sys.stdout.write(markdown)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ops.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("snapshots", help="table of a journal's turns and their checkpoints")
    s.add_argument("journal", type=Path)
    s.set_defaults(func=cmd_snapshots)
    s = sub.add_parser("export", help="a journal as readable Markdown")
    s.add_argument("journal", type=Path)
    s.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    s.set_defaults(func=cmd_export)
    add_task_parser(sub)
    return p


if __name__ == "__main__":
    run_parser(parser)
