"""Running evaluation work as Run Store jobs when a Run Store is configured, in-process otherwise.

`services env` exports SPROUT_RUNSTORE_URL and SPROUT_RUNSTORE_TOKEN; with both set, gate and
evaluation submit their work as jobs (kinds gate, rollout, grade, review) and wait for the results,
which workers compute with the same code the in-process path runs, so both give the same summary.
Paths in payloads must be visible to the workers (same host, or a shared filesystem).
"""

import os
import time
from typing import Any

from ..sandbox.errors import SproutError

TERMINAL = ("succeeded", "failed", "cancelled")


def configured_client():
    """A Run Store client from the environment, or None when no Run Store is configured."""
    if not (os.environ.get("SPROUT_RUNSTORE_URL") and os.environ.get("SPROUT_RUNSTORE_TOKEN")):
        return None
    from ..runstore.client import RunStoreClient

    return RunStoreClient.from_env()


def run_job(client, kind: str, payload: dict[str, Any], *, group_id: str, poll_s: float = 0.5,
            timeout_s: float | None = None) -> Any:
    """Submits one job and waits for its result; a failed or cancelled job raises SproutError."""
    job = client.submit(kind, payload, group_id=group_id)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while job.state not in TERMINAL:
        if deadline is not None and time.monotonic() > deadline:
            raise SproutError(f"{kind} job {job.id} did not finish in {timeout_s:g}s (state {job.state})")
        time.sleep(poll_s)
        job = client.get(job.id)
    if job.state != "succeeded":
        error = (job.error or "").strip().splitlines()
        raise SproutError(f"{kind} job {job.id} {job.state}: {error[0] if error else 'no error recorded'}")
    return job.result
