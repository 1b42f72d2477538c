"""Job kinds and their payload models.

Every kind has a pydantic model that validates the payload on submit. The four
built-in kinds are registered here; more can be added with ``register_kind``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import InvalidPayload, UnknownKind


class Payload(BaseModel):
    """Base of the payload models: unknown fields are rejected, so typos surface on submit."""

    model_config = ConfigDict(extra="forbid")


class RolloutPayload(Payload):
    """Run an agent on a task inside an image, or branch `from_checkpoint` (turn `turn` of
    options.from_journal) with `note`. `options`: see sprout.runstore.handlers.rollout."""

    task: str
    image: str | None = None
    model: str | None = None
    from_checkpoint: str | None = None
    turn: int | None = None
    note: str | None = None
    options: dict[str, Any] = {}


class GradePayload(Payload):
    """Grade a checkpoint against a task's verifier."""

    checkpoint_id: str
    task_dir: str
    trial_dir: str | None = None  # where the verifier's files go (default: a temporary directory)


class ReviewPayload(Payload):
    """Review a failed trajectory (sprout.method.review): the reviewer's ReviewerConfig and the
    ReviewInput (instruction, steps, verifier output), as JSON."""

    reviewer: dict[str, Any]
    input: dict[str, Any]
    review_id: str
    round: int = Field(ge=1)
    reviewed: str


class GatePayload(Payload):
    """Check that a task is well formed before rollouts are spent on it (oracle 1, nop 0)."""

    task_dir: str
    log_dir: str | None = None  # where the gate's logs go (default: a fresh temporary directory)
    rebuild_before: float | None = None


_KINDS: dict[str, type[BaseModel]] = {}


def register_kind(name: str, payload_model: type[BaseModel]) -> None:
    """Make ``name`` a valid job kind whose payloads ``payload_model`` validates."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"invalid job kind name {name!r}: use letters, digits, '-' and '_'")
    _KINDS[name] = payload_model


def registered_kinds() -> list[str]:
    return sorted(_KINDS)


def validate_payload(kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Return ``payload`` validated and normalised (JSON-ready) for ``kind``."""
    model = _KINDS.get(kind)
    if model is None:
        raise UnknownKind(f"unknown job kind {kind!r}; registered kinds: {', '.join(registered_kinds())}")
    try:
        return model.model_validate(payload).model_dump(mode="json")
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
