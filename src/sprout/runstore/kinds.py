"""Job kinds: which kinds a Run Store accepts, and the payload model that validates each kind's payloads.

The queue knows no kinds of its own: whoever opens a RunStore tells it its kinds (Sprout's are
``sprout.jobs.payloads.job_kinds()``), so the queue knows nothing of agents or tasks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import InvalidPayload, UnknownKind


class Payload(BaseModel):
    """Base of the payload models: unknown fields are rejected, so typos surface on submit."""

    model_config = ConfigDict(extra="forbid")


class JobKinds:
    """The kinds a Run Store accepts: a payload model per kind name; `context` is given to every validation
    (a model's validators may read it, e.g. the names a payload may refer to)."""

    def __init__(self, models: Mapping[str, type[BaseModel]], context: Mapping[str, Any] | None = None) -> None:
        for name in models:
            if not name or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"invalid job kind name {name!r}: use letters, digits, '-' and '_'")
        self.models, self.context = dict(models), dict(context or {})

    def names(self) -> list[str]:
        return sorted(self.models)

    def check_known(self, kinds: list[str]) -> None:
        """Raises UnknownKind for a kind this store does not accept."""
        if unknown := sorted(set(kinds) - set(self.models)):
            raise UnknownKind(f"unknown job kind {', '.join(map(repr, unknown))}; registered kinds: "
                              f"{', '.join(self.names())}")

    def validate(self, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` validated and normalised (JSON-ready) for ``kind``."""
        self.check_known([kind])
        try:
            return self.models[kind].model_validate(payload, context=self.context).model_dump(mode="json")
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'payload'}: {err['msg']}" for err in exc.errors()
            )
            raise InvalidPayload(f"invalid payload for kind {kind!r}: {problems}") from None
