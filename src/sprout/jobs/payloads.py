"""The jobs workers run: one typed payload per kind, used alike by whoever submits it (an evaluation, the
gate, the RL driver) and by the handler that runs it (sprout.worker.handlers).

A Run Store is told these kinds (`job_kinds`), so its API validates every payload at submit (unknown or
missing fields are refused with the field named, an endpoint name its workers do not have too) and the
handler validates it again with the same model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from ..agent import defaults
from ..agent.journal import Outcome
from ..agent.models import Endpoint, SamplingParams
from ..agent.runner import InsertedTurn, RolloutSpec
from ..errors import SproutError
from ..method.review import ReviewerConfig, ReviewInput
from ..runstore.kinds import JobKinds, Payload
from ..sandbox import backends
from ..sandbox.backends import BackendName
from ..tasks import GradeResult
from ..tasks.swe_rebench import SweRebenchRef
from .endpoints import EndpointRef, endpoint_ref, known_names
from .local import RolloutDone, RolloutRequest


class RolloutOptions(Payload):
    """How a rollout runs (sprout.jobs.local.rollout_here, on a worker). `endpoint` names a model endpoint
    configured on the workers or gives a plain URL; a job never names a key or a key variable."""

    endpoint: EndpointRef
    journal: str
    cwd: str = "/tmp"
    from_journal: str | None = None
    task_dir: str | None = None  # the task: a fresh start is made in its sandbox, as Harbor starts it
    grade_trial_dir: str | None = None  # grade live at the end (needs task_dir); the verifier's files go here
    label: str | None = None
    model_class: Literal["tools", "text"] | None = None
    step_limit: int | None = Field(None, ge=1)
    token_limit: int | None = Field(None, ge=1)
    wall_time_s: int | None = Field(None, ge=1)
    command_timeout_s: int | None = Field(None, ge=1)
    sampling: SamplingParams | None = None  # sent with every model call
    swe: SweRebenchRef | None = None  # a SWE-rebench V2 instance: its image, graded as the official harness
    grade_wall_s: float | None = Field(None, gt=0)  # the SWE-rebench grade's test commands, at most
    deadline_unix: float | None = None  # the agent's wall time ends then (not wall_time_s after it starts)
    backend: BackendName = backends.DEFAULT  # of a fresh start (a branch keeps its checkpoint's)


class RolloutPayload(Payload):
    """Run an agent on a task inside an image, or branch `from_checkpoint` (turn `turn` of
    options.from_journal) with `note`, executing `insert` as the branch's first turn when given."""

    task: str
    image: str | None = None
    model: str | None = None
    from_checkpoint: str | None = None
    turn: int | None = None
    note: str | None = None
    insert: InsertedTurn | None = None
    options: RolloutOptions


class GradePayload(Payload):
    """Grade a checkpoint against a task's verifier."""

    checkpoint_id: str
    task_dir: str
    trial_dir: str | None = None  # where the verifier's files go (default: a temporary directory)


class SweGradePayload(Payload):
    """Grade a SWE-rebench V2 instance as its official harness does, in a fresh sandbox of its image: the
    agent's change in a checkpoint of this host's store, or a diff given as text (exactly one of them)."""

    swe: SweRebenchRef
    checkpoint_id: str | None = None
    diff: str | None = None
    rule: Literal["exact", "lenient"] = "exact"  # what decides `resolved` (both are reported)
    timeout_s: float = Field(600.0, gt=0)  # the test commands, at most

    @model_validator(mode="after")
    def _one_source(self) -> SweGradePayload:
        if (self.checkpoint_id is None) == (self.diff is None):
            raise ValueError("give exactly one of checkpoint_id and diff")
        return self


class ReviewPayload(Payload):
    """Review a failed trajectory (sprout.method.review): how the reviewer is asked, where it is served (a
    workers' endpoint, or a plain URL), and what it reads."""

    reviewer: ReviewerConfig
    endpoint: EndpointRef
    input: ReviewInput
    review_id: str
    round: int = Field(ge=1)
    reviewed: str


class GatePayload(Payload):
    """Check that a task is well formed before rollouts are spent on it (oracle 1, nop 0)."""

    task_dir: str
    log_dir: str | None = None  # where the gate's logs go (default: a fresh temporary directory)
    rebuild_before: float | None = None
    pull: Literal["missing", "always", "never"] | None = None  # the pull policy (default: the worker's)
    backend: BackendName = backends.DEFAULT


class PreparePayload(Payload):
    """Import the images of tasks into the store of the host that takes the job (it names one host), ahead
    of the samples that need them. `tasks`: task directories on a filesystem the host shares."""

    tasks: list[str] = Field(min_length=1, max_length=10_000)
    pull: Literal["missing", "always", "never"] | None = None  # the pull policy (default: the worker's)


class PrepareResult(Payload):
    """What a prepare job returns: per task directory, the image reference ready on `host`, or why not."""

    host: str
    ready: dict[str, str] = {}
    failed: dict[str, str] = {}


KINDS: dict[str, type[Payload]] = {"rollout": RolloutPayload, "grade": GradePayload, "swe-grade": SweGradePayload,
                                   "review": ReviewPayload, "gate": GatePayload, "prepare": PreparePayload}


def job_kinds(endpoints: Collection[str] = ()) -> JobKinds:
    """Sprout's job kinds, as a Run Store is told them; a job may name only the model `endpoints` its
    workers have configured."""
    return JobKinds(KINDS, context={"endpoints": known_names(endpoints)})


def kind_of(payload: Payload) -> str:
    """The job kind a payload is submitted as."""
    return next(name for name, model in KINDS.items() if isinstance(payload, model))


class Shipped(Payload):
    """What a worker shipped before it ran a job claimed away from the host holding its checkpoint
    (sprout.worker.shipping): the subvolumes sent in order (an image first when it lacked it) and what the
    checkpoint's stream was made against (None: a full send)."""

    host: str  # shipped from
    checkpoint: str
    subvolumes: list[str]
    parent: str | None
    bytes: int
    seconds: float


class RolloutResult(Payload):
    """What a rollout job returns. `host`: where its checkpoints are (the worker that made them, not one
    that reports them later); `grade`: its live grade, when one was asked for and there was a turn;
    `shipped`: set by the worker when it shipped the branch's checkpoint first."""

    outcome: Outcome
    journal: str
    checkpoints: list[str]
    host: str
    grade: GradeResult | None = None
    shipped: Shipped | None = None

    def done(self) -> RolloutDone:
        return RolloutDone(self.outcome, self.host, self.grade, self.checkpoints)


def rollout_payload(request: RolloutRequest, task_dir: Path | None, *, deadline_unix: float | None = None,
                    swe: SweRebenchRef | None = None, grade_wall_s: float | None = None,
                    backend: str = backends.DEFAULT) -> RolloutPayload:
    """The rollout job that runs `request` on a worker: a fresh start in the task's sandbox (a `backend`
    one), or a branch; graded live when the request has a trial directory. With `swe` (and no task), a
    rollout on that SWE-rebench instance, graded as the official harness. `rollout_request` is the inverse."""
    spec = request.spec
    options = RolloutOptions(
        endpoint=endpoint_ref(spec.endpoint), journal=str(spec.journal.resolve()), cwd=spec.cwd,
        model_class=spec.model_class, step_limit=spec.step_limit, token_limit=spec.token_limit,
        wall_time_s=spec.wall_time_s, command_timeout_s=spec.command_timeout_s, label=request.attempt,
        task_dir=str(task_dir.resolve()) if task_dir else None, sampling=spec.sampling, deadline_unix=deadline_unix,
        swe=swe, grade_wall_s=grade_wall_s, backend=backend,
        from_journal=str(spec.from_journal.resolve()) if spec.from_journal is not None else None,
        grade_trial_dir=str(request.trial_dir.resolve()) if request.trial_dir is not None else None)
    return RolloutPayload(task=spec.task, image=spec.image, model=spec.model, from_checkpoint=request.checkpoint,
                          turn=spec.from_turn, note=spec.note, insert=spec.insert, options=options)


def rollout_request(payload: RolloutPayload, endpoint: Endpoint, attempt: str) -> RolloutRequest:
    """The rollout a payload describes, with the endpoint the worker resolved; a deadline becomes the wall
    time left."""
    options = payload.options
    limits = {k: v for k, v in options.model_dump(include={"model_class", "step_limit", "token_limit",
                                                          "wall_time_s", "command_timeout_s"}).items() if v is not None}
    if options.deadline_unix is not None:
        limits["wall_time_s"] = _seconds_until(options.deadline_unix)
    spec = RolloutSpec(task=payload.task, model=payload.model or "default", endpoint=endpoint,
                       journal=Path(options.journal), image=payload.image or defaults.IMAGE, cwd=options.cwd,
                       from_journal=Path(options.from_journal) if options.from_journal else None,
                       from_turn=payload.turn, note=payload.note, insert=payload.insert, sampling=options.sampling,
                       **limits)
    return RolloutRequest(attempt, spec, checkpoint=payload.from_checkpoint,
                          trial_dir=Path(options.grade_trial_dir) if options.grade_trial_dir else None)


def _seconds_until(deadline_unix: float) -> int:
    left = deadline_unix - time.time()
    if left < 1:
        raise SproutError("the rollout's deadline passed before it started")
    return math.ceil(left)
