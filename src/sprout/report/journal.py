"""A journal as a table of its turns and their checkpoints, or as readable Markdown."""

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from ..agent.journal import Journal
from ..console import human_bytes
from ..errors import SproutError
from ..sandbox import Store


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


def snapshots_table(journal: Journal, title: str) -> Table:
    """Each turn: its checkpoint, command, exit code, checkpoint time, exclusive size and whether it still
    exists (looked up in the store the journal names, when it can be opened here)."""
    try:
        store: Store | None = Store(Path(journal.header.store))
    except SproutError:
        store = None
    table = Table("turn", "checkpoint", "command", "exit", "ckpt ms", "exclusive", "exists",
                  title=escape(f"{title}: {_short(journal.header.task, 70)}"))  # rich markup: a path may hold "[...]"
    for turn in journal.turns:
        state, size = _checkpoint_state(store, turn.checkpoint)
        command = escape(_short(turn.commands[0] if turn.commands else "-", 50))  # the agent's text, not markup
        table.add_row(str(turn.turn), turn.checkpoint or "-", command,
                      "-" if turn.exit_code is None else str(turn.exit_code),
                      "-" if turn.checkpoint_ms is None else f"{turn.checkpoint_ms:.1f}", human_bytes(size), state)
    return table


def journal_lines(journal: Journal) -> list[str]:
    """What follows a journal's table: its outcome and where it branched from."""
    lines = []
    outcome, header = journal.outcome, journal.header
    if outcome:
        lines.append(f"outcome: {outcome.status} ({outcome.exit_status}), {outcome.turns} turns, "
                     f"{outcome.tokens_in + outcome.tokens_out:,} tokens, {outcome.wall_s:.1f}s, "
                     f"final checkpoint {outcome.final_checkpoint}")
    if header.parent:
        lines.append(f"branched from {header.parent.journal} turn {header.parent.turn} ({header.parent.checkpoint})")
    return lines


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
        if turn.changes is not None:
            lines += [f"changes on disk since `{turn.changes.since}`: {turn.changes.line()}", ""]
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
