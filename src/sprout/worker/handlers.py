"""What a worker does for each job kind, using the sandbox, agent and tasks layers below it.

A handler takes the claim and a stop event (set when the job is cancelled, its lease lost or the
worker drains) and returns the job's JSON result; raising fails the attempt (retried by the store up to
the job's max attempts). Handlers must be safe to run again after a worker died mid-job: a rollout whose
journal already has an outcome returns it instead of running twice, and one whose journal has none
discards that dead attempt (its sandbox and checkpoints) first. Sandboxes a job makes are owned by it,
so what a killed worker leaves is reaped on this host (Store.gc, the next worker start).
"""

import socket
import threading
from pathlib import Path
from typing import Any

from ..agent.journal import Journal, read_journal
from ..agent.runner import RolloutCancelled
from ..errors import SproutError
from ..jobs.endpoints import resolve
from ..jobs.journals import discard
from ..jobs.local import rollout_here
from ..jobs.payloads import (
    GatePayload,
    GradePayload,
    PreparePayload,
    PrepareResult,
    ReviewPayload,
    RolloutOptions,
    RolloutPayload,
    RolloutResult,
    SweGradePayload,
    rollout_request,
)
from ..method.review import Reviewer
from ..runstore.models import Claim
from ..sandbox import Store
from ..sandbox.errors import CheckpointNotFound
from ..tasks import ensure_image, load_task
from ..tasks.grade import grade as grade_checkpoint
from ..tasks.swe_rebench.rollout import GRADE_WALL_S, grade_swe
from ..tasks.swe_rebench.rollout import grade_checkpoint as grade_swe_checkpoint


def store_for(claim: Claim | None = None, backend: str = "container") -> Store:
    """This host's store, its new sandboxes of `backend`; with a claim, what it makes belongs to that job's
    lease until adopted."""
    owner = None if claim is None else {"worker": claim.job.lease_owner, "job": claim.job.id,
                                        "lease": claim.lease_token}
    return Store(owner=owner, backend=backend)


def rollout(claim: Claim, stop: threading.Event) -> dict[str, Any]:
    """A rollout (sprout.jobs.payloads.RolloutPayload): a fresh start in the task's sandbox, a branch, or a
    SWE-rebench V2 instance, graded live at its end when asked (the result then has "grade")."""
    payload = RolloutPayload.model_validate(claim.job.payload)
    options = payload.options
    journal = Path(options.journal)
    store = store_for(claim, options.backend)
    task = load_task(Path(options.task_dir)) if options.task_dir else None
    if journal.exists():
        previous = read_journal(journal)
        if previous.outcome is not None:  # finished by a worker that died before reporting it
            return _finished_rollout(store, previous, options, task, _host(claim))
        discard(store, journal)  # a dead worker's half attempt: its sandbox and checkpoints go with it
    request = rollout_request(payload, resolve(options.endpoint), options.label or f"job-{claim.job.id}")
    done = rollout_here(store, request, task=task, swe=options.swe, grade_wall_s=options.grade_wall_s, stop=stop)
    store.adopt(done.checkpoints)
    return RolloutResult(outcome=done.outcome, journal=str(journal), checkpoints=done.checkpoints, host=_host(claim),
                         grade=done.grade).model_dump(mode="json")


def _finished_rollout(store: Store, previous: Journal, options: RolloutOptions, task, host: str) -> dict[str, Any]:
    """The result of a rollout a dead worker finished but did not report; asked for a grade, its final
    checkpoint is graded in a branch (the live sandbox is gone)."""
    checkpoints = [t.checkpoint for t in previous.turns if t.checkpoint]
    store.adopt(checkpoints)
    assert previous.outcome is not None
    result = RolloutResult(outcome=previous.outcome, journal=options.journal, checkpoints=checkpoints,
                           host=previous.header.host or host)
    final = previous.outcome.final_checkpoint
    wanted = (task is not None and options.grade_trial_dir) or options.swe is not None
    if not wanted or final not in checkpoints:
        return result.model_dump(mode="json")
    try:
        checkpoint = store.checkpoint(final)
    except CheckpointNotFound:  # made on another host: the rollout stands, ungraded
        return result.model_dump(mode="json")
    if options.swe is not None:
        result.grade = grade_swe_checkpoint(store, checkpoint, options.swe,
                                            grade_wall_s=options.grade_wall_s or GRADE_WALL_S)
    else:
        assert task is not None and options.grade_trial_dir is not None  # (wanted, above)
        result.grade = grade_checkpoint(store, checkpoint, task, trial_dir=Path(options.grade_trial_dir))
    return result.model_dump(mode="json")


def _host(claim: Claim) -> str:
    return claim.job.lease_host or socket.gethostname()


def grade(claim: Claim, _stop: threading.Event) -> dict[str, Any]:
    """A grade of a checkpoint in this host's store (sprout.jobs.payloads.GradePayload), in a branch."""
    store = store_for(claim)
    payload = GradePayload.model_validate(claim.job.payload)
    result = grade_checkpoint(store, store.checkpoint(payload.checkpoint_id), load_task(Path(payload.task_dir)),
                              trial_dir=Path(payload.trial_dir) if payload.trial_dir else None)
    return result.model_dump(mode="json")


def swe_grade(claim: Claim, _stop: threading.Event) -> dict[str, Any]:
    """A SWE-rebench V2 grade (sprout.jobs.payloads.SweGradePayload); the result is the whole SweGrade."""
    store = store_for(claim)
    payload = SweGradePayload.model_validate(claim.job.payload)
    source = store.checkpoint(payload.checkpoint_id) if payload.checkpoint_id else payload.diff or ""
    grade = grade_swe(store, payload.swe, source, rule=payload.rule, timeout_s=payload.timeout_s)
    return grade.model_dump(mode="json")


def review(claim: Claim, _stop: threading.Event) -> dict[str, Any]:
    """A review of a failed trajectory (sprout.jobs.payloads.ReviewPayload)."""
    payload = ReviewPayload.model_validate(claim.job.payload)
    record = Reviewer(payload.reviewer, resolve(payload.endpoint)).review(
        payload.input, review_id=payload.review_id, round_number=payload.round, reviewed=payload.reviewed)
    return record.model_dump(mode="json")


def gate(claim: Claim, _stop: threading.Event) -> dict[str, Any]:
    """The gate of one task (sprout.jobs.payloads.GatePayload); its paths on a filesystem this host shares
    with the submitter; the pull policy by default this worker's $SPROUT_PULL_POLICY, else missing."""
    import asyncio
    import tempfile

    from ..tasks.gate import gate_task

    payload = GatePayload.model_validate(claim.job.payload)
    log_dir = Path(payload.log_dir or tempfile.mkdtemp(prefix="sprout-gate-"))
    result = asyncio.run(gate_task(store_for(claim, payload.backend), load_task(Path(payload.task_dir)), log_dir,
                                   rebuild_before=payload.rebuild_before, pull=payload.pull))
    return result.model_dump(mode="json")


def prepare(claim: Claim, stop: threading.Event) -> dict[str, Any]:
    """Each task's image, built, pulled or imported into this host's store (sprout.jobs.payloads.PreparePayload);
    a task that cannot be prepared is listed with its problem and the others go on."""
    payload = PreparePayload.model_validate(claim.job.payload)
    store, result = store_for(claim), PrepareResult(host=_host(claim))
    for task_dir in payload.tasks:
        if stop.is_set():
            raise RolloutCancelled("the prepare job was stopped")
        try:
            task = load_task(Path(task_dir))
            image = ensure_image(store, task.paths.environment_dir, task.config.environment, name=Path(task_dir).name,
                                 pull=payload.pull)
        except SproutError as e:
            result.failed[task_dir] = str(e).splitlines()[0][:500] if str(e) else type(e).__name__
        else:
            result.ready[task_dir] = image.reference
    return result.model_dump(mode="json")


def default_handlers() -> dict[str, Any]:
    return {"rollout": rollout, "grade": grade, "swe-grade": swe_grade, "review": review, "gate": gate,
            "prepare": prepare}
