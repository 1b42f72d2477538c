"""Worker processes for the concurrency tests (started with fork)."""

from __future__ import annotations

import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier

from sprout.jobs.payloads import job_kinds
from sprout.runstore.store import RunStore


def drain(url: str, worker: int, start: Barrier, out: Queue) -> None:
    """Claim and complete jobs until the queue stays empty; report (job_id, lease_token) of each."""
    done: list[tuple[int, int]] = []
    with RunStore(url, job_kinds(), pool_size=2) as store:
        start.wait()
        idle_since = None
        while True:
            claims = store.claim(f"w{worker}", f"host{worker % 3}", limit=1 + worker % 3, lease_s=60)
            if not claims:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > 0.5:
                    break
                time.sleep(0.01)
                continue
            idle_since = None
            for claim in claims:
                store.complete(claim.job.id, claim.lease_token, {"worker": worker})
                done.append((claim.job.id, claim.lease_token))
    out.put((worker, done))


def hold_lease(url: str, lease_s: float, out: Queue) -> None:
    """Claim one job and keep its lease alive with heartbeats until killed."""
    with RunStore(url, job_kinds()) as store:
        (claim,) = store.claim("doomed", "h1", lease_s=lease_s)
        out.put((claim.job.id, claim.lease_token))
        while True:
            time.sleep(lease_s / 4)
            store.heartbeat(claim.job.id, claim.lease_token, extend_s=lease_s)
