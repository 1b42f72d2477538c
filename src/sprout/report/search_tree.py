"""An RL group's search tree, read from its directory (`<data_dir>/groups/<id>-<ms>/`): a slot per sample
(`slot-<k>/journal.jsonl`, its `grade.json`, a search slot's `search.json`: its group label and leak
terms), the reviews (`reviews/*.json`) and, once the group ended, `status.json`. A slot whose journal has no
parent is a root; a branch hangs under the slot and turn it came from, and is a repair when it holds a turn a
reviewer wrote (its inserted turn), else a student. The outcome label is computed from the roots' grades
with the function Miles recounts with."""

import json
from pathlib import Path
from typing import Any, Literal

from ..agent.journal import read_journal
from ..agent.runner import INSERTED
from ..errors import SproutError
from ..rl_driver.groups import GROUP_STATUS, SLOT_SEARCH
from ..rl_driver.outcome import search_outcome
from .run_files import View, inside

JOURNAL = "journal.jsonl"


class SlotView(View):
    slot: str  # its directory, slot-<k>
    kind: Literal["root", "student", "repair"]
    parent: str | None  # the slot it branched from
    from_turn: int | None
    note: str | None
    first_turn: int
    turns: int
    inserted_turns: list[int]
    reward: float | None
    verdict: str | None  # of its grade.json (None: not graded)
    label: str | None  # the search's group label: root, student:<point>, repair:<point>:<candidate>
    leak_terms: list[str] | None  # a repair's words that name what the agent had not seen (None: not checked)


class GroupView(View):
    id: int
    name: str
    outcome: str  # TT, TT_partial, TF, FF, FF_partial or ungraded, from the roots present
    status: str | None  # completed, early_stopped, failed, deleted; None while it runs
    reason: str | None
    slots: list[SlotView]
    reviews: list[dict[str, Any]]  # each review's record: the reviewed journal, its points and notes
    problems: list[str]


def is_group(directory: Path) -> bool:
    return any(directory.glob(f"slot-*/{JOURNAL}"))


def read_group(number: int, directory: Path) -> GroupView:
    slots, problems = [], []
    for journal_path in sorted(directory.glob(f"slot-*/{JOURNAL}"), key=lambda p: _slot_number(p.parent.name)):
        try:
            slots.append(_slot(directory, journal_path))
        except SproutError as e:
            problems.append(str(e))
    reviews = []
    for path in sorted((directory / "reviews").glob("*.json")):
        try:
            reviews.append(json.loads(path.read_text()) | {"file": path.stem})
        except (OSError, ValueError) as e:
            problems.append(f"{path.name}: {e}")
    roots = [s for s in slots if s.kind == "root"]
    graded = [s for s in roots if s.reward is not None]
    outcome = search_outcome(len(roots), len(graded), sum(s.reward == 1 for s in graded)) if roots else "ungraded"
    ended = _json(directory, GROUP_STATUS)
    return GroupView(id=number, name=directory.name, outcome=outcome, status=ended.get("status"),
                     reason=ended.get("reason"), slots=slots, reviews=reviews, problems=problems)


def slot_journal(directory: Path, slot: str) -> Path:
    """A slot's journal, inside the group directory (a planted path or link is refused)."""
    if not slot.startswith("slot-"):
        raise SproutError(f"no slot {slot}")
    return inside(directory, f"{slot}/{JOURNAL}")


def _slot_number(name: str) -> int:
    try:
        return int(name.removeprefix("slot-"))
    except ValueError:
        return 1 << 30


def _slot(directory: Path, journal_path: Path) -> SlotView:
    name = journal_path.parent.name
    journal = read_journal(slot_journal(directory, name))
    inserted = [t.turn for t in journal.turns if any((m.get("extra") or {}).get(INSERTED) for m in t.new_messages)]
    parent = journal.header.parent
    kind: Literal["root", "student", "repair"] = "root" if parent is None else "repair" if inserted else "student"
    grade, search = _json(directory, f"{name}/grade.json"), _json(directory, f"{name}/{SLOT_SEARCH}")
    reward = grade.get("reward")
    verdict = grade.get("verdict") or (None if reward is None else "pass" if reward >= 1 else "fail")
    return SlotView(slot=name, kind=kind, parent=Path(parent.journal).parent.name if parent else None,
                    from_turn=parent.turn if parent else None, note=parent.note if parent else None,
                    first_turn=journal.header.first_turn, turns=len(journal.turns), inserted_turns=inserted,
                    reward=reward, verdict=verdict, label=search.get("label"),
                    leak_terms=(search.get("search") or {}).get("leak_terms"))


def _json(directory: Path, relative: str) -> dict[str, Any]:
    """A JSON object the driver wrote in the group's directory; {} when it is not there (yet) or not one."""
    try:
        data = json.loads(inside(directory, relative).read_text())
    except (OSError, ValueError, SproutError):
        return {}
    return data if isinstance(data, dict) else {}
