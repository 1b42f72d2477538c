"""Job kinds: the registry of payload models that validate each kind's payload on submit.

The queue knows no kinds of its own: the job side registers them (``sprout.worker.jobs`` registers
rollout, grade, review and gate when imported; the API's ``--kinds`` imports it), so the queue knows
nothing of agents or tasks.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import InvalidPayload, UnknownKind


class Payload(BaseModel):
    """Base of the payload models: unknown fields are rejected, so typos surface on submit."""

    model_config = ConfigDict(extra="forbid")


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
