"""The Run Store: a durable job queue with leases, retries, host affinity and an event log.

Lifecycle of a job::

    queued --claim--> leased --complete--> succeeded
      ^                 |  \\--fail(retry=False) or last attempt--> failed
      |                 |--fail(retry=True)--> queued (not_before = now + backoff)
      |                 |--release--> queued (the attempt is not counted)
      \\--lease expired--/  (its worker died: counted apart, max_lease_expiries fail the job)
    queued or leased --cancel--> cancelled

Every lease has a ``lease_token`` that grows by one at each lease of the job; the
holder passes it to heartbeat/complete/fail/release, and a token that is not the
current, unexpired lease is refused with ``LeaseLost``. Times come from ``clock``
(epoch seconds), so all writers of one database should have synchronised clocks.

On PostgreSQL, claim, heartbeat and complete run as single statements (see
``queries``); everything else, and everything on SQLite, runs in a transaction.
"""

from __future__ import annotations

import builtins
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Self, TypeVar

import pydantic_core
from pydantic import BaseModel
from sqlalchemy import Connection, Row, insert, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError

from . import queries as q
from .db import Database
from .errors import InvalidPayload, InvalidTransition, JobNotFound, LeaseLost
from .kinds import JobKinds
from .migrations import current_version, migrate
from .models import Claim, Event, EventType, Host, Job, JobPage, JobSpec, JobState
from .schema import hosts, jobs

T = TypeVar("T")

MAX_PAGE = 1000
_RETRY_SQLSTATES = {"40001", "40P01"}  # PostgreSQL: serialization failure, deadlock
# Claims look for expired leases at most this often (per store), which saves the
# claim path a statement under load; an expired job waits at most this long more.
COLLECT_INTERVAL_S = 0.1

# (job_id, group_id, type, data) of an event to append.
_Pending = tuple[int, str | None, EventType, dict[str, Any]]


def _dt(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC)


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()


def _job(row: Row[Any]) -> Job:
    m = row._mapping
    return Job(
        id=m["id"],
        kind=m["kind"],
        payload=json.loads(m["payload"]),
        state=m["state"],
        priority=m["priority"],
        attempts=m["attempts"],
        max_attempts=m["max_attempts"],
        lease_owner=m["lease_owner"],
        lease_host=m["lease_host"],
        lease_token=m["lease_token"],
        lease_expires_at=_dt(m["lease_expires_at"]),
        lease_expiries=m["lease_expiries"],
        max_lease_expiries=m["max_lease_expiries"],
        heartbeat_at=_dt(m["heartbeat_at"]),
        result=None if m["result"] is None else json.loads(m["result"]),
        error=m["error"],
        parent_id=m["parent_id"],
        group_id=m["group_id"],
        host=m["host"],
        affinity_timeout_s=m["affinity_timeout_s"],
        shipped_from=m["shipped_from"],
        not_before=_dt(m["not_before"]),
        idempotency_key=m["idempotency_key"],
        created_at=_dt(m["created_at"]),
        updated_at=_dt(m["updated_at"]),
        started_at=_dt(m["started_at"]),
        finished_at=_dt(m["finished_at"]),
    )


def _claims(rows: Sequence[Row[Any]]) -> list[Claim]:
    """Claims of the leased rows, highest priority first, then oldest."""
    jobs_ = sorted(map(_job, rows), key=lambda job: (-job.priority, job.id))
    return [
        Claim(
            job=job,
            lease_token=job.lease_token,
            lease_expires_at=job.lease_expires_at,
            ship_from=job.shipped_from,
        )
        for job in jobs_
    ]


def _to_json(value: Any, what: str) -> str:
    try:
        return pydantic_core.to_json(value).decode()
    except pydantic_core.PydanticSerializationError as exc:
        raise InvalidPayload(f"{what} is not JSON-serialisable: {exc}") from None


class RunStore:
    """Jobs in SQLite (a file path or ``sqlite:///PATH``) or PostgreSQL
    (``postgresql+psycopg://...``); the schema is created or migrated on open.

    Thread-safe: share one instance between the threads of a process. ``kinds``: the job kinds it
    accepts, each with the model its payloads must validate against (a kind name maps to its model).
    """

    def __init__(
        self,
        url: str,
        kinds: JobKinds | Mapping[str, type[BaseModel]],
        *,
        clock: Callable[[], float] = time.time,
        retry_base_s: float = 1.0,
        retry_max_s: float = 300.0,
        pool_size: int = 10,
    ) -> None:
        self.kinds = kinds if isinstance(kinds, JobKinds) else JobKinds(kinds)
        self._db = Database.open(url, pool_size=pool_size)
        self._clock = clock
        self._retry_base_s = retry_base_s
        self._retry_max_s = retry_max_s
        self._next_collect = 0.0
        try:
            migrate(self._db, clock())
        except BaseException:
            self._db.close()
            raise

    @property
    def url(self) -> str:
        """The database URL, password hidden."""
        return self._db.safe_url

    @property
    def dialect(self) -> str:
        return self._db.dialect

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def schema_version(self) -> int:
        return self._run(current_version, write=False)

    # -- submitting and reading ------------------------------------------------------------

    def submit(self, kind: str, payload: dict[str, Any] | None = None, **opts: Any) -> Job:
        """Queue one job; ``opts`` are the other fields of ``JobSpec``."""
        return self.submit_many([JobSpec(kind=kind, payload=payload or {}, **opts)])[0]

    def submit_many(self, specs: Iterable[JobSpec | dict[str, Any]]) -> builtins.list[Job]:
        """Queue jobs in one transaction; returns them in the order given."""
        parsed = [s if isinstance(s, JobSpec) else JobSpec.model_validate(s) for s in specs]
        payloads = [self.kinds.validate(s.kind, s.payload) for s in parsed]
        keys = sorted({s.idempotency_key for s in parsed if s.idempotency_key is not None})
        parents = sorted({s.parent_id for s in parsed if s.parent_id is not None})

        def op(conn: Connection) -> builtins.list[Job]:
            now = self._clock()
            by_key: dict[str, Job] = {}
            if keys:
                rows = conn.execute(select(jobs).where(jobs.c.idempotency_key.in_(keys))).all()
                by_key = {row.idempotency_key: _job(row) for row in rows}
            if parents:
                found = set(conn.execute(select(jobs.c.id).where(jobs.c.id.in_(parents))).scalars())
                if missing := [p for p in parents if p not in found]:
                    raise JobNotFound(f"parent job {', '.join(map(str, missing))} not found")
            new: builtins.list[tuple[int, JobSpec, dict[str, Any]]] = []
            new_keys: set[str] = set()
            for i, (spec, payload) in enumerate(zip(parsed, payloads, strict=True)):
                key = spec.idempotency_key
                if key is None or (key not in by_key and key not in new_keys):
                    new.append((i, spec, payload))
                    if key is not None:
                        new_keys.add(key)
            out: builtins.list[Job | None] = [None] * len(parsed)
            if new:
                rows = conn.execute(
                    insert(jobs).returning(*jobs.c, sort_by_parameter_order=True),
                    [self._new_row(spec, payload, now) for _, spec, payload in new],
                ).all()
                for (i, spec, _), row in zip(new, rows, strict=True):
                    out[i] = job = _job(row)
                    if spec.idempotency_key is not None:
                        by_key[spec.idempotency_key] = job
                self._append(
                    conn,
                    now,
                    [(job.id, job.group_id, EventType.SUBMITTED, {"kind": job.kind}) for job in out if job],
                )
            return [job or by_key[spec.idempotency_key or ""] for job, spec in zip(out, parsed, strict=True)]

        try:
            return self._run(op)
        except IntegrityError:
            if not keys:
                raise
            return self._run(op)  # lost a race on an idempotency key: the retry finds the winner's job

    @staticmethod
    def _new_row(spec: JobSpec, payload: dict[str, Any], now: float) -> dict[str, Any]:
        not_before = spec.not_before.timestamp() if spec.not_before else None
        queued_from = max(now, not_before or now)
        return {
            "kind": spec.kind,
            "payload": json.dumps(payload),
            "state": q.QUEUED,
            "priority": spec.priority,
            "attempts": 0,
            "max_attempts": spec.max_attempts,
            "lease_token": 0,
            "lease_expiries": 0,
            "max_lease_expiries": spec.max_lease_expiries,
            "parent_id": spec.parent_id,
            "group_id": spec.group_id,
            "host": spec.host,
            "affinity_timeout_s": spec.affinity_timeout_s,
            "affinity_deadline": (
                queued_from + spec.affinity_timeout_s
                if spec.host and spec.affinity_timeout_s is not None
                else None
            ),
            "not_before": not_before,
            "idempotency_key": spec.idempotency_key,
            "created_at": now,
            "updated_at": now,
        }

    def get(self, job_id: int) -> Job:
        return self._run(lambda conn: self._get(conn, job_id), write=False)

    # -- hosts -----------------------------------------------------------------------------

    def register_host(self, name: str, ship_url: str | None) -> Host:
        """Record that a worker runs on ``name`` and serves its checkpoints at ``ship_url``."""
        seen_at = self._clock()
        values = {"name": name, "ship_url": ship_url, "seen_at": seen_at}
        self._run(lambda conn: conn.execute(q.UPSERT_HOST, values))
        return Host(name=name, ship_url=ship_url, seen_at=_dt(seen_at))

    def hosts(self, seen_within_s: float) -> builtins.list[Host]:
        """The hosts whose workers registered in the last `seen_within_s` seconds (live ones), by name."""
        since = self._clock() - seen_within_s
        rows = self._run(lambda conn: conn.execute(select(hosts).where(hosts.c.seen_at >= since)
                                                   .order_by(hosts.c.name)).all(), write=False)
        return [Host(name=r.name, ship_url=r.ship_url, seen_at=_dt(r.seen_at)) for r in rows]

    def host(self, name: str) -> Host | None:
        row = self._run(lambda conn: conn.execute(select(hosts).where(hosts.c.name == name)).first(), write=False)
        return None if row is None else Host(name=row.name, ship_url=row.ship_url, seen_at=_dt(row.seen_at))

    def list(
        self,
        state: JobState | str | None = None,
        kind: str | None = None,
        group_id: str | None = None,
        limit: int = 100,
        cursor: int | None = None,
    ) -> JobPage:
        """Jobs in submission order, filtered; page on with ``cursor=page.next_cursor``."""
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE}, not {limit}")
        query = select(jobs).order_by(jobs.c.id).limit(limit + 1)
        if state is not None:
            query = query.where(jobs.c.state == _state(state))
        if kind is not None:
            query = query.where(jobs.c.kind == kind)
        if group_id is not None:
            query = query.where(jobs.c.group_id == group_id)
        if cursor is not None:
            query = query.where(jobs.c.id > cursor)
        rows = self._run(lambda conn: conn.execute(query).all(), write=False)
        page = [_job(row) for row in rows[:limit]]
        return JobPage(jobs=page, next_cursor=page[-1].id if len(rows) > limit else None)

    def cancel(self, job_id: int) -> Job:
        """Cancel a queued or leased job (its lease holder then gets ``LeaseLost``).
        Cancelling a cancelled job returns it; a finished one raises ``InvalidTransition``."""

        def op(conn: Connection) -> Job:
            now = self._clock()
            row = conn.execute(q.CANCEL, {"job_id": job_id, "now": now}).first()
            if row is not None:
                job = _job(row)
                self._append(conn, now, [(job.id, job.group_id, EventType.CANCELLED, {})])
                return job
            job = self._get(conn, job_id)
            if job.state != JobState.CANCELLED:
                raise InvalidTransition(f"job {job_id} already {job.state}; it cannot be cancelled")
            return job

        return self._run(op)

    def events(self, group_id: str, after_seq: int = 0, limit: int = MAX_PAGE) -> builtins.list[Event]:
        """The events of a group with ``seq > after_seq``, oldest first."""
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE}, not {limit}")
        params = {"group_id": group_id, "after": after_seq, "limit": limit}
        rows = self._run(lambda conn: conn.execute(q.GROUP_EVENTS, params).all(), write=False)
        return [
            Event(
                seq=r.seq,
                job_id=r.job_id,
                group_id=r.group_id,
                type=r.type,
                at=_dt(r.at),
                data=json.loads(r.data),
            )
            for r in rows
        ]

    # -- leases ----------------------------------------------------------------------------

    def claim(
        self,
        worker_id: str,
        host: str,
        kinds: Sequence[str] | None = None,
        limit: int = 1,
        lease_s: float = 60.0,
    ) -> builtins.list[Claim]:
        """Lease up to ``limit`` claimable jobs, highest priority first, then oldest.

        Claimable: queued, past ``not_before``, of one of ``kinds`` (default: any), and
        either without a host, for ``host``, or past its affinity deadline (then the
        claim's ``ship_from`` names the preferred host). Expired leases are collected
        first: their jobs are queued again, or failed after their last attempt.
        """
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE}, not {limit}")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, not {lease_s}")
        if kinds is not None:
            self.kinds.check_known(list(kinds))

        def op(conn: Connection, collect: bool) -> builtins.list[Claim]:
            now = self._clock()
            log = self._collect_expired(conn, now) if collect else []
            rows = conn.execute(q.CLAIM_ANY if kinds is None else q.CLAIM_KINDS, params(now)).all()
            for claim in (claims := _claims(rows)):
                data = {
                    "worker_id": worker_id,
                    "host": host,
                    "lease_token": claim.lease_token,
                    "attempt": claim.job.attempts,
                }
                if claim.ship_from:
                    data["ship_from"] = claim.ship_from
                log.append((claim.job.id, claim.job.group_id, EventType.LEASED, data))
            self._append(conn, now, log)
            return claims

        def params(now: float) -> dict[str, Any]:
            values = {
                "now": now,
                "until": now + lease_s,
                "claimer_host": host,
                "worker_id": worker_id,
                "limit": limit,
            }
            return values if kinds is None else values | {"kinds": list(kinds)}

        now = self._clock()
        collect = now >= self._next_collect
        if collect:
            self._next_collect = now + COLLECT_INTERVAL_S
        elif self._db.dialect == "postgresql":
            statement = q.PG_CLAIM_ANY if kinds is None else q.PG_CLAIM_KINDS
            return _claims(self._retrying(lambda: self._db.execute_alone(statement, params(now))))
        return self._run(lambda conn: op(conn, collect))

    def _collect_expired(self, conn: Connection, now: float) -> builtins.list[_Pending]:
        """Queue again (or fail, after the last attempt) the jobs whose lease expired."""
        rows = conn.execute(q.COLLECT_EXPIRED, {"now": now}).all()
        log: builtins.list[_Pending] = []
        for r in rows:
            data = {
                "worker_id": r.lease_owner,
                "lease_token": r.lease_token,
                "will_retry": r.state == q.QUEUED,
            }
            log.append((r.id, r.group_id, EventType.LEASE_EXPIRED, data))
            if r.state == q.FAILED:
                log.append((r.id, r.group_id, EventType.FAILED, {"error": r.error}))
        return log

    def heartbeat(self, job_id: int, lease_token: int, extend_s: float = 60.0) -> Job:
        """Extend a current lease to ``now + extend_s``."""
        if extend_s <= 0:
            raise ValueError(f"extend_s must be positive, not {extend_s}")

        now = self._clock()
        params = {"job_id": job_id, "token": lease_token, "now": now, "until": now + extend_s}
        if self._db.dialect == "postgresql":
            rows = self._retrying(lambda: self._db.execute_alone(q.HEARTBEAT, params))
        else:
            rows = self._run(lambda conn: list(conn.execute(q.HEARTBEAT, params).all()))
        if not rows:
            raise self._run(lambda conn: self._lease_lost(conn, job_id, lease_token), write=False)
        return _job(rows[0])

    def complete(self, job_id: int, lease_token: int, result: Any = None) -> Job:
        """Finish a job with a JSON ``result``. Repeating the call for the same lease
        returns the job (so a client may retry it); any other late call raises ``LeaseLost``."""
        result_json = _to_json(result, "result")

        def op(conn: Connection) -> Job | None:
            row = conn.execute(q.COMPLETE, params).first()
            if row is None:
                return None
            job = _job(row)
            self._append(
                conn, now, [(job.id, job.group_id, EventType.SUCCEEDED, {"worker_id": job.lease_owner})]
            )
            return job

        def refused(conn: Connection) -> Job:
            job = self._get(conn, job_id)
            if job.state == JobState.SUCCEEDED and job.lease_token == lease_token:
                return job
            raise self._lease_lost(conn, job_id, lease_token)

        now = self._clock()
        params = {"job_id": job_id, "token": lease_token, "now": now, "result_json": result_json}
        if self._db.dialect == "postgresql":
            rows = self._retrying(lambda: self._db.execute_alone(q.PG_COMPLETE, params))
            done = _job(rows[0]) if rows else None
        else:
            done = self._run(op)
        return done or self._run(refused, write=False)

    def fail(self, job_id: int, lease_token: int, error: str, retry: bool = True) -> Job:
        """Record a failed attempt. With ``retry`` and attempts left, the job is queued
        again after an exponential backoff (``not_before``); otherwise it fails."""

        def op(conn: Connection) -> Job:
            now = self._clock()
            row = conn.execute(q.LOCK_LEASE, {"job_id": job_id, "token": lease_token, "now": now}).first()
            if row is None:
                raise self._lease_lost(conn, job_id, lease_token)
            values: dict[str, Any] = {"error": error, "lease_expires_at": None, "updated_at": now}
            data: dict[str, Any] = {"worker_id": row.lease_owner, "attempt": row.attempts, "error": error}
            failures = row.attempts - row.lease_expiries  # tries whose handler ended, this one included
            if retry and failures < row.max_attempts:
                not_before = now + min(self._retry_max_s, self._retry_base_s * 2 ** (failures - 1))
                values |= {"state": q.QUEUED, "not_before": not_before}
                if row.affinity_timeout_s is not None:
                    values["affinity_deadline"] = not_before + row.affinity_timeout_s
                data["not_before"] = _iso(not_before)
                kind = EventType.RETRY_SCHEDULED
            else:
                values |= {"state": q.FAILED, "finished_at": now}
                kind = EventType.FAILED
            job = _job(
                conn.execute(update(jobs).where(jobs.c.id == job_id).values(values).returning(*jobs.c)).one()
            )
            self._append(conn, now, [(job.id, job.group_id, kind, data)])
            return job

        return self._run(op)

    def release(self, job_id: int, lease_token: int) -> Job:
        """Give a leased job back to the queue without counting the attempt (graceful drain)."""

        def op(conn: Connection) -> Job:
            now = self._clock()
            row = conn.execute(q.RELEASE, {"job_id": job_id, "token": lease_token, "now": now}).first()
            if row is None:
                raise self._lease_lost(conn, job_id, lease_token)
            job = _job(row)
            self._append(
                conn, now, [(job.id, job.group_id, EventType.RELEASED, {"worker_id": job.lease_owner})]
            )
            return job

        return self._run(op)

    # -- internals -------------------------------------------------------------------------

    def _run(self, op: Callable[[Connection], T], *, write: bool = True) -> T:
        """Run ``op`` in a transaction."""

        def once() -> T:
            with self._db.begin(write) as conn:
                return op(conn)

        return self._retrying(once)

    @staticmethod
    def _retrying(fn: Callable[[], T]) -> T:
        """Call ``fn`` again (twice at most) after a dead pooled connection or a deadlock."""
        for attempt in range(3):
            try:
                return fn()
            except DBAPIError as exc:
                retryable = (
                    exc.connection_invalidated or getattr(exc.orig, "sqlstate", None) in _RETRY_SQLSTATES
                )
                if not retryable or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _get(self, conn: Connection, job_id: int) -> Job:
        row = conn.execute(q.GET, {"job_id": job_id}).first()
        if row is None:
            raise JobNotFound(f"job {job_id} not found")
        return _job(row)

    def _lease_lost(self, conn: Connection, job_id: int, lease_token: int) -> LeaseLost:
        job = self._get(conn, job_id)
        if lease_token != job.lease_token:
            if lease_token > job.lease_token:
                return LeaseLost(f"job {job_id} has no lease {lease_token} (its latest is {job.lease_token})")
            return LeaseLost(f"lease {lease_token} of job {job_id} was superseded by lease {job.lease_token}")
        if job.state == JobState.LEASED:
            return LeaseLost(
                f"lease {lease_token} of job {job_id} expired at {job.lease_expires_at:%Y-%m-%dT%H:%M:%S}Z"
            )
        return LeaseLost(f"lease {lease_token} of job {job_id} is over: the job is {job.state}")

    def _append(self, conn: Connection, now: float, log: builtins.list[_Pending]) -> None:
        """Append events; done last in each transaction, so PostgreSQL's per-group lock is held briefly."""
        if log:
            rows = [
                {"job_id": job_id, "group_id": group, "type": kind.value, "at": now, "data": json.dumps(data)}
                for job_id, group, kind, data in log
            ]
            self._db.append_events(conn, rows)


def _state(state: JobState | str) -> str:
    try:
        return JobState(state).value
    except ValueError:
        raise ValueError(
            f"unknown job state {state!r}; states: {', '.join(s.value for s in JobState)}"
        ) from None
