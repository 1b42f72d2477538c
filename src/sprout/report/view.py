"""What `sprout view` shows, as JSON: the runs it was given (evaluations, benchmarks of them, and RL groups,
sprout.report.search_tree), each evaluation's attempt tree, each attempt's or slot's trajectory turn by turn,
and what a turn changed on disk.

Everything is read anew on each request, so a run still being written is followed as it grows. Files are
only read inside the directories given: a journal or verifier path a summary names is resolved (links
too) and refused when it lands outside its run directory. Every API path is also a key of the static page
(`pages`), which embeds the same JSON.
"""

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..agent.journal import Journal, read_journal
from ..agent.runner import INSERTED
from ..errors import SproutError
from ..eval.benchmark import METHODS
from ..eval.results import method_rows
from ..eval.summary import SUMMARY, EvaluationSummary, read_summary
from ..method.budget import equal_budget
from ..method.records import AttemptRecord
from ..sandbox import Store
from ..sandbox.diff import ChangeSummary, CheckpointDiff
from .run_files import View, inside
from .search_tree import GroupView, is_group, read_group, slot_journal

OBSERVATION_CAP = 20_000  # characters of a turn's output sent to the page


class EvaluationEntry(View):
    id: int
    name: str
    task: str
    method: str
    status: str
    solved_by: str | None
    turns_to_solve: int | None
    budget_turns: int


class BenchmarkEntry(View):
    name: str
    evaluations: list[int]  # ids of EvaluationEntry
    methods: list[str]
    budgets: dict[str, int]  # method -> its full budget in turns
    pass_at: dict[str, dict[int, float]]  # method -> budget in turns -> share of tasks solved


class GroupEntry(View):
    id: int
    name: str
    slots: int


class Index(View):
    evaluations: list[EvaluationEntry]
    benchmarks: list[BenchmarkEntry]
    groups: list[GroupEntry]  # RL groups (sprout.report.search_tree)
    problems: list[str]  # directories that are not runs (one line each)


class EvaluationView(View):
    id: int
    name: str
    summary: dict[str, Any]  # the summary's own JSON: config, status, totals, attempts, reviews


class TurnView(View):
    turn: int
    checkpoint: str | None
    thought: str
    commands: list[str]
    observation: str
    exit_code: int | None
    changes: ChangeSummary | None
    note_before: str | None = None  # what the agent was told just before it (a branch's first turn)
    inserted: bool = False  # written by a reviewer (an RL search repair), executed, no model call


class TrajectoryView(View):
    attempt: str
    journal: str
    turns: list[TurnView]
    outcome: dict[str, Any] | None
    problems: list[str]


class TurnDiff(View):
    diff: CheckpointDiff | None  # None: only the journal's summary is left
    summary: ChangeSummary | None
    reason: str | None = None  # why there is no full diff


class Runs:
    """The run directories given to `sprout view`: evaluations (a summary.json), benchmarks (directories of
    them) and RL groups (a group's directory, or a driver's data directory of them), numbered in the order
    given."""

    def __init__(self, directories: list[Path]):
        self.evaluations: list[Path] = []
        self.benchmarks: list[tuple[Path, list[int]]] = []
        self.groups: list[Path] = []
        self.problems: list[str] = []
        for directory in directories:
            self._add(Path(directory))
        if not self.evaluations and not self.groups:
            raise SproutError("nothing to view: " + ("; ".join(self.problems) or "no directories given"))

    def _add(self, directory: Path) -> None:
        if not directory.is_dir():
            self.problems.append(f"{directory} is not a directory")
        elif (directory / SUMMARY).is_file():
            self.evaluations.append(directory)
        elif children := sorted(p.parent for p in directory.glob(f"*/{SUMMARY}") if p.is_file()):
            first = len(self.evaluations)
            self.evaluations += children
            self.benchmarks.append((directory, list(range(first, len(self.evaluations)))))
        elif is_group(directory):
            self.groups.append(directory)
        elif groups := sorted(d for d in [*directory.glob("*"), *directory.glob("groups/*")] if is_group(d)):
            self.groups += groups  # an RL driver's data directory, or its groups/
        else:
            self.problems.append(f"{directory} is not a Sprout run (no {SUMMARY} in it or its subdirectories, "
                                 "and no RL group's slot-*/journal.jsonl)")

    def summary(self, number: int) -> EvaluationSummary:
        return read_summary(self.evaluation_dir(number))

    def index(self) -> Index:
        entries, problems = [], list(self.problems)
        summaries: dict[int, EvaluationSummary] = {}
        for number, directory in enumerate(self.evaluations):
            try:
                summaries[number] = summary = read_summary(directory)
            except SproutError as e:  # half written by a killed run, or not one
                problems.append(str(e))
                continue
            config = summary.config
            entries.append(EvaluationEntry(
                id=number, name=directory.name, task=config.task, method=config.method, status=summary.status,
                solved_by=summary.solved_by, turns_to_solve=summary.cost_to_solve("turns"),
                budget_turns=equal_budget(config.method, "turns", config.step_limit, config.token_limit,
                                          config.branches).amount))
        benchmarks = []
        for directory, numbers in self.benchmarks:
            rows = sorted(method_rows([summaries[n] for n in numbers if n in summaries]),
                          key=lambda r: METHODS.index(r.method) if r.method in METHODS else len(METHODS))
            benchmarks.append(BenchmarkEntry(name=directory.name, evaluations=[n for n in numbers if n in summaries],
                                             methods=[r.method for r in rows],
                                             budgets={r.method: r.budget_turns for r in rows},
                                             pass_at={r.method: r.pass_at for r in rows}))
        groups = [GroupEntry(id=n, name=d.name, slots=len(list(d.glob("slot-*")))) for n, d in enumerate(self.groups)]
        return Index(evaluations=entries, benchmarks=benchmarks, groups=groups, problems=problems)

    def evaluation_dir(self, number: int) -> Path:
        if not 0 <= number < len(self.evaluations):
            raise SproutError(f"no evaluation {number}")
        return self.evaluations[number]

    def group_dir(self, number: int) -> Path:
        if not 0 <= number < len(self.groups):
            raise SproutError(f"no group {number}")
        return self.groups[number]

    def group(self, number: int) -> GroupView:
        return read_group(number, self.group_dir(number))

    def slot_trajectory(self, number: int, slot: str) -> TrajectoryView:
        path = slot_journal(self.group_dir(number), slot)
        return trajectory_of(slot, f"{slot}/{path.name}", read_journal(path))

    def slot_turn_diff(self, number: int, slot: str, turn_number: int) -> TurnDiff:
        return turn_diff_of(read_journal(slot_journal(self.group_dir(number), slot)), turn_number)

    def evaluation(self, number: int) -> EvaluationView:
        summary = self.summary(number)
        return EvaluationView(id=number, name=self.evaluations[number].name, summary=summary.model_dump(mode="json"))

    def _attempt(self, number: int, attempt_id: str) -> tuple[EvaluationSummary, AttemptRecord, Journal]:
        summary = self.summary(number)
        attempt = next((a for a in summary.attempts if a.id == attempt_id), None)
        if attempt is None:
            raise SproutError(f"evaluation {number} has no attempt {attempt_id}")
        return summary, attempt, read_journal(inside(self.evaluations[number], attempt.journal))

    def trajectory(self, number: int, attempt_id: str) -> TrajectoryView:
        _, attempt, journal = self._attempt(number, attempt_id)
        return trajectory_of(attempt.id, attempt.journal, journal)

    def turn_diff(self, number: int, attempt_id: str, turn_number: int) -> TurnDiff:
        return turn_diff_of(self._attempt(number, attempt_id)[2], turn_number)

    def pages(self) -> Iterator[tuple[str, View]]:
        """Every API path and its JSON, for the static page (diffs where the checkpoints still exist)."""
        index = self.index()
        yield "/api/index", index
        for evaluation in index.evaluations:
            yield f"/api/evaluations/{evaluation.id}", self.evaluation(evaluation.id)
            for attempt in self.summary(evaluation.id).attempts:
                yield from self._journal_pages(f"/api/evaluations/{evaluation.id}/attempts/{attempt.id}",
                                               lambda: self.trajectory(evaluation.id, attempt.id),
                                               lambda turn: self.turn_diff(evaluation.id, attempt.id, turn))
        for group in index.groups:
            view = self.group(group.id)
            yield f"/api/groups/{group.id}", view
            for slot in view.slots:
                yield from self._journal_pages(f"/api/groups/{group.id}/slots/{slot.slot}",
                                               lambda: self.slot_trajectory(group.id, slot.slot),
                                               lambda turn: self.slot_turn_diff(group.id, slot.slot, turn))

    @staticmethod
    def _journal_pages(path: str, trajectory: Callable[[], TrajectoryView],
                       diff: Callable[[int], TurnDiff]) -> Iterator[tuple[str, View]]:
        try:
            view = trajectory()
        except SproutError:
            return  # the page says the journal cannot be read
        yield path, view
        for turn in view.turns:  # a microVM's turn (no summary) is diffed on demand only: it boots guests
            if turn.changes is not None:
                yield f"{path}/turns/{turn.turn}/diff", diff(turn.turn)


def _cap(text: str) -> str:
    if len(text) <= OBSERVATION_CAP:
        return text
    half = OBSERVATION_CAP // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}"


def trajectory_of(name: str, journal_name: str, journal: Journal) -> TrajectoryView:
    """A journal turn by turn, for the page."""
    turns = [TurnView(turn=t.turn, checkpoint=t.checkpoint, thought=t.thought, commands=t.commands,
                      observation=_cap(t.observation), exit_code=t.exit_code, changes=t.changes,
                      inserted=any((m.get("extra") or {}).get(INSERTED) for m in t.new_messages))
             for t in journal.turns]
    if turns and journal.header.parent is not None and journal.header.parent.note:
        turns[0].note_before = journal.header.parent.note
    return TrajectoryView(attempt=name, journal=journal_name, turns=turns,
                         outcome=journal.outcome.model_dump(mode="json") if journal.outcome else None,
                         problems=journal.problems)


def turn_diff_of(journal: Journal, turn_number: int) -> TurnDiff:
    """What a turn changed on disk: the checkpoint diff while its store holds both checkpoints, else the
    journal's summary and why. A microVM's turns record no summary: their diff is made now, from the store's
    record of which checkpoint came before."""
    turn = journal.turn(turn_number)
    if turn.checkpoint is None:
        return TurnDiff(diff=None, summary=None, reason="this turn made no checkpoint")
    store_db = Path(journal.header.store) / "state" / "sprout.db"
    if not store_db.is_file():
        return TurnDiff(diff=None, summary=turn.changes, reason=f"the store {journal.header.store} is not on "
                                                                "this host: the journal's summary only")
    store = Store(Path(journal.header.store))
    try:
        if turn.changes is not None:
            base = turn.changes.since
        else:
            checkpoint = store.checkpoint(turn.checkpoint)
            base = checkpoint.parent or checkpoint.image_key
        return TurnDiff(diff=store.diff(base, turn.checkpoint), summary=turn.changes)
    except SproutError as e:
        return TurnDiff(diff=None, summary=turn.changes, reason=f"{e} (the run's checkpoints are discarded "
                                                                "when it ends unless --keep-checkpoints)")
    finally:
        store.meta.close()
