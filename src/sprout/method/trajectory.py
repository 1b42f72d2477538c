"""An attempt's whole trajectory: its ancestors' turns up to each branch point, then its own turns."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..agent.journal import Journal, Turn
from .records import AttemptRecord


@dataclass
class Step:
    attempt: str  # the attempt whose journal holds this turn
    turn: Turn
    note_before: str | None = None  # a note the agent was given just before this turn


def lineage(attempt: AttemptRecord, by_id: Mapping[str, AttemptRecord]) -> list[AttemptRecord]:
    """The attempts from the first one down to `attempt`, each a branch of the one before."""
    chain = [attempt]
    while chain[-1].parent is not None:
        chain.append(by_id[chain[-1].parent])
    return chain[::-1]


def trajectory(attempt: AttemptRecord, by_id: Mapping[str, AttemptRecord],
               journal_of: Callable[[AttemptRecord], Journal]) -> list[Step]:
    chain = lineage(attempt, by_id)
    steps: list[Step] = []
    for i, member in enumerate(chain):
        child = chain[i + 1] if i + 1 < len(chain) else None
        last = child.from_turn if child is not None else None
        steps = [s for s in steps if s.turn.turn < member.first_turn]  # a branch of turn 0 starts over
        note = member.note if member.parent is not None else None
        for turn in journal_of(member).turns:
            if last is not None and turn.turn > last:
                break
            steps.append(Step(member.id, turn, note))
            note = None
    return steps
