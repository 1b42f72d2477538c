"""The ledger: every accepted group and each of its sample slots, kept until the group is DELETEd.

SQLite by default (a file in the driver's data directory), or any SQLAlchemy URL such as the Run
Store's PostgreSQL. A driver that restarts reads its unfinished groups back from here and carries
them on; GET answers from here alone, so it answers the same before and after a restart.
"""

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Float,
    Integer,
    MetaData,
    Table,
    Text,
    create_engine,
    delete,
    exists,
    insert,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from ..runstore.db import parse_url

LIVE = ("queued", "running")
UNFINISHED = ("pending", "running")
DELETING = "deleting"  # DELETEd, its samples still stopping; answered as unknown, its id not yet free

_metadata = MetaData()
groups = Table(
    "rl_groups", _metadata,
    Column("id", Text, primary_key=True),
    Column("digest", Text, nullable=False),  # sha256 of the request body: a different body is refused
    Column("request", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("stop_reason", Text),
    Column("submitted_at", Float, nullable=False),  # unix seconds; the wall time counts from here
    Column("finished_at", Float),
)
slots = Table(
    "rl_slots", _metadata,
    Column("group_id", Text, primary_key=True),
    Column("slot_id", Text, primary_key=True),
    Column("position", Integer, nullable=False),  # the slot's place in the request
    Column("sample_index", Integer, nullable=False),
    Column("state", Text, nullable=False),
    Column("job_id", BigInteger),  # the Run Store job running it, if any
    Column("trajectory", Text),  # JSON, when done
    Column("failure", Text),  # why the actor failed, when failed
    Column("budget", Text, nullable=False, default="{}"),  # JSON: calls, tokens, sandbox seconds
)


@dataclass
class SlotRow:
    slot_id: str
    sample_index: int
    position: int
    state: str
    job_id: int | None = None
    trajectory: dict[str, Any] | None = None
    failure: str | None = None
    budget: dict[str, float] = field(default_factory=dict)


@dataclass
class GroupRow:
    id: str
    digest: str
    request: dict[str, Any]
    status: str
    stop_reason: str | None
    submitted_at: float
    slots: list[SlotRow]


class Ledger:
    def __init__(self, url: str):
        parsed = parse_url(url)
        if parsed.get_backend_name() == "sqlite" and parsed.database:
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        connect_args = {"timeout": 30} if parsed.get_backend_name() == "sqlite" else {}
        self.engine: Engine = create_engine(parsed, connect_args=connect_args)
        self._lock = threading.Lock()  # one writer at a time in this process (SQLite's lock is coarse anyway)
        _metadata.create_all(self.engine)

    def add_group(self, group_id: str, digest: str, request: dict[str, Any], submitted_at: float,
                  slot_ids: list[tuple[str, int]], used: int) -> bool:
        """Records a new group (its first `used` slots pending, the rest unused); False if the id exists."""
        rows = [{"group_id": group_id, "slot_id": slot_id, "position": i, "sample_index": index,
                 "state": "pending" if i < used else "unused", "budget": "{}"}
                for i, (slot_id, index) in enumerate(slot_ids)]
        with self._lock:
            try:
                with self.engine.begin() as conn:
                    conn.execute(insert(groups).values(id=group_id, digest=digest, request=json.dumps(request),
                                                       status="queued", submitted_at=submitted_at))
                    conn.execute(insert(slots), rows)
            except IntegrityError:
                return False
        return True

    def group(self, group_id: str) -> GroupRow | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(groups).where(groups.c.id == group_id)).first()
            if row is None:
                return None
            slot_rows = conn.execute(select(slots).where(slots.c.group_id == group_id)
                                     .order_by(slots.c.position)).all()
        return GroupRow(id=row.id, digest=row.digest, request=json.loads(row.request), status=row.status,
                        stop_reason=row.stop_reason, submitted_at=row.submitted_at,
                        slots=[_slot(s) for s in slot_rows])

    def unfinished(self) -> list[str]:
        """Groups still queued or running, or being deleted, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(groups.c.id).where(groups.c.status.in_((*LIVE, DELETING)))
                                .order_by(groups.c.submitted_at)).all()
        return [r.id for r in rows]

    def abandoned(self) -> list[str]:
        """Groups cancelled because no client polled them (not yet DELETEd)."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(groups.c.id).where(groups.c.status == "cancelled",
                                                          groups.c.stop_reason.like("abandoned:%"))).all()
        return [r.id for r in rows]

    def set_status(self, group_id: str, status: str, stop_reason: str | None = None,
                   finished_at: float | None = None, *, only_live: bool = True) -> bool:
        """Sets a group's status; with `only_live`, only while it is queued or running (a terminal status
        is never left, a group being deleted stays so). Whether it was set."""
        condition = [groups.c.id == group_id] + ([groups.c.status.in_(LIVE)] if only_live else [])
        return self._write(update(groups).where(*condition).values(
            status=status, stop_reason=stop_reason, finished_at=finished_at)) > 0

    def set_slot(self, group_id: str, generation: float, slot_id: str, *, state: str, job_id: int | None = None,
                 trajectory: dict[str, Any] | None = None, failure: str | None = None,
                 budget: dict[str, float] | None = None) -> bool:
        """Records a slot of the group submitted at `generation`, while that group is queued or running and
        the slot is unfinished (a late sample of a finished, deleted or resubmitted group, or of a slot
        already failed for its time, changes nothing). Whether it did."""
        values: dict[str, Any] = {"state": state, "trajectory": None if trajectory is None else json.dumps(trajectory),
                                  "failure": failure}
        if job_id is not None:
            values["job_id"] = job_id
        if budget is not None:
            values["budget"] = json.dumps(budget)
        live = exists().where(groups.c.id == group_id, groups.c.submitted_at == generation, groups.c.status.in_(LIVE))
        return self._write(update(slots).where(slots.c.group_id == group_id, slots.c.slot_id == slot_id,
                                               slots.c.state.in_(UNFINISHED), live).values(**values)) > 0

    def fail_slot(self, group_id: str, generation: float, slot_id: str, reason: str) -> None:
        """Marks one slot failed unless it finished (its sample ran out of time)."""
        self.set_slot(group_id, generation, slot_id, state="failed", failure=reason)

    def plan_slots(self, group_id: str, generation: float, slot_ids: list[str]) -> None:
        """Puts unused slots of the live group submitted at `generation` to use (a search's branches)."""
        live = exists().where(groups.c.id == group_id, groups.c.submitted_at == generation, groups.c.status.in_(LIVE))
        self._write(update(slots).where(slots.c.group_id == group_id, slots.c.slot_id.in_(slot_ids),
                                        slots.c.state == "unused", live).values(state="pending"))

    def fail_unfinished_slots(self, group_id: str, reason: str) -> None:
        """Marks the slots still pending or running failed (the group's time is up)."""
        self._write(update(slots).where(slots.c.group_id == group_id, slots.c.state.in_(UNFINISHED))
                    .values(state="failed", failure=reason))

    def delete(self, group_id: str) -> None:
        with self._lock, self.engine.begin() as conn:
            conn.execute(delete(slots).where(slots.c.group_id == group_id))
            conn.execute(delete(groups).where(groups.c.id == group_id))

    def close(self) -> None:
        self.engine.dispose()

    def _write(self, statement) -> int:
        with self._lock, self.engine.begin() as conn:
            return conn.execute(statement).rowcount


def _slot(row) -> SlotRow:
    return SlotRow(slot_id=row.slot_id, sample_index=row.sample_index, position=row.position, state=row.state,
                   job_id=row.job_id, trajectory=json.loads(row.trajectory) if row.trajectory else None,
                   failure=row.failure, budget=json.loads(row.budget or "{}"))
