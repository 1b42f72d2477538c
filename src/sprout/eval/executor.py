"""Running the method's plans for real: agent rollouts in the task's sandboxes, Harbor grading, reviews,
here or as Run Store jobs (sprout.jobs).

Output layout (under `out`): attempts/<id>.jsonl (journals), verifier/<id>/ (Harbor's verifier files),
reviews/<id>.json. Records passed in as `recorded` are replayed instead of rerun when they match the
plan (that is resume); a journal left by an interrupted attempt is discarded (its sandbox, if a killed
run left it, and its checkpoints removed) and the attempt rerun. An attempt's sandbox goes when its
rollout ends; its checkpoints (which keep the task's limits for branches and grading) stay until
`release()`.

An attempt whose Run Store job was lost to infrastructure (the workers that took it kept dying) does not
stop its siblings: it is left unrecorded, the others finish, and then AttemptsLost ends the run, so a
resume runs it again (and the method carries on from there, as it would have).

`attempt_many` runs a list of plans in threads. Records are kept by id and listed in plan order (the
order plans were first asked for), never in finishing order, so summary.json and resume do not depend on
which attempt finished first; `on_record` is called under a lock, one record at a time.
"""

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths

from ..agent import defaults
from ..agent.journal import Journal, now, read_journal
from ..agent.models import Endpoint
from ..agent.runner import RolloutCancelled, RolloutSpec, TurnEvent
from ..errors import SproutError
from ..jobs.journals import discard
from ..jobs.local import Jobs, RolloutDone, RolloutRequest
from ..jobs.remote import JobLost
from ..method.records import AttemptPlan, AttemptRecord, ReviewRecord
from ..method.review import Reviewer, ReviewInput
from ..method.trajectory import trajectory
from ..sandbox import Store
from ..tasks import TaskImage


@dataclass
class AgentConfig:
    model: str
    endpoint: Endpoint
    model_class: str = "tools"
    wall_time_s: int = defaults.WALL_TIME_S
    command_timeout_s: int = defaults.COMMAND_TIMEOUT_S


class AttemptsLost(SproutError):
    """Attempts of a round were lost to infrastructure; the others are recorded and a resume reruns these."""


class TaskExecutor:
    def __init__(self, *, store: Store, jobs: Jobs, task: Task, image: TaskImage, agent: AgentConfig,
                 reviewer: Reviewer | None, out: Path, recorded_attempts: Iterable[AttemptRecord] = (),
                 recorded_reviews: Iterable[ReviewRecord] = (), on_record: Callable[[], None] = lambda: None,
                 on_turn: Callable[[str, TurnEvent], None] | None = None, log: Callable[[str], None] = print):
        self.store, self.jobs, self.task, self.image = store, jobs, task, image
        self.agent, self.reviewer, self.out = agent, reviewer, out
        self._records: dict[str, AttemptRecord] = {}  # replayed ones included
        self._order: dict[str, int] = {}  # attempt id -> its place in plan order
        self._lock = threading.RLock()  # guards the records, the journals cache and on_record
        self.reviews: list[ReviewRecord] = []
        self._recorded = {a.id: a for a in recorded_attempts}
        self._recorded_reviews = {r.id: r for r in recorded_reviews}
        self._journals: dict[str, Journal] = {}
        self.on_record, self.on_turn, self.log = on_record, on_turn, log
        self.cwd = task.config.environment.workdir or image.image.config.workdir or "/"

    # ------------------------------------------------------------------ attempts
    @property
    def attempts(self) -> list[AttemptRecord]:
        """The recorded attempts (replayed ones included), in plan order."""
        with self._lock:
            return sorted(self._records.values(), key=lambda a: self._order[a.id])

    def attempt_many(self, plans: Sequence[AttemptPlan], early_stop: bool, parallel: int) -> list[AttemptRecord]:
        """Runs `plans` in up to `parallel` threads (see search.Executor), replaying recorded ones."""
        with self._lock:
            for plan in plans:
                self._order.setdefault(plan.id, len(self._order))
        replayed = [self._replay(plan) for plan in plans if plan.id in self._recorded]
        lost: dict[str, str] = {}
        if not (early_stop and any(a.solved for a in replayed)):
            self._run_together([plan for plan in plans if plan.id not in self._recorded], early_stop, parallel, lost)
        with self._lock:
            records = [self._records[plan.id] for plan in plans if plan.id in self._records]
        for plan in plans:  # never started (early stop) or lost: its journal goes
            journal = self.out / "attempts" / f"{plan.id}.jsonl"
            if plan.id not in self._records and journal.exists():
                discard(self.store, journal)
        if lost and not (early_stop and any(a.solved for a in records)):
            raise AttemptsLost(f"{len(lost)} attempt(s) lost to infrastructure ({'; '.join(lost.values())}); "
                               f"the {len(records)} other(s) of the round are recorded: run the same command again "
                               "to rerun the lost ones and carry on")
        return records

    def _run_together(self, plans: Sequence[AttemptPlan], early_stop: bool, parallel: int,
                      lost: dict[str, str]) -> None:
        """Runs `plans` in threads. An error or an interrupt stops the others (not recorded: resume reruns
        them) and is raised once all have stopped; an attempt lost to infrastructure is put in `lost`."""
        solved = threading.Event()  # a sibling scored 1 (early stop): the stopped ones are recorded cancelled
        stop = threading.Event()  # early stop, an error or an interrupt: running rollouts end, queued ones never start
        with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(plans)))) as pool:
            futures = [pool.submit(self._attempt_or_skip, plan, early_stop, stop, solved, lost) for plan in plans]
            try:
                wait(futures)
            except BaseException:  # interrupted: the pool's exit waits for the stopped attempts
                stop.set()
                raise
        errors = [error for f in futures if (error := f.exception()) is not None]
        if errors:
            raise next((e for e in errors if not isinstance(e, RolloutCancelled)), errors[0])

    def _replay(self, plan: AttemptPlan) -> AttemptRecord:
        recorded = self._recorded[plan.id]
        if AttemptPlan.model_validate(recorded.model_dump(include=set(AttemptPlan.model_fields))) != plan:
            raise SproutError(f"{self.out}: the recorded attempt {plan.id} is not the one this run plans "
                              "(the output holds another run); pass --overwrite or choose another --output")
        with self._lock:
            self._records[plan.id] = recorded
        return recorded

    def _attempt_or_skip(self, plan: AttemptPlan, early_stop: bool, stop: threading.Event,
                         solved: threading.Event, lost: dict[str, str]) -> None:
        """One thread's attempt: not started once `stop` is set; an error stops its siblings, a loss does not."""
        if stop.is_set():
            return
        try:
            record = self._attempt(plan, stop, solved)
        except JobLost as e:
            self.log(f"{plan.id}: {e}; the others carry on, and running the command again reruns it")
            with self._lock:
                lost[plan.id] = f"{plan.id}: {e}"
            return
        except BaseException:
            stop.set()
            raise
        if early_stop and record.solved:
            solved.set()
            stop.set()

    def _attempt(self, plan: AttemptPlan, stop: threading.Event, solved: threading.Event) -> AttemptRecord:
        journal = self.out / "attempts" / f"{plan.id}.jsonl"
        if journal.exists():
            self.log(f"{plan.id}: discarding the journal of an interrupted run")
            discard(self.store, journal)
        self.log(_describe(plan))
        started = now()
        try:
            done = self._rollout(plan, journal, self.out / "verifier" / plan.id, stop)
        except (RolloutCancelled, SproutError) as e:
            if not solved.is_set():
                raise
            failed = "" if isinstance(e, RolloutCancelled) else f"; it had failed: {e}"
            if failed and journal.exists():
                discard(self.store, journal)
            self.log(f"{plan.id}: cancelled (a sibling scored 1{failed})")
            return self._record(_cancelled(plan, journal.relative_to(self.out), started))
        outcome = done.outcome
        if outcome.status == "error" and outcome.turns == 0:
            raise SproutError(f"attempt {plan.id}: the agent stopped before its first turn: {outcome.message}")
        trial_dir = self.out / "verifier" / plan.id
        grade_error: str | None
        try:
            graded = done.grade or (self.jobs.grade(outcome.final_checkpoint, done.host, trial_dir)
                                    if outcome.final_checkpoint else None)
        except SproutError as e:
            graded, grade_error = None, str(e)
        else:
            grade_error = "no checkpoint to grade" if graded is None else graded.error
        stdout = TrialPaths(trial_dir).test_stdout_path
        record = self._record(AttemptRecord(
            **plan.model_dump(), journal=str(journal.relative_to(self.out)), status=outcome.status,
            exit_status=outcome.exit_status, message=outcome.message, first_turn=(plan.from_turn or 0) + 1,
            turns=outcome.turns, tokens_in=outcome.tokens_in, tokens_out=outcome.tokens_out, wall_s=outcome.wall_s,
            final_checkpoint=outcome.final_checkpoint, reward=graded.reward if graded else None,
            rewards=graded.rewards if graded else {}, verdict=graded.verdict if graded else "error",
            grade_error=grade_error, grade_s=round(graded.duration_s, 3) if graded else 0.0,
            grade_mode=graded.mode if graded else None,
            verifier_output=str(stdout.relative_to(self.out)) if stdout.exists() else None, host=done.host,
            started=started))
        reward = "-" if record.reward is None else f"{record.reward:g}"
        self.log(f"{plan.id}: {outcome.status} after {outcome.turns} turns, {record.tokens:,} tokens; "
                 f"reward {reward} ({record.verdict}{': ' + grade_error if grade_error else ''})")
        return record

    def _record(self, record: AttemptRecord) -> AttemptRecord:
        with self._lock:
            self._records[record.id] = record
            self.on_record()
        return record

    def _rollout(self, plan: AttemptPlan, journal: Path, trial_dir: Path, stop: threading.Event) -> RolloutDone:
        spec = RolloutSpec(task=self.task.instruction, model=self.agent.model, endpoint=self.agent.endpoint,
                           journal=journal, image=self.image.reference, cwd=self.cwd,
                           model_class=self.agent.model_class, step_limit=plan.step_limit,
                           token_limit=plan.token_limit, wall_time_s=self.agent.wall_time_s,
                           command_timeout_s=self.agent.command_timeout_s)
        request = RolloutRequest(plan.id, spec, trial_dir=trial_dir)
        if plan.from_turn and plan.parent is not None:
            parent = self._by_id()[plan.parent]
            spec.from_journal, spec.from_turn, spec.note = self.out / parent.journal, plan.from_turn, plan.note
            request.host, request.checkpoint = parent.host, self._journal(parent).turn(plan.from_turn).checkpoint
        elif plan.note:
            spec.task = f"{self.task.instruction.rstrip()}\n\n{plan.note}"
        on_turn = self.on_turn
        on_event = (lambda event: on_turn(plan.id, event)) if on_turn else None
        return self.jobs.rollout(request, on_event, stop)

    # ------------------------------------------------------------------ reviews
    def review(self, review_id: str, round_number: int, target: AttemptRecord, n: int,
               attempts: Sequence[AttemptRecord]) -> ReviewRecord:
        recorded = self._recorded_reviews.get(review_id)
        if recorded is not None and recorded.reviewed == target.id:
            self.reviews.append(recorded)
            return recorded
        if self.reviewer is None:
            raise SproutError("this method has no reviewer")
        inp = self.review_input(target, n, attempts)
        self.log(f"{review_id}: reviewing {target.id} with {self.reviewer.config.model}")
        record = self.jobs.review(self.reviewer, inp, review_id=review_id, round_number=round_number,
                                     reviewed=target.id)
        path = self.out / "reviews" / f"{review_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(record.model_dump_json(indent=2))
        self.reviews.append(record)
        self.on_record()
        chosen = ", ".join(f"turn {p.turn} ({p.reason})" for p in record.branch_points)
        self.log(f"{review_id}: {'FALLBACK ' + record.fallback + '; ' if record.fallback else ''}branch from {chosen}")
        return record

    def review_input(self, target: AttemptRecord, n: int, attempts: Sequence[AttemptRecord]) -> ReviewInput:
        """What the review of `target` reads (its whole trajectory, its verifier's output) and is asked for."""
        return ReviewInput(instruction=self.task.instruction,
                           steps=trajectory(target, {a.id: a for a in attempts}, self._journal),
                           verifier_output=self._verifier_text(target), reward=target.reward, points=n,
                           max_calls=target.step_limit)

    def _verifier_text(self, attempt: AttemptRecord) -> str:
        text = (self.out / attempt.verifier_output).read_text(errors="replace") if attempt.verifier_output else ""
        return text + (f"\n[grading error: {attempt.grade_error}]" if attempt.grade_error else "")

    def _journal(self, attempt: AttemptRecord) -> Journal:
        with self._lock:
            if attempt.id not in self._journals:
                self._journals[attempt.id] = read_journal(self.out / attempt.journal)
            return self._journals[attempt.id]

    def _by_id(self) -> dict[str, AttemptRecord]:
        with self._lock:
            return dict(self._records)


def _cancelled(plan: AttemptPlan, journal: Path, started: datetime) -> AttemptRecord:
    """The record of an attempt stopped because a sibling scored 1: ungraded, its journal discarded."""
    return AttemptRecord(**plan.model_dump(), journal=str(journal), status="cancelled", exit_status="Cancelled",
                         message="stopped: a sibling attempt scored 1", first_turn=(plan.from_turn or 0) + 1,
                         turns=0, tokens_in=0, tokens_out=0, wall_s=round((now() - started).total_seconds(), 3),
                         final_checkpoint=None, reward=None, verdict="cancelled", started=started)


def _describe(plan: AttemptPlan) -> str:
    if plan.kind == "branch":
        start = "the start" if plan.from_turn == 0 else f"turn {plan.from_turn} of {plan.parent}"
        return f"{plan.id}: branch from {start} (review {plan.review}): {plan.reason}"
    return f"{plan.id}: {'first attempt' if plan.kind == 'first' else 'fresh restart'} (step limit {plan.step_limit})"

