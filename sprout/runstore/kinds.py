"""Job kinds and their payload models.

Every kind has a pydantic model that validates the payload on submit. The four
built-in kinds are registered here; more can be added with ``register_kind``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..agent.models import SamplingParams
from .endpoints import EndpointRef
from .errors import InvalidPayload, UnknownKind


class Payload(BaseModel):
    """Base of the payload models: unknown fields are rejected, so typos surface on submit."""

    model_config = ConfigDict(extra="forbid")


class RolloutOptions(Payload):
    """How a rollout runs (sprout.runstore.handlers.rollout). `endpoint` names a model endpoint
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
    deadline_unix: float | None = None  # the agent's wall time ends then (not wall_time_s after it starts)


class RolloutPayload(Payload):
    """Run an agent on a task inside an image, or branch `from_checkpoint` (turn `turn` of
    options.from_journal) with `note`."""

    task: str
    image: str | None = None
    model: str | None = None
    from_checkpoint: str | None = None
    turn: int | None = None
    note: str | None = None
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


_KINDS: dict[str, type[BaseModel]] = {}


def register_kind(name: str, payload_model: type[BaseModel]) -> None:
    """Make ``name`` a valid job kind whose payloads ``payload_model`` validates."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"invalid job kind name {name!r}: use letters, digits, '-' and '_'")
    _KINDS[name] = payload_model


def registered_kinds() -> list[str]:
    return sorted(_KINDS)


def validate_payload(kind: str, payload: dict[str, Any], *, endpoints: Collection[str] | None = None) -> dict[str, Any]:
    """Return ``payload`` validated and normalised (JSON-ready) for ``kind``; with ``endpoints``, an
    endpoint a job names must be one of those names."""
    model = _KINDS.get(kind)
    if model is None:
        raise UnknownKind(f"unknown job kind {kind!r}; registered kinds: {', '.join(registered_kinds())}")
    context = None if endpoints is None else {"endpoints": frozenset(endpoints)}
    try:
        return model.model_validate(payload, context=context).model_dump(mode="json")
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'payload'}: {err['msg']}" for err in exc.errors()
        )
        raise InvalidPayload(f"invalid payload for kind {kind!r}: {problems}") from None


for _name, _model in (
    ("rollout", RolloutPayload),
    ("grade", GradePayload),
    ("review", ReviewPayload),
    ("gate", GatePayload),
):
    register_kind(_name, _model)
