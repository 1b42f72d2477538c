"""Records of the Run Store: jobs, claims, events, and what a submitter sends."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
"""An integer the databases can store in a BIGINT: ids, lease tokens, cursors."""
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
"""An integer the databases can store in an INTEGER column (a priority)."""


class JobState(StrEnum):
    QUEUED = "queued"
    LEASED = "leased"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class EventType(StrEnum):
    SUBMITTED = "submitted"
    LEASED = "leased"
    LEASE_EXPIRED = "lease_expired"
    RELEASED = "released"
    RETRY_SCHEDULED = "retry_scheduled"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class JobSpec(BaseModel):
    """A job to submit. ``payload`` is validated against the model registered for ``kind``.

    ``host`` names the host the job must run on; with ``affinity_timeout_s`` set it is only
    preferred: once the job has been queued that long, any host may claim it (and is told
    to ship the checkpoint from ``host``). ``idempotency_key``: submitting the same key
    again returns the job first submitted with it.
    """

    model_config = ConfigDict(extra="forbid")

    kind: str
    payload: dict[str, Any] = {}
    priority: Int32 = 0
    max_attempts: int = Field(3, ge=1, le=1000)
    max_lease_expiries: int = Field(10, ge=1, le=1000)
    host: str | None = None
    affinity_timeout_s: float | None = Field(None, ge=0)
    parent_id: Int64 | None = None
    group_id: str | None = Field(None, min_length=1, max_length=200)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)
    not_before: AwareDatetime | None = None


class Job(BaseModel):
    """A job as stored. ``lease_*`` describe the current lease while ``state`` is leased,
    the last one afterwards (``lease_expires_at`` is only set while leased)."""

    id: int
    kind: str
    payload: dict[str, Any]
    state: JobState
    priority: int
    attempts: int
    max_attempts: int
    lease_owner: str | None
    lease_host: str | None
    lease_token: int
    lease_expires_at: datetime | None
    lease_expiries: int
    max_lease_expiries: int
    heartbeat_at: datetime | None
    result: Any = None
    error: str | None
    parent_id: int | None
    group_id: str | None
    host: str | None
    affinity_timeout_s: float | None
    shipped_from: str | None
    not_before: datetime | None
    idempotency_key: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class Claim(BaseModel):
    """A lease on a job. ``ship_from`` is set when the job preferred another host: the
    claimer must fetch the job's checkpoint from that host."""

    job: Job
    lease_token: int
    lease_expires_at: datetime
    ship_from: str | None = None


class Host(BaseModel):
    """A worker host; ``ship_url`` is where it serves its checkpoints to other hosts (None: it does not)."""

    name: str
    ship_url: str | None
    seen_at: datetime


class HostRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ship_url: str | None = Field(None, max_length=500)


class Event(BaseModel):
    """One entry of the append-only event log; ``seq`` orders the events of a group."""

    seq: int
    job_id: int
    group_id: str | None
    type: EventType
    at: datetime
    data: dict[str, Any] = {}


class JobPage(BaseModel):
    """A page of ``list``; pass ``next_cursor`` back as ``cursor`` for the next one."""

    jobs: list[Job]
    next_cursor: int | None = None


# -- HTTP request bodies (shared by the API and the client) --------------------------------


class SubmitBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jobs: list[JobSpec] = Field(max_length=1000)


class ClaimRequest(BaseModel):
    """``wait_s``: long-poll up to this long for a job when none is claimable at once."""

    model_config = ConfigDict(extra="forbid")

    worker_id: str = Field(min_length=1, max_length=200)
    host: str = Field(min_length=1, max_length=200)
    kinds: list[str] | None = None
    limit: int = Field(1, ge=1, le=1000)
    lease_s: float = Field(60.0, gt=0, le=7 * 24 * 3600)
    wait_s: float = Field(0.0, ge=0)


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_token: Int64


class HeartbeatRequest(LeaseRequest):
    extend_s: float = Field(60.0, gt=0, le=7 * 24 * 3600)


class CompleteRequest(LeaseRequest):
    result: Any = None


class FailRequest(LeaseRequest):
    error: str
    retry: bool = True
