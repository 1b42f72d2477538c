"""Many worker processes on one database, and a worker killed mid-job."""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from sprout.jobs.payloads import job_kinds
from sprout.runstore import JobState, LeaseLost
from sprout.runstore.store import RunStore

from .workers import drain, hold_lease

pytestmark = pytest.mark.python_only  # needs no podman (pytest -m python_only)

fork = multiprocessing.get_context("fork")


def test_eight_workers_run_each_of_1000_jobs_once(db_url: str) -> None:
    store = RunStore(db_url, job_kinds())
    jobs = store.submit_many([{"kind": "gate", "payload": {"task_dir": f"t{i}"}} for i in range(1000)])
    start, out = fork.Barrier(8), fork.Queue()
    procs = [fork.Process(target=drain, args=(db_url, w, start, out)) for w in range(8)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=10)
        assert p.exitcode == 0
    runs = Counter(job_id for done in results.values() for job_id, _ in done)
    assert len(runs) == 1000 and set(runs) == {j.id for j in jobs}, "a job was lost"
    assert max(runs.values()) == 1, f"jobs run twice: {[j for j, n in runs.items() if n > 1][:10]}"
    assert sum(1 for done in results.values() if done) >= 2, "the workers did not overlap"
    page = store.list(state=JobState.SUCCEEDED, limit=1000)
    assert len(page.jobs) == 1000
    assert all(j.attempts == 1 and j.lease_token == 1 for j in page.jobs)
    store.close()


def test_killed_worker_job_is_re_leased_and_its_late_result_refused(db_url: str) -> None:
    store = RunStore(db_url, job_kinds())
    job = store.submit("gate", {"task_dir": "t"}, max_attempts=3)
    lease_s = 3.0  # a heartbeat every 0.75 s
    out = fork.Queue()
    proc = fork.Process(target=hold_lease, args=(db_url, lease_s, out))
    proc.start()
    try:
        job_id, dead_token = out.get(timeout=20)
        assert job_id == job.id
        first_expiry = store.get(job.id).lease_expires_at
        assert first_expiry is not None
        while datetime.now(UTC) < first_expiry + timedelta(seconds=0.5):
            time.sleep(0.1)
        # past its first expiry, the lease is held: the heartbeats moved it on
        assert store.claim("w2", "h2") == []
        held = store.get(job.id)
        assert held.lease_owner == "doomed" and held.lease_expires_at and held.lease_expires_at > first_expiry
    finally:
        proc.kill()  # SIGKILL, mid-job
        proc.join()
    assert proc.exitcode == -9

    deadline = time.monotonic() + 60  # the last heartbeat's lease runs out, then the job is claimable
    while not (claims := store.claim("w2", "h2", lease_s=30)):
        assert time.monotonic() < deadline, "the dead worker's job was never re-leased"
        time.sleep(0.05)
    (claim,) = claims
    assert claim.job.id == job.id and claim.lease_token == dead_token + 1
    assert claim.job.attempts == 2 and claim.job.lease_expiries == 1
    with pytest.raises(LeaseLost, match="superseded"):
        store.complete(job.id, dead_token, "late result from the dead lease")
    done = store.complete(job.id, claim.lease_token, "ok")
    assert done.state == JobState.SUCCEEDED and done.result == "ok" and done.lease_owner == "w2"
    store.close()
