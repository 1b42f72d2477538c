"""Server-Sent Events framing for the group event stream."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .models import Event

KEEPALIVE = ": keepalive\n\n"


def format_event(event: Event) -> str:
    return f"id: {event.seq}\nevent: {event.type.value}\ndata: {event.model_dump_json()}\n\n"


def parse_events(lines: Iterable[str]) -> Iterator[Event]:
    """Events from the lines of an SSE stream (comments and other fields are skipped)."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield Event.model_validate_json("\n".join(data))
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
