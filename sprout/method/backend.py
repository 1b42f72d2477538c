"""Where the method's work runs. `LocalBackend` runs rollouts, grades and reviews in this process;
`sprout.eval.remote.RunStoreBackend` submits them as Run Store jobs that workers run with the same
functions. Both take and return the same records, so the method and its summary cannot tell them apart.
"""

import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harbor.models.task.task import Task

from ..agent.journal import Outcome
from ..agent.runner import RolloutSpec, TurnEvent, run_rollout
from ..sandbox import Store
from ..tasks import GradeResult, grade, start_task_sandbox
from .records import ReviewRecord
from .review import ReviewerConfig, ReviewInput, review


@dataclass
class RolloutRequest:
    attempt: str  # the attempt's id
    spec: RolloutSpec  # a branch when spec.from_journal is set; else a fresh start in the task's sandbox
    host: str | None = None  # where the branch's checkpoint is (None: unknown, or a fresh start)
    checkpoint: str | None = None  # the checkpoint a branch starts from


@dataclass
class RolloutDone:
    outcome: Outcome
    host: str  # where its checkpoints are


class Backend(Protocol):
    def rollout(self, request: RolloutRequest, on_turn: Callable[[TurnEvent], None] | None) -> RolloutDone: ...

    def grade(self, checkpoint: str, host: str | None, trial_dir: Path) -> GradeResult: ...

    def review(self, config: ReviewerConfig, inp: ReviewInput, *, review_id: str, round_number: int,
               reviewed: str) -> ReviewRecord: ...


class LocalBackend:
    """Runs everything here, in `store`."""

    def __init__(self, store: Store, task: Task):
        self.store, self.task = store, task
        self.host = socket.gethostname()

    def rollout(self, request: RolloutRequest, on_turn: Callable[[TurnEvent], None] | None) -> RolloutDone:
        fresh = request.spec.from_journal is None
        sandbox = start_task_sandbox(self.store, self.task, request.attempt) if fresh else None
        result = run_rollout(request.spec, self.store, on_event=on_turn, sandbox=sandbox)
        return RolloutDone(result.outcome, self.host)

    def grade(self, checkpoint: str, host: str | None, trial_dir: Path) -> GradeResult:
        return grade(self.store, self.store.checkpoint(checkpoint), self.task, trial_dir=trial_dir)

    def review(self, config: ReviewerConfig, inp: ReviewInput, *, review_id: str, round_number: int,
               reviewed: str) -> ReviewRecord:
        return review(config, inp, review_id=review_id, round_number=round_number, reviewed=reviewed)
