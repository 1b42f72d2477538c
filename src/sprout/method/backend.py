"""Where the method's work runs. `LocalBackend` runs rollouts, grades and reviews in this process;
`sprout.worker.remote.RunStoreBackend` submits them as Run Store jobs that workers run with the same
functions. Both take and return the same records, so the method and its summary cannot tell them apart.
A rollout whose `stop` event is set ends with RolloutCancelled, its sandbox, checkpoints and journal
discarded (by this process, or by the worker once the cancelled job's heartbeat stops it), ungraded.
"""

import socket
import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harbor.models.task.task import Task

from ..agent.journal import Outcome
from ..agent.runner import RolloutCancelled, RolloutSpec, TurnEvent, run_rollout
from ..sandbox import Image, Sandbox, Store
from ..sandbox.slots import HostSlots, SlotWaitStopped
from ..tasks import GradeResult, grade, start_task_sandbox
from .records import ReviewRecord
from .review import ReviewerConfig, ReviewInput, review


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


class Backend(Protocol):
    def rollout(self, request: RolloutRequest, on_turn: Callable[[TurnEvent], None] | None,
                stop: threading.Event | None = None) -> RolloutDone: ...

    def grade(self, checkpoint: str, host: str | None, trial_dir: Path) -> GradeResult: ...

    def review(self, config: ReviewerConfig, inp: ReviewInput, *, review_id: str, round_number: int,
               reviewed: str) -> ReviewRecord: ...


class LocalBackend:
    """Runs everything here, in `store`; each rollout (with its live grade) and each grade holds one of
    the host's slots (sprout.sandbox.slots), which every process on this host shares."""

    def __init__(self, store: Store, task: Task, image: Image | None = None, *, hold_slots: bool = True):
        """`hold_slots` False: the caller holds the host's slot around each call."""
        self.store, self.task, self.image = store, task, image
        self.host = socket.gethostname()
        self.slots = HostSlots(store.root) if hold_slots else None

    def rollout(self, request: RolloutRequest, on_turn: Callable[[TurnEvent], None] | None,
                stop: threading.Event | None = None) -> RolloutDone:
        if self.slots is None:
            return self._rollout(request, on_turn, stop)
        try:
            with self.slots.hold(stop):
                return self._rollout(request, on_turn, stop)
        except SlotWaitStopped:
            raise RolloutCancelled("stopped before it started (waiting for a free slot)") from None

    def _rollout(self, request: RolloutRequest, on_turn: Callable[[TurnEvent], None] | None,
                 stop: threading.Event | None) -> RolloutDone:
        from .executor import discard  # the executor imports this module

        fresh = request.spec.from_journal is None
        sandbox = start_task_sandbox(self.store, self.task, request.attempt, image=self.image) if fresh else None
        grader = LiveGrader(self.store, self.task, request.trial_dir) if request.trial_dir else None
        try:
            result = run_rollout(request.spec, self.store, on_event=on_turn, sandbox=sandbox, stop=stop,
                                 on_finish=grader)
        except RolloutCancelled:  # run_rollout destroyed the sandbox; the checkpoints and journal go too
            discard(self.store, request.spec.journal)
            raise
        return RolloutDone(result.outcome, self.host, grader.result if grader else None)

    def grade(self, checkpoint: str, host: str | None, trial_dir: Path) -> GradeResult:
        with self.slots.hold() if self.slots else nullcontext():
            return grade(self.store, self.store.checkpoint(checkpoint), self.task, trial_dir=trial_dir)

    def review(self, config: ReviewerConfig, inp: ReviewInput, *, review_id: str, round_number: int,
               reviewed: str) -> ReviewRecord:
        return review(config, inp, review_id=review_id, round_number=round_number, reviewed=reviewed)


class LiveGrader:
    """run_rollout's on_finish: grades the attempt in its own live sandbox after its final checkpoint,
    as Harbor grades in the agent's container (a rollout without a checkpoint is not graded)."""

    def __init__(self, store: Store, task: Task, trial_dir: Path):
        self.store, self.task, self.trial_dir = store, task, trial_dir
        self.result: GradeResult | None = None

    def __call__(self, sandbox: Sandbox, outcome: Outcome) -> None:
        if outcome.final_checkpoint:
            self.result = grade(self.store, sandbox, self.task, trial_dir=self.trial_dir)
