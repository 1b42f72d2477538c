"""The jobs workers run: one typed payload per kind, used alike by whoever submits it (the method's
Run Store backend, the gate, the RL driver) and by the handler that runs it (sprout.worker.handlers).

Importing this module registers the kinds with the Run Store's registry, so the API validates every
payload at submit (unknown or missing fields are refused with the field named) and the handler
validates it again with the same model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ..agent.models import SamplingParams
from ..agent.runner import InsertedTurn
from ..runstore.endpoints import EndpointRef
from ..runstore.kinds import Payload, register_kind
from ..tasks.swe_rebench import SweRebenchRef

SandboxBackend = Literal["container", "microvm"]


class RolloutOptions(Payload):
    """How a rollout runs (sprout.worker.handlers.rollout). `endpoint` names a model endpoint
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
    backend: SandboxBackend = "container"  # of a fresh start (a branch keeps its checkpoint's)


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


class ReviewerSpec(Payload):
    """The reviewer of a review job (sprout.method.review.ReviewerConfig, its endpoint as a reference)."""

    model: str
    endpoint: EndpointRef
    retries: int = Field(2, ge=0)
    seed: int = 0
    temperature: float = 0.0
    timeout_s: float = Field(600.0, gt=0)


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
    """Review a failed trajectory (sprout.method.review): the reviewer and the ReviewInput
    (instruction, steps, verifier output), as JSON."""

    reviewer: ReviewerSpec
    input: dict[str, Any]
    review_id: str
    round: int = Field(ge=1)
    reviewed: str


class GatePayload(Payload):
    """Check that a task is well formed before rollouts are spent on it (oracle 1, nop 0)."""

    task_dir: str
    log_dir: str | None = None  # where the gate's logs go (default: a fresh temporary directory)
    rebuild_before: float | None = None
    pull: Literal["missing", "always", "never"] | None = None  # the pull policy (default: the worker's)
    backend: SandboxBackend = "container"


KINDS: dict[str, type[Payload]] = {"rollout": RolloutPayload, "grade": GradePayload, "swe-grade": SweGradePayload,
                                   "review": ReviewPayload, "gate": GatePayload}
for _name, _model in KINDS.items():
    register_kind(_name, _model)


def kind_of(payload: Payload) -> str:
    """The job kind a payload is submitted as."""
    return next(name for name, model in KINDS.items() if isinstance(payload, model))
