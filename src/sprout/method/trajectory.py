"""A reviewed rollout's whole trajectory: its ancestors' turns up to each branch point, then its own turns,
with the note the agent was given before a turn and the turns a reviewer wrote. An evaluation finds the
ancestors through its attempt records; the RL search through each journal's parent."""

from collections.abc import Callable, Mapping
from pathlib import Path

from ..agent.journal import Journal, Turn, read_journal
from ..agent.runner import INSERTED
from .records import AttemptRecord
from .review import Step


def lineage(attempt: AttemptRecord, by_id: Mapping[str, AttemptRecord]) -> list[AttemptRecord]:
    """The attempts from the first one down to `attempt`, each a branch of the one before."""
    chain = [attempt]
    while chain[-1].parent is not None:
        chain.append(by_id[chain[-1].parent])
    return chain[::-1]


def trajectory(attempt: AttemptRecord, by_id: Mapping[str, AttemptRecord],
               journal_of: Callable[[AttemptRecord], Journal]) -> list[Step]:
    """An evaluation attempt's trajectory (a branch of turn 0 starts over: its parent's turns are not in it)."""
    chain = lineage(attempt, by_id)
    steps: list[Step] = []
    for i, member in enumerate(chain):
        child = chain[i + 1] if i + 1 < len(chain) else None
        last = child.from_turn if child is not None else None
        steps = [s for s in steps if s.turn.turn < member.first_turn]
        steps += _steps(journal_of(member).turns, last, member.note if member.parent is not None else None)
    return steps


def history(journal: Path) -> list[Step]:
    """A rollout's trajectory from its journal: its parents' turns up to each branch point, then its own."""
    record = read_journal(journal)
    parent = record.header.parent
    earlier = [] if parent is None else [s for s in history(Path(parent.journal)) if s.turn.turn <= parent.turn]
    return earlier + _steps(record.turns, None, parent.note if parent else None)


def _steps(turns: list[Turn], last: int | None, note: str | None) -> list[Step]:
    """Steps of `turns` up to `last`; `note` was told before the first."""
    steps = []
    for turn in turns:
        if last is not None and turn.turn > last:
            break
        inserted = any((m.get("extra") or {}).get(INSERTED) for m in turn.new_messages)
        steps.append(Step(turn=turn, note_before=note, inserted=inserted))
        note = None
    return steps
