"""What `sprout view` shows, as JSON: the runs it was given (evaluations, and benchmarks of them), each
evaluation's attempt tree, each attempt's trajectory turn by turn, and what a turn changed on disk.

Everything is read anew on each request, so a run still being written is followed as it grows. Files are
only read inside the directories given: a journal or verifier path a summary names is resolved (links
too) and refused when it lands outside its run directory. Every API path is also a key of the static page
(`pages`), which embeds the same JSON.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..agent.journal import Journal, read_journal
from ..errors import SproutError
from ..eval.benchmark import METHODS
from ..eval.results import method_rows
from ..eval.summary import SUMMARY, EvaluationSummary, read_summary
from ..method.budget import equal_budget
from ..method.records import AttemptRecord
from ..sandbox import Store
from ..sandbox.diff import ChangeSummary, CheckpointDiff

OBSERVATION_CAP = 20_000  # characters of a turn's output sent to the page


class View(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class Index(View):
    evaluations: list[EvaluationEntry]
    benchmarks: list[BenchmarkEntry]
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
    """The run directories given to `sprout view`: evaluations (a summary.json) and benchmarks (directories
    of them), numbered in the order given."""

    def __init__(self, directories: list[Path]):
        self.evaluations: list[Path] = []
        self.benchmarks: list[tuple[Path, list[int]]] = []
        self.problems: list[str] = []
        for directory in directories:
            self._add(Path(directory))
        if not self.evaluations:
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
        else:
            self.problems.append(f"{directory} is not a Sprout run (no {SUMMARY} in it or its subdirectories)")

    def summary(self, number: int) -> EvaluationSummary:
        if not 0 <= number < len(self.evaluations):
            raise SproutError(f"no evaluation {number}")
        return read_summary(self.evaluations[number])

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
        return Index(evaluations=entries, benchmarks=benchmarks, problems=problems)

    def evaluation(self, number: int) -> EvaluationView:
        summary = self.summary(number)
        return EvaluationView(id=number, name=self.evaluations[number].name, summary=summary.model_dump(mode="json"))

    def _attempt(self, number: int, attempt_id: str) -> tuple[EvaluationSummary, AttemptRecord, Journal]:
        summary = self.summary(number)
        attempt = next((a for a in summary.attempts if a.id == attempt_id), None)
        if attempt is None:
            raise SproutError(f"evaluation {number} has no attempt {attempt_id}")
        return summary, attempt, read_journal(self.inside(number, attempt.journal))

    def inside(self, number: int, relative: str) -> Path:
        """`relative` in evaluation `number`'s directory, refused when it (or a link on the way) leads outside."""
        root = self.evaluations[number].resolve()
        path = (root / relative).resolve()
        if not path.is_relative_to(root):
            raise SproutError(f"{relative} is outside the run directory {self.evaluations[number]}: not shown")
        return path

    def trajectory(self, number: int, attempt_id: str) -> TrajectoryView:
        summary, attempt, journal = self._attempt(number, attempt_id)
        turns = [TurnView(turn=t.turn, checkpoint=t.checkpoint, thought=t.thought, commands=t.commands,
                          observation=_cap(t.observation), exit_code=t.exit_code, changes=t.changes)
                 for t in journal.turns]
        if turns and journal.header.parent is not None and journal.header.parent.note:
            turns[0].note_before = journal.header.parent.note
        return TrajectoryView(attempt=attempt.id, journal=attempt.journal, turns=turns,
                              outcome=journal.outcome.model_dump(mode="json") if journal.outcome else None,
                              problems=journal.problems)

    def turn_diff(self, number: int, attempt_id: str, turn_number: int) -> TurnDiff:
        _, _, journal = self._attempt(number, attempt_id)
        turn = journal.turn(turn_number)
        if turn.changes is None or turn.checkpoint is None:
            return TurnDiff(diff=None, summary=None, reason="this turn's changes were not recorded (a microVM's "
                                                           "disk, or a journal from before they were)")
        store_db = Path(journal.header.store) / "state" / "sprout.db"
        if not store_db.is_file():
            return TurnDiff(diff=None, summary=turn.changes, reason=f"the store {journal.header.store} is not on "
                                                                    "this host: the journal's summary only")
        store = Store(Path(journal.header.store))
        try:
            return TurnDiff(diff=store.diff(turn.changes.since, turn.checkpoint), summary=turn.changes)
        except SproutError as e:
            return TurnDiff(diff=None, summary=turn.changes, reason=f"{e} (the run's checkpoints are discarded "
                                                                    "when it ends unless --keep-checkpoints)")
        finally:
            store.meta.close()

    def pages(self) -> Iterator[tuple[str, View]]:
        """Every API path and its JSON, for the static page (diffs where the checkpoints still exist)."""
        index = self.index()
        yield "/api/index", index
        for entry in index.evaluations:
            view = self.evaluation(entry.id)
            yield f"/api/evaluations/{entry.id}", view
            for attempt in self.summary(entry.id).attempts:
                try:
                    trajectory = self.trajectory(entry.id, attempt.id)
                except SproutError:
                    continue  # the page says the attempt's journal cannot be read
                yield f"/api/evaluations/{entry.id}/attempts/{attempt.id}", trajectory
                for turn in trajectory.turns:
                    yield (f"/api/evaluations/{entry.id}/attempts/{attempt.id}/turns/{turn.turn}/diff",
                           self.turn_diff(entry.id, attempt.id, turn.turn))


def _cap(text: str) -> str:
    if len(text) <= OBSERVATION_CAP:
        return text
    half = OBSERVATION_CAP // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}"

