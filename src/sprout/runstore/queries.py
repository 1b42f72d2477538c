"""Statements of the store's hot paths, built once with bind parameters.

Building a SQLAlchemy statement and its cache key costs more than running it on
SQLite, so the statements run at every claim, heartbeat and completion are built
here at import; the store passes only the parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    Double,
    Integer,
    Select,
    Text,
    Update,
    and_,
    bindparam,
    case,
    cast,
    func,
    insert,
    literal,
    literal_column,
    or_,
    select,
    text,
    true,
    update,
)

from .models import EventType, JobState
from .schema import events, jobs

QUEUED = JobState.QUEUED.value
LEASED = JobState.LEASED.value
SUCCEEDED = JobState.SUCCEEDED.value
FAILED = JobState.FAILED.value
CANCELLED = JobState.CANCELLED.value


def _in_state(state: str) -> ColumnElement[bool]:
    """``state = '<state>'`` with the state inlined, so the planners can use the partial indexes."""
    return jobs.c.state == literal_column(f"'{state}'")


_now = bindparam("now", type_=Double)
_job_id = bindparam("job_id", type_=BigInteger)  # BIGINT columns: INTEGER would overflow on PostgreSQL
_token = bindparam("token", type_=BigInteger)

_current_lease = and_(
    jobs.c.id == _job_id,
    _in_state(LEASED),
    jobs.c.lease_token == _token,
    jobs.c.lease_expires_at > _now,
)

GET = select(jobs).where(jobs.c.id == _job_id)

# Expired leases (the worker died): queued again, or failed after max_lease_expiries. They are not
# failures of the job's handler, which max_attempts counts (attempts - lease_expiries).
_expired = (
    select(jobs.c.id)
    .where(_in_state(LEASED), jobs.c.lease_expires_at <= _now)
    .with_for_update(skip_locked=True)
)
_expiries = jobs.c.lease_expiries + 1
_exhausted = _expiries >= jobs.c.max_lease_expiries
COLLECT_EXPIRED = (
    update(jobs)
    .where(jobs.c.id.in_(_expired))
    .values(
        state=case((_exhausted, FAILED), else_=QUEUED),
        lease_expiries=_expiries,
        lease_expires_at=None,
        error=case(
            (_exhausted, literal("lease expired ") + cast(_expiries, Text)
             + literal(" times: the workers that took it died or lost the Run Store")),
            else_=jobs.c.error,
        ),
        finished_at=case((_exhausted, _now), else_=None),
        affinity_deadline=_now + jobs.c.affinity_timeout_s,
        updated_at=_now,
    )
    .returning(jobs.c.id, jobs.c.group_id, jobs.c.state, jobs.c.lease_owner, jobs.c.lease_token, jobs.c.error)
)


def _claim(with_kinds: bool) -> Update:
    claimer_host = bindparam("claimer_host", type_=Text)
    picked = (
        select(jobs.c.id)
        .where(
            _in_state(QUEUED),
            or_(jobs.c.not_before.is_(None), jobs.c.not_before <= _now),
            or_(jobs.c.host.is_(None), jobs.c.host == claimer_host, jobs.c.affinity_deadline <= _now),
        )
        .order_by(jobs.c.priority.desc(), jobs.c.id)
        .limit(bindparam("limit", type_=Integer, literal_execute=True))
        .with_for_update(skip_locked=True)
    )
    if with_kinds:
        picked = picked.where(jobs.c.kind.in_(bindparam("kinds", expanding=True)))
    return (
        update(jobs)
        .where(jobs.c.id.in_(picked))
        .values(
            state=LEASED,
            attempts=jobs.c.attempts + 1,
            lease_owner=bindparam("worker_id", type_=Text),
            lease_host=claimer_host,
            lease_token=jobs.c.lease_token + 1,
            lease_expires_at=bindparam("until", type_=Double),
            heartbeat_at=_now,
            shipped_from=case(
                (and_(jobs.c.host.is_not(None), jobs.c.host != claimer_host), jobs.c.host), else_=None
            ),
            not_before=None,
            started_at=func.coalesce(jobs.c.started_at, _now),
            updated_at=_now,
        )
        .returning(*jobs.c)
    )


CLAIM_ANY = _claim(with_kinds=False)
CLAIM_KINDS = _claim(with_kinds=True)

HEARTBEAT = (
    update(jobs)
    .where(_current_lease)
    .values(lease_expires_at=bindparam("until", type_=Double), heartbeat_at=_now, updated_at=_now)
    .returning(*jobs.c)
)

COMPLETE = (
    update(jobs)
    .where(_current_lease)
    .values(
        state=SUCCEEDED,
        result=bindparam("result_json", type_=Text),
        lease_expires_at=None,
        finished_at=_now,
        updated_at=_now,
    )
    .returning(*jobs.c)
)

LOCK_LEASE = select(jobs).where(_current_lease).with_for_update()

RELEASE = (
    update(jobs)
    .where(_current_lease)
    .values(
        state=QUEUED,
        attempts=jobs.c.attempts - 1,
        lease_expires_at=None,
        affinity_deadline=_now + jobs.c.affinity_timeout_s,
        updated_at=_now,
    )
    .returning(*jobs.c)
)

CANCEL = (
    update(jobs)
    .where(jobs.c.id == _job_id, jobs.c.state.in_([QUEUED, LEASED]))
    .values(state=CANCELLED, lease_expires_at=None, finished_at=_now, updated_at=_now)
    .returning(*jobs.c)
)

GROUP_EVENTS = (
    select(events)
    .where(
        events.c.group_id == bindparam("group_id", type_=Text),
        events.c.seq > bindparam("after", type_=BigInteger),
    )
    .order_by(events.c.seq)
    .limit(bindparam("limit", type_=Integer))
)


# -- PostgreSQL: one statement per operation ------------------------------------------------
#
# On PostgreSQL a round trip costs more than the statements, so the hot operations run as
# one statement in autocommit mode: a data-modifying CTE updates the jobs, takes the
# group locks (as ``Database.append_events`` does) and appends the events derived from
# the updated rows. The event data must match what the store writes on SQLite.


def _with_events(
    changed: Update, kind: EventType, data: Callable[[CTE], list[ColumnElement[Any]]]
) -> Select[Any]:
    done = changed.cte("done")
    keys = (
        select(func.hashtextextended(done.c.group_id, 0).label("k"))
        .where(done.c.group_id.is_not(None))
        .distinct()
        .order_by("k")
        .subquery("keys")
    )
    locks = select(func.count(func.pg_advisory_xact_lock(keys.c.k)).label("n")).subquery("locks")
    rows = select(
        done.c.id,
        done.c.group_id,
        literal(kind.value, Text),
        _now,
        cast(func.json_strip_nulls(func.json_build_object(*data(done))), Text),
    ).select_from(done.join(locks, true()))
    appended = insert(events).from_select(["job_id", "group_id", "type", "at", "data"], rows).cte("appended")
    return select(done).add_cte(appended)


def _leased_data(done: CTE) -> list[ColumnElement[Any]]:
    return [
        literal("worker_id", Text), done.c.lease_owner,
        literal("host", Text), done.c.lease_host,
        literal("lease_token", Text), done.c.lease_token,
        literal("attempt", Text), done.c.attempts,
        literal("ship_from", Text), done.c.shipped_from,
    ]  # fmt: skip


PG_CLAIM_ANY = _with_events(CLAIM_ANY, EventType.LEASED, _leased_data)
PG_CLAIM_KINDS = _with_events(CLAIM_KINDS, EventType.LEASED, _leased_data)
PG_COMPLETE = _with_events(
    COMPLETE, EventType.SUCCEEDED, lambda done: [literal("worker_id", Text), done.c.lease_owner]
)


# Both engines: INSERT ... ON CONFLICT DO UPDATE (SQLite >= 3.24).
UPSERT_HOST = text(
    "INSERT INTO hosts (name, ship_url, seen_at) VALUES (:name, :ship_url, :seen_at) "
    "ON CONFLICT (name) DO UPDATE SET ship_url = excluded.ship_url, seen_at = excluded.seen_at"
)
