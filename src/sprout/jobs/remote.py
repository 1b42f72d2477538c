"""Work as Run Store jobs, when a Run Store is configured (else it runs here: sprout.jobs.local).

`services env` exports SPROUT_RUNSTORE_URL and SPROUT_RUNSTORE_TOKEN; with both set, gate and
evaluation submit their work as jobs (kinds gate, rollout, grade, review) and wait for the results,
which workers compute with the same functions the in-process path calls, so both give the same
summary. A job names the model endpoint (sprout.jobs.endpoints): `--model-endpoint-name` (default
"default") is one configured on the workers, with their key; a plain `--model-endpoint URL` is called
with no key. A branch or a grade prefers the host that holds its checkpoint; once it has waited
`affinity_timeout_s` there, any worker may take it and ships the checkpoint first. Paths in payloads
(task directories, journals, verifier files) must be visible to the workers: same host, or a shared
filesystem.
"""

import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from ..agent.journal import read_journal
from ..agent.runner import RolloutCancelled, TurnEvent
from ..errors import SproutError
from ..method.records import ReviewRecord
from ..method.review import Reviewer, ReviewInput
from ..runstore.errors import RunStoreError
from ..runstore.kinds import Payload
from ..runstore.models import Job
from ..sandbox import backends
from ..settings import settings
from ..tasks import GradeResult
from .endpoints import endpoint_ref
from .group_events import group_events
from .local import RolloutDone, RolloutRequest
from .payloads import (
    GradePayload,
    ReviewPayload,
    RolloutResult,
    kind_of,
    rollout_payload,
)

TERMINAL = ("succeeded", "failed", "cancelled")
WAIT_S = 1.0  # one long-poll of a job's group events: a stop is acted on within this


def configured_client():
    """A Run Store client from the environment, or None when no Run Store is configured."""
    config = settings()
    if not (config.runstore_url and config.runstore_token):
        return None
    from ..runstore.client import RunStoreClient

    return RunStoreClient.from_env()


def run_job(client, payload: Payload, *, group_id: str, timeout_s: float | None = None,
            on_poll: Callable[[], None] | None = None, stop: threading.Event | None = None, **opts: Any) -> Any:
    """Submits one job (`opts`: JobSpec fields such as host) and waits for its result (wait_job)."""
    return wait_job(client, submit_job(client, payload, group_id=group_id, **opts), timeout_s=timeout_s,
                    on_poll=on_poll, stop=stop)


def submit_job(client, payload: Payload, *, group_id: str, **opts: Any) -> Job:
    """Submits `payload` as a job of its kind, with the configured tries (SPROUT_JOB_TRIES,
    SPROUT_JOB_WORKER_LOSSES); a refusal (an invalid payload, an unknown endpoint) is one SproutError."""
    kind = kind_of(payload)
    config = settings()
    opts = {"max_attempts": config.job_tries, "max_lease_expiries": config.job_worker_losses, **opts}
    try:
        return client.submit(kind, payload.model_dump(mode="json"), group_id=group_id, **opts)
    except RunStoreError as e:
        raise SproutError(f"the Run Store at {client.url} refused a {kind} job: {e}") from None


class JobDetached(SproutError):
    """The waiter stopped waiting (`detach`), the job left to run."""


class JobLost(SproutError):
    """The job failed because the workers that took it kept dying (its leases expired), not because its
    handler did: infrastructure lost the work, which a resume runs again."""


def wait_job(client, job: Job, *, wait_s: float = WAIT_S, timeout_s: float | None = None,
             on_poll: Callable[[], None] | None = None, stop: threading.Event | None = None,
             detach: threading.Event | None = None) -> Any:
    """Waits for a submitted job's result, following its group's events (sprout.jobs.group_events: the
    job is read again when one is about it); a failed or cancelled job raises SproutError. Interrupted,
    or once `stop` is set (then raising RolloutCancelled, within `wait_s`), it cancels the job: the
    worker's next heartbeat stops its handler. Once `detach` is set it raises JobDetached and leaves the
    job running. `on_poll` is called after every wait (at most `wait_s` apart)."""
    stop = stop or threading.Event()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        with group_events(client, job.group_id, wait_s) if job.group_id else nullcontext() as events:
            seen = 0  # the seq of the latest event about the job that has been acted on
            while job.state not in TERMINAL:
                if deadline is not None and time.monotonic() > deadline:
                    raise SproutError(f"{job.kind} job {job.id} did not finish in {timeout_s:g}s (state {job.state})")
                if stop.is_set():
                    raise RolloutCancelled(f"{job.kind} job {job.id} was stopped")
                if detach is not None and detach.is_set():
                    raise JobDetached(f"stopped waiting for {job.kind} job {job.id}; it runs on")
                try:
                    if events is None:  # no group's events to follow: the job is read after every wait
                        stop.wait(wait_s)
                        job = client.get(job.id)
                    elif (latest := events.wait(job.id, seen, wait_s)) > seen:  # an event about the job
                        seen, job = latest, client.get(job.id)
                except RunStoreError as e:
                    raise SproutError(f"lost the Run Store at {client.url} while waiting for {job.kind} job "
                                      f"{job.id}: {e}") from None
                if on_poll is not None:
                    on_poll()
    except JobDetached:
        raise
    except BaseException:
        if job.state not in TERMINAL:
            try:
                client.cancel(job.id)
            except Exception:  # the job may have just finished, or the API is gone
                pass
        raise
    if job.state != "succeeded":
        error = (job.error or "").strip().splitlines()
        if job.state == "failed" and job.lease_expiries >= job.max_lease_expiries:
            raise JobLost(f"{job.kind} job {job.id} was lost to infrastructure: {error[0] if error else ''}")
        raise SproutError(f"{job.kind} job {job.id} {job.state}: {error[0] if error else 'no error recorded'}")
    return job.result


class RunStoreJobs:
    """An evaluation's rollouts, grades and reviews as Run Store jobs (a worker's handlers run them)."""

    def __init__(self, client, *, task_dir: Path, group_id: str, affinity_timeout_s: float = 60.0,
                 backend: str = backends.DEFAULT):
        self.client, self.task_dir, self.group_id, self.backend = client, task_dir.resolve(), group_id, backend
        self.affinity_timeout_s = affinity_timeout_s

    def _affinity(self, host: str | None) -> dict[str, Any]:
        return {"host": host, "affinity_timeout_s": self.affinity_timeout_s} if host else {}

    def rollout(self, request: RolloutRequest, on_turn: Callable[[TurnEvent], None] | None,
                stop: threading.Event | None = None) -> RolloutDone:
        journal = request.spec.journal.resolve()
        follow = _TurnFollower(journal, on_turn) if on_turn else None
        payload = rollout_payload(request, self.task_dir, backend=self.backend)
        result = run_job(self.client, payload, group_id=self.group_id,
                         on_poll=follow, stop=stop, **self._affinity(request.host))
        if follow is not None:
            follow()
        return RolloutResult.model_validate(result).done()

    def grade(self, checkpoint: str, host: str | None, trial_dir: Path) -> GradeResult:
        payload = GradePayload(checkpoint_id=checkpoint, task_dir=str(self.task_dir), trial_dir=str(trial_dir.resolve()))
        result = run_job(self.client, payload, group_id=self.group_id, **self._affinity(host))
        return GradeResult.model_validate(result)

    def review(self, reviewer: Reviewer, inp: ReviewInput, *, review_id: str, round_number: int,
               reviewed: str) -> ReviewRecord:
        payload = ReviewPayload(reviewer=reviewer.config, endpoint=endpoint_ref(reviewer.endpoint), input=inp,
                                review_id=review_id, round=round_number, reviewed=reviewed)
        return ReviewRecord.model_validate(run_job(self.client, payload, group_id=self.group_id))


class _TurnFollower:
    """Calls `on_turn` for each turn a worker has added to a journal since the last call."""

    def __init__(self, journal: Path, on_turn: Callable[[TurnEvent], None]):
        self.journal, self.on_turn, self.seen, self.tokens = journal, on_turn, 0, 0

    def __call__(self) -> None:
        try:
            turns = read_journal(self.journal).turns if self.journal.exists() else []
        except SproutError:  # a line being written
            return
        for turn in turns[self.seen:]:
            self.tokens += turn.tokens_in + turn.tokens_out
            self.on_turn(TurnEvent(turn, self.tokens))
        self.seen = max(self.seen, len(turns))
