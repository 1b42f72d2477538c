"""The store's semantics, on a fake clock, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import BaseModel, ValidationError

from sprout.runstore import (
    EventType,
    InvalidPayload,
    InvalidTransition,
    JobNotFound,
    JobState,
    LeaseLost,
    UnknownKind,
)
from sprout.runstore.store import RunStore

from .conftest import FakeClock

pytestmark = pytest.mark.python_only  # needs no podman (pytest -m python_only)

GATE = {"task_dir": "tasks/t1"}


REVIEW = {"reviewer": {"model": "m"}, "endpoint": {"url": "http://127.0.0.1:1/v1"},
          "input": {"instruction": "fix it", "steps": [], "verifier_output": "", "reward": 0.0, "points": 1,
                    "max_calls": 10}, "review_id": "r1", "round": 1, "reviewed": "a1"}


def gate(store: RunStore, **opts: object):
    return store.submit("gate", GATE, **opts)


def claim_one(store: RunStore, host: str = "h1", **kwargs: object):
    claims = store.claim("w1", host, **kwargs)
    assert len(claims) == 1, claims
    return claims[0]


def test_submit_get_and_payload_validation(store: RunStore) -> None:
    options = {"endpoint": {"url": "http://127.0.0.1:1/v1"}, "journal": "j.jsonl"}
    job = store.submit("rollout", {"task": "fix-bug", "model": "m", "turn": 3, "options": options}, priority=5,
                       group_id="g")
    assert job.state == JobState.QUEUED
    assert job.payload["task"] == "fix-bug" and job.payload["turn"] == 3
    assert job.attempts == 0 and job.lease_token == 0 and job.priority == 5
    assert job.created_at.tzinfo is not None
    assert store.get(job.id) == job

    with pytest.raises(
        UnknownKind, match="unknown job kind 'nope'; registered kinds: gate, grade, prepare, review, rollout"
    ):
        store.submit("nope", {})
    with pytest.raises(InvalidPayload, match="invalid payload for kind 'grade': task_dir: Field required"):
        store.submit("grade", {"checkpoint_id": "c1"})
    with pytest.raises(InvalidPayload, match="colour: Extra inputs are not permitted"):
        store.submit("gate", {"task_dir": "x", "colour": "red"})
    with pytest.raises(ValidationError):
        store.submit("gate", GATE, max_attempts=0)
    with pytest.raises(JobNotFound, match="job 999 not found"):
        store.get(999)
    with pytest.raises(JobNotFound, match="parent job 999 not found"):
        store.submit("gate", GATE, parent_id=999)
    assert store.submit("gate", GATE, parent_id=job.id).parent_id == job.id


def test_a_store_accepts_the_kinds_it_is_told(make_store, clock) -> None:
    class LintPayload(BaseModel):
        path: str

    store = make_store(kinds={"lint": LintPayload}, clock=clock)
    with pytest.raises(UnknownKind, match="unknown job kind 'gate'; registered kinds: lint"):
        store.submit("gate", GATE)
    job = store.submit("lint", {"path": "src"})
    assert job.kind == "lint"
    assert claim_one(store, kinds=["lint"]).job.id == job.id
    with pytest.raises(UnknownKind, match="'lnt'"):
        store.claim("w1", "h1", kinds=["lnt"])


def test_list_filters_and_pagination(store: RunStore) -> None:
    jobs = [gate(store, group_id="a" if i % 2 else "b") for i in range(7)]
    store.submit("review", REVIEW, group_id="a")
    page = store.list(limit=3)
    assert [j.id for j in page.jobs] == [j.id for j in jobs[:3]]
    seen = [j.id for j in page.jobs]
    while page.next_cursor is not None:
        page = store.list(limit=3, cursor=page.next_cursor)
        seen += [j.id for j in page.jobs]
    assert len(seen) == 8 and seen == sorted(seen)
    assert len(store.list(group_id="a").jobs) == 4
    assert [j.kind for j in store.list(kind="review").jobs] == ["review"]
    claim_one(store)
    assert [j.id for j in store.list(state="leased").jobs] == [jobs[0].id]
    with pytest.raises(ValueError, match="unknown job state 'running'"):
        store.list(state="running")


def test_idempotent_submit(store: RunStore) -> None:
    first = gate(store, idempotency_key="k1")
    again = store.submit("gate", {"task_dir": "other"}, idempotency_key="k1")
    assert again.id == first.id and again.payload == first.payload
    batch = store.submit_many(
        [
            {"kind": "gate", "payload": GATE, "idempotency_key": "k2"},
            {"kind": "gate", "payload": GATE, "idempotency_key": "k1"},
            {"kind": "gate", "payload": GATE, "idempotency_key": "k2"},
            {"kind": "gate", "payload": GATE},
        ]
    )
    assert batch[1].id == first.id
    assert batch[0].id == batch[2].id != first.id
    assert len(store.list().jobs) == 3


def test_priority_then_age(store: RunStore, clock: FakeClock) -> None:
    low = gate(store, priority=0)
    clock.advance(1)
    high_old = gate(store, priority=10)
    clock.advance(1)
    high_new = gate(store, priority=10)
    mid = gate(store, priority=5)
    order = [c.job.id for c in store.claim("w1", "h1", limit=10)]
    assert order == [high_old.id, high_new.id, mid.id, low.id]


def test_claim_respects_kinds_and_not_before(store: RunStore, clock: FakeClock) -> None:
    later = gate(store, not_before=datetime.fromtimestamp(clock.now + 30, UTC))
    review = store.submit("review", REVIEW)
    assert store.claim("w1", "h1", kinds=["gate"]) == []
    assert claim_one(store, kinds=["review", "grade"]).job.id == review.id
    clock.advance(31)
    assert claim_one(store, kinds=["gate"]).job.id == later.id


def test_lease_lifecycle_and_fencing(store: RunStore, clock: FakeClock) -> None:
    job = gate(store)
    claim = claim_one(store, lease_s=10)
    assert claim.lease_token == 1 and claim.job.state == JobState.LEASED and claim.job.attempts == 1
    assert claim.job.lease_owner == "w1" and claim.job.lease_host == "h1"
    clock.advance(8)
    beat = store.heartbeat(job.id, claim.lease_token, extend_s=10)
    assert beat.lease_expires_at == datetime.fromtimestamp(clock.now + 10, UTC)
    clock.advance(8)  # past the first lease's end, within the extension
    with pytest.raises(LeaseLost, match="job 1 has no lease 2"):
        store.complete(job.id, 2, "forged")
    done = store.complete(job.id, claim.lease_token, {"reward": 1.0})
    assert done.state == JobState.SUCCEEDED and done.result == {"reward": 1.0} and done.finished_at
    assert done.lease_expires_at is None
    # A retried completion of the same lease is answered with the job, anything else is refused.
    assert store.complete(job.id, claim.lease_token, {"reward": 1.0}).id == job.id
    with pytest.raises(LeaseLost, match="is over: the job is succeeded"):
        store.fail(job.id, claim.lease_token, "late")
    with pytest.raises(LeaseLost):
        store.heartbeat(job.id, claim.lease_token)
    with pytest.raises(JobNotFound):
        store.heartbeat(12345, 1)


def test_expired_lease_is_re_leased_and_late_result_refused(store: RunStore, clock: FakeClock) -> None:
    job = gate(store, max_attempts=3)
    first = claim_one(store, lease_s=5)
    clock.advance(6)
    with pytest.raises(LeaseLost, match=r"lease 1 of job \d+ expired at"):
        store.heartbeat(job.id, first.lease_token)
    second = claim_one(store, host="h2")
    assert second.job.id == job.id and second.lease_token == 2
    assert second.job.attempts == 2 and second.job.lease_expiries == 1
    with pytest.raises(LeaseLost, match="lease 1 of job 1 was superseded by lease 2"):
        store.complete(job.id, first.lease_token, "late")
    assert store.complete(job.id, second.lease_token, "ok").result == "ok"


def test_lost_workers_are_counted_apart_from_failed_handlers(store: RunStore, clock: FakeClock) -> None:
    """An expired lease (its worker died) is not a failure of the job's handler: max_attempts counts those,
    max_lease_expiries the workers lost; either one used up fails the job."""
    lost = gate(store, max_attempts=2, max_lease_expiries=3, group_id="g")
    for _ in range(2):
        claim_one(store, lease_s=5)
        clock.advance(6)
    claim = claim_one(store)
    assert store.fail(lost.id, claim.lease_token, "boom").state == JobState.QUEUED  # 1 failure of 2, 3 tries
    clock.advance(60)
    claim_one(store, lease_s=5)
    clock.advance(6)
    assert store.claim("w1", "h1") == []
    failed = store.get(lost.id)
    assert failed.state == JobState.FAILED and failed.finished_at is not None
    assert failed.error == "lease expired 3 times: the workers that took it died or lost the Run Store"
    assert (failed.attempts, failed.lease_expiries, failed.max_lease_expiries) == (4, 3, 3)
    types = [e.type for e in store.events("g")]
    assert types[-2:] == [EventType.LEASE_EXPIRED, EventType.FAILED]

    broken = gate(store, max_attempts=2, max_lease_expiries=5)
    claim_one(store, lease_s=5)
    clock.advance(6)
    for attempt in (1, 2):
        clock.advance(60)
        claim = claim_one(store)
        done = store.fail(broken.id, claim.lease_token, f"boom {attempt}")
    assert (done.state, done.error, done.lease_expiries) == (JobState.FAILED, "boom 2", 1)


def test_fail_retries_with_exponential_backoff(make_store, clock: FakeClock) -> None:
    store = make_store(clock=clock, retry_base_s=10, retry_max_s=25)
    job = gate(store, max_attempts=4)
    backoffs = []
    for attempt in range(1, 4):
        claim = claim_one(store)
        assert claim.job.attempts == attempt
        failed = store.fail(job.id, claim.lease_token, f"boom {attempt}")
        assert failed.state == JobState.QUEUED and failed.error == f"boom {attempt}"
        delay = failed.not_before.timestamp() - clock.now
        backoffs.append(delay)
        clock.advance(delay - 1)
        assert store.claim("w1", "h1") == [], "claimed before its backoff ended"
        clock.advance(1)
    assert backoffs == [10, 20, 25]
    last = claim_one(store)
    final = store.fail(job.id, last.lease_token, "boom 4")
    assert final.state == JobState.FAILED and final.attempts == 4 and final.error == "boom 4"


def test_fail_without_retry_and_release(store: RunStore) -> None:
    job = gate(store)
    claim = claim_one(store)
    released = store.release(job.id, claim.lease_token)
    assert released.state == JobState.QUEUED and released.attempts == 0
    with pytest.raises(LeaseLost):
        store.release(job.id, claim.lease_token)
    claim = claim_one(store)
    assert claim.lease_token == 2 and claim.job.attempts == 1
    failed = store.fail(job.id, claim.lease_token, "fatal", retry=False)
    assert failed.state == JobState.FAILED and failed.finished_at is not None


def test_cancel(store: RunStore) -> None:
    queued, leased, done = gate(store), gate(store), gate(store)
    claims = store.claim("w1", "h1", limit=2)
    assert [c.job.id for c in claims] == [queued.id, leased.id]
    store.complete(queued.id, claims[0].lease_token)
    assert store.cancel(done.id).state == JobState.CANCELLED
    assert store.cancel(done.id).state == JobState.CANCELLED  # again: no-op
    assert store.cancel(leased.id).state == JobState.CANCELLED
    with pytest.raises(LeaseLost, match="the job is cancelled"):
        store.heartbeat(leased.id, claims[1].lease_token)
    with pytest.raises(InvalidTransition, match=f"job {queued.id} already succeeded; it cannot be cancelled"):
        store.cancel(queued.id)
    assert store.claim("w1", "h1") == []
    with pytest.raises(JobNotFound):
        store.cancel(999)


def test_strict_host_affinity(store: RunStore, clock: FakeClock) -> None:
    job = gate(store, host="gpu-1")
    clock.advance(3600)
    assert store.claim("w2", "gpu-2") == []
    claim = claim_one(store, host="gpu-1")
    assert claim.job.id == job.id and claim.ship_from is None and claim.job.shipped_from is None


def test_host_affinity_falls_back_after_timeout(store: RunStore, clock: FakeClock) -> None:
    job = gate(store, host="gpu-1", affinity_timeout_s=60, group_id="g")
    free = gate(store)
    (other,) = store.claim("w2", "gpu-2", limit=5)
    assert other.job.id == free.id
    store.complete(free.id, other.lease_token)
    clock.advance(61)
    claim = claim_one(store, host="gpu-2")
    assert claim.job.id == job.id and claim.ship_from == "gpu-1"
    assert claim.job.shipped_from == "gpu-1" and claim.job.lease_host == "gpu-2"
    leased = [e for e in store.events("g") if e.type == EventType.LEASED]
    assert leased[-1].data["ship_from"] == "gpu-1"
    # Back in the queue, the preferred host gets a new head start.
    store.release(job.id, claim.lease_token)
    assert store.claim("w2", "gpu-2") == []
    again = claim_one(store, host="gpu-1")
    assert again.ship_from is None and again.job.shipped_from is None


def test_preferred_host_claims_within_timeout(store: RunStore) -> None:
    job = gate(store, host="gpu-1", affinity_timeout_s=60)
    assert claim_one(store, host="gpu-1").job.id == job.id


def test_group_events(store: RunStore, clock: FakeClock) -> None:
    a, b = store.submit_many(
        [
            {"kind": "gate", "payload": GATE, "group_id": "g"},
            {"kind": "gate", "payload": GATE, "group_id": "g"},
        ]
    )
    gate(store, group_id="other")
    claims = store.claim("w1", "h1", limit=2, lease_s=5)
    store.complete(a.id, claims[0].lease_token, 1)
    store.fail(b.id, claims[1].lease_token, "flaky")
    clock.advance(10)
    retry = claim_one(store)
    store.cancel(b.id)
    events = store.events("g")
    assert [(e.job_id, e.type) for e in events] == [
        (a.id, EventType.SUBMITTED),
        (b.id, EventType.SUBMITTED),
        (a.id, EventType.LEASED),
        (b.id, EventType.LEASED),
        (a.id, EventType.SUCCEEDED),
        (b.id, EventType.RETRY_SCHEDULED),
        (b.id, EventType.LEASED),
        (b.id, EventType.CANCELLED),
    ]
    assert retry.job.id == b.id
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert events[5].data["error"] == "flaky"
    assert store.events("g", after_seq=events[5].seq) == events[6:]
    assert store.events("g", after_seq=events[0].seq, limit=2) == events[1:3]
    assert all(e.group_id == "g" for e in events)


def test_validation_of_arguments(store: RunStore) -> None:
    with pytest.raises(ValueError, match="limit must be between 1 and 1000"):
        store.claim("w1", "h1", limit=0)
    with pytest.raises(ValueError, match="lease_s must be positive"):
        store.claim("w1", "h1", lease_s=0)
    job = gate(store)
    claim = claim_one(store)
    with pytest.raises(InvalidPayload, match="result is not JSON-serialisable"):
        store.complete(job.id, claim.lease_token, object())
