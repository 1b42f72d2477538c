"""Work run here, in this process and this host's store: a rollout (a fresh start in a task's sandbox, a
branch of a checkpoint, or a SWE-rebench V2 instance) graded live at its end, a grade of a stored
checkpoint, a review. A worker's handlers call these functions for the jobs they claim; `LocalJobs` calls
them for an evaluation that runs in this process. `sprout.jobs.remote.RunStoreJobs` runs the same work as
Run Store jobs; both take and return the same records, so their callers cannot tell them apart.

A rollout whose `stop` event is set ends with RolloutCancelled, its sandbox, checkpoints and journal
discarded (by this process, or by the worker once the cancelled job's heartbeat stops it), ungraded.
"""

import socket
import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from harbor.models.task.task import Task

from ..agent.journal import Outcome
from ..agent.runner import RolloutCancelled, RolloutSpec, TurnEvent, run_rollout
from ..method.records import ReviewRecord
from ..method.review import Reviewer, ReviewInput
from ..sandbox import Image, Sandbox, Store
from ..sandbox.slots import HostSlots, SlotWaitStopped
from ..tasks import GradeResult, start_task_sandbox
from ..tasks.grade import grade
from ..tasks.swe_rebench import SweRebenchRef
from ..tasks.swe_rebench.rollout import GRADE_WALL_S, run_swe_rollout
from .journals import discard


@dataclass
class RolloutRequest:
    attempt: str  # the attempt's id
    spec: RolloutSpec  # a branch when spec.from_journal is set; else a fresh start in the task's sandbox
    host: str | None = None  # where the branch's checkpoint is (None: unknown, or a fresh start)
    checkpoint: str | None = None  # the checkpoint a branch starts from
    trial_dir: Path | None = None  # set: grade the attempt live at its end, the verifier's files go here


@dataclass
class RolloutDone:
    outcome: Outcome
    host: str  # where its checkpoints are
    grade: GradeResult | None = None  # the live grade, when the request asked for one and there was a turn
    checkpoints: list[str] = field(default_factory=list)  # one per turn, in order


class Jobs(Protocol):
    """Where an evaluation's work runs: here (LocalJobs) or as Run Store jobs (remote.RunStoreJobs)."""

    def rollout(self, request: RolloutRequest, on_turn: Callable[[TurnEvent], None] | None,
                stop: threading.Event | None = None) -> RolloutDone: ...

    def grade(self, checkpoint: str, host: str | None, trial_dir: Path) -> GradeResult: ...

    def review(self, reviewer: Reviewer, inp: ReviewInput, *, review_id: str, round_number: int,
               reviewed: str) -> ReviewRecord: ...


def rollout_here(store: Store, request: RolloutRequest, *, task: Task | None = None, image: Image | None = None,
                 swe: SweRebenchRef | None = None, grade_wall_s: float | None = None,
                 stop: threading.Event | None = None, on_turn: Callable[[TurnEvent], None] | None = None,
                 label: str | None = None) -> RolloutDone:
    """Runs one rollout in this process: on a SWE-rebench instance (`swe`, graded as its official harness at
    the end), else a fresh start in `task`'s sandbox (of `image`, else the task's) or a branch of the request's
    checkpoint, graded live by the task's verifier when the request names a trial directory."""
    label = label or request.attempt
    grader = LiveGrader(store, task, request.trial_dir) if task is not None and request.trial_dir else None
    try:
        if swe is not None:
            result, grade_result = run_swe_rollout(store, request.spec, swe, label=label, stop=stop,
                                                   grade_wall_s=grade_wall_s or GRADE_WALL_S)
            return RolloutDone(result.outcome, socket.gethostname(), grade_result, result.checkpoints)
        fresh = request.spec.from_journal is None and task is not None
        sandbox = start_task_sandbox(store, task, label, image=image) if fresh else None
        result = run_rollout(request.spec, store, on_event=on_turn, sandbox=sandbox, stop=stop, on_finish=grader)
    except RolloutCancelled:  # run_rollout destroyed the sandbox; the checkpoints and journal go too
        discard(store, request.spec.journal)
        raise
    return RolloutDone(result.outcome, socket.gethostname(), grader.result if grader else None, result.checkpoints)


class LocalJobs:
    """Runs everything here, in `store`; each rollout (with its live grade) and each grade holds one of
    the host's slots (sprout.sandbox.slots), which every process on this host shares."""

    def __init__(self, store: Store, task: Task, image: Image | None = None, *, hold_slots: bool = True):
        """`hold_slots` False: the caller holds the host's slot around each call."""
        self.store, self.task, self.image = store, task, image
        self.slots = HostSlots(store.root) if hold_slots else None

    def rollout(self, request: RolloutRequest, on_turn: Callable[[TurnEvent], None] | None,
                stop: threading.Event | None = None) -> RolloutDone:
        try:
            with self.slots.hold(stop) if self.slots else nullcontext():
                return rollout_here(self.store, request, task=self.task, image=self.image, stop=stop, on_turn=on_turn)
        except SlotWaitStopped:
            raise RolloutCancelled("stopped before it started (waiting for a free slot)") from None

    def grade(self, checkpoint: str, host: str | None, trial_dir: Path) -> GradeResult:
        with self.slots.hold() if self.slots else nullcontext():
            return grade(self.store, self.store.checkpoint(checkpoint), self.task, trial_dir=trial_dir)

    def review(self, reviewer: Reviewer, inp: ReviewInput, *, review_id: str, round_number: int,
               reviewed: str) -> ReviewRecord:
        return reviewer.review(inp, review_id=review_id, round_number=round_number, reviewed=reviewed)


class LiveGrader:
    """run_rollout's on_finish: grades the attempt in its own live sandbox after its final checkpoint,
    as Harbor grades in the agent's container (a rollout without a checkpoint is not graded)."""

    def __init__(self, store: Store, task: Task, trial_dir: Path):
        self.store, self.task, self.trial_dir = store, task, trial_dir
        self.result: GradeResult | None = None

    def __call__(self, sandbox: Sandbox, outcome: Outcome) -> None:
        if outcome.final_checkpoint:
            self.result = grade(self.store, sandbox, self.task, trial_dir=self.trial_dir)

