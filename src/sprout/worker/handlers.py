"""What a worker does for each job kind, using the sandbox, agent and tasks layers below it.

A handler takes the claim and a stop event (set when the job is cancelled, its lease lost or the
worker drains) and returns the job's JSON result; raising fails the attempt (retried by the store up to
the job's max attempts). Handlers must be safe to run again after a worker died mid-job: a rollout whose
journal already has an outcome returns it instead of running twice, and one whose journal has none
discards that dead attempt (its sandbox and checkpoints) first. Sandboxes a job makes are owned by it,
so what a killed worker leaves is reaped on this host (Store.gc, the next worker start).
"""

import os
import socket
import threading
from pathlib import Path
from typing import Any

from ..agent import defaults
from ..runstore.models import Claim
from .jobs import GatePayload, GradePayload, ReviewPayload, RolloutOptions, RolloutPayload, SweGradePayload


def store_from_env(claim: Claim | None = None, backend: str = "container"):
    """This host's store ($SPROUT_STORE, else the default), its commands run by $SPROUT_RUNTIME_BIN,
    its new sandboxes of `backend`; with a claim, what it makes belongs to that job's lease until adopted."""
    from ..sandbox import Store

    runtime = os.environ.get("SPROUT_RUNTIME_BIN")
    owner = None if claim is None else {"worker": claim.job.lease_owner, "job": claim.job.id,
                                        "lease": claim.lease_token}
    return Store(runtime_bin=Path(runtime) if runtime else None, owner=owner, backend=backend)


def rollout(claim: Claim, stop: threading.Event) -> dict[str, Any]:
    """A rollout (sprout.worker.jobs.RolloutPayload): a fresh start in the task's sandbox or a branch,
    graded live at its end when the options name a trial directory (the result then has "grade")."""
    from ..agent.journal import read_journal
    from ..agent.runner import RolloutCancelled, run_rollout
    from ..method.backend import LiveGrader
    from ..method.executor import discard
    from ..tasks import load_task, start_task_sandbox

    payload = RolloutPayload.model_validate(claim.job.payload)
    options = payload.options
    journal = Path(options.journal)
    store = store_from_env(claim, options.backend)
    task = load_task(Path(options.task_dir)) if options.task_dir else None
    if journal.exists():
        previous = read_journal(journal)
        if previous.outcome is not None:  # finished by a worker that died before reporting it
            return _finished_rollout(store, previous, options, task, _host(claim))
        discard(store, journal)  # a dead worker's half attempt: its sandbox and checkpoints go with it
    spec = rollout_spec(payload, _endpoint(options.endpoint))
    if options.swe is not None:
        return _swe_rollout(claim, store, spec, options, stop)
    sandbox, grader = None, None
    if spec.from_journal is None and task is not None:
        sandbox = start_task_sandbox(store, task, options.label or f"job-{claim.job.id}")
    if task is not None and options.grade_trial_dir:
        grader = LiveGrader(store, task, Path(options.grade_trial_dir))
    try:
        result = run_rollout(spec, store, sandbox=sandbox, stop=stop, on_finish=grader)
    except RolloutCancelled:
        discard(store, journal)
        raise
    store.adopt(result.checkpoints)
    done = _rollout_result(result.outcome, journal, result.checkpoints, _host(claim))
    if grader is not None and grader.result is not None:
        done["grade"] = grader.result.model_dump(mode="json")
    return done


def _swe_rollout(claim: Claim, store, spec, options: RolloutOptions, stop: threading.Event) -> dict[str, Any]:
    """A rollout on a SWE-rebench V2 instance, graded at its end as the official harness grades it."""
    from .swe import GRADE_WALL_S, run_swe_rollout

    result, grade = run_swe_rollout(store, spec, options.swe, grade_wall_s=options.grade_wall_s or GRADE_WALL_S,
                                    label=options.label or f"job-{claim.job.id}", stop=stop)
    store.adopt(result.checkpoints)
    done = _rollout_result(result.outcome, spec.journal, result.checkpoints, _host(claim))
    if grade is not None:
        done["grade"] = grade.model_dump(mode="json")
    return done


def rollout_spec(payload: RolloutPayload, endpoint):
    """The rollout a payload describes (sprout.worker.remote.rollout_payload is the inverse), with the
    endpoint this worker resolved; a deadline becomes the wall time left."""
    from ..agent.runner import RolloutSpec

    options = payload.options
    limits = {k: v for k, v in options.model_dump(include={"model_class", "step_limit", "token_limit",
                                                          "wall_time_s", "command_timeout_s"}).items() if v is not None}
    if options.deadline_unix is not None:
        limits["wall_time_s"] = _seconds_until(options.deadline_unix)
    return RolloutSpec(task=payload.task, model=payload.model or "default", endpoint=endpoint,
                       journal=Path(options.journal), image=payload.image or defaults.IMAGE, cwd=options.cwd,
                       from_journal=Path(options.from_journal) if options.from_journal else None,
                       from_turn=payload.turn, note=payload.note, insert=payload.insert, sampling=options.sampling,
                       **limits)


def _seconds_until(deadline_unix: float) -> int:
    import math
    import time

    from ..errors import SproutError

    left = deadline_unix - time.time()
    if left < 1:
        raise SproutError("the rollout's deadline passed before it started")
    return math.ceil(left)


def _finished_rollout(store, previous, options: RolloutOptions, task, host: str) -> dict[str, Any]:
    """The result of a rollout a dead worker finished but did not report; asked for a grade, its final
    checkpoint is graded in a branch (the live sandbox is gone)."""
    from ..sandbox.errors import CheckpointNotFound
    from ..tasks import grade as grade_checkpoint

    checkpoints = [t.checkpoint for t in previous.turns if t.checkpoint]
    store.adopt(checkpoints)
    done = _rollout_result(previous.outcome, Path(options.journal), checkpoints, previous.header.host or host)
    final = previous.outcome.final_checkpoint
    wanted = (task is not None and options.grade_trial_dir) or options.swe is not None
    if not wanted or final not in checkpoints:
        return done
    try:
        checkpoint = store.checkpoint(final)
    except CheckpointNotFound:  # made on another host: the rollout stands, ungraded
        return done
    if options.swe is not None:
        from .swe import GRADE_WALL_S
        from .swe import grade_checkpoint as grade_swe

        grade = grade_swe(store, checkpoint, options.swe, grade_wall_s=options.grade_wall_s or GRADE_WALL_S)
    else:
        grade = grade_checkpoint(store, checkpoint, task, trial_dir=Path(options.grade_trial_dir))
    done["grade"] = grade.model_dump(mode="json")
    return done


def _endpoint(ref: Any):
    """The model endpoint a job names: one configured on this worker (its URL and key from this
    worker's $SPROUT_ENDPOINTS), or a plain URL called with no key (sprout.runstore.endpoints)."""
    from ..runstore.endpoints import resolve

    return resolve(ref)


def _host(claim: Claim) -> str:
    return claim.job.lease_host or socket.gethostname()


def _rollout_result(outcome: Any, journal: Path, checkpoints: list[str], host: str) -> dict[str, Any]:
    """`host`: where the checkpoints are (the worker that made them, not one that reports them later)."""
    return {"outcome": outcome.model_dump(mode="json"), "journal": str(journal), "checkpoints": checkpoints,
            "host": host}


def grade(claim: Claim, _stop: threading.Event) -> dict[str, Any]:
    """A grade of a checkpoint in this host's store (sprout.worker.jobs.GradePayload), in a branch."""
    from ..tasks import grade as grade_checkpoint
    from ..tasks import load_task

    store = store_from_env(claim)
    payload = GradePayload.model_validate(claim.job.payload)
    result = grade_checkpoint(store, store.checkpoint(payload.checkpoint_id), load_task(Path(payload.task_dir)),
                              trial_dir=Path(payload.trial_dir) if payload.trial_dir else None)
    return result.model_dump(mode="json")


def swe_grade(claim: Claim, _stop: threading.Event) -> dict[str, Any]:
    """A SWE-rebench V2 grade (sprout.worker.jobs.SweGradePayload); the result is the whole SweGrade."""
    from .swe import grade_swe

    store = store_from_env(claim)
    payload = SweGradePayload.model_validate(claim.job.payload)
    source = store.checkpoint(payload.checkpoint_id) if payload.checkpoint_id else payload.diff
    grade = grade_swe(store, payload.swe, source, rule=payload.rule, timeout_s=payload.timeout_s)
    return grade.model_dump(mode="json")


def review(claim: Claim, _stop: threading.Event) -> dict[str, Any]:
    """A review of a failed trajectory (sprout.worker.jobs.ReviewPayload)."""
    from pydantic import TypeAdapter

    from ..method.review import ReviewerConfig, ReviewInput
    from ..method.review import review as run_review

    payload = ReviewPayload.model_validate(claim.job.payload)
    reviewer = payload.reviewer
    config = ReviewerConfig(endpoint=_endpoint(reviewer.endpoint), **reviewer.model_dump(exclude={"endpoint"}))
    record = run_review(config, TypeAdapter(ReviewInput).validate_python(payload.input), review_id=payload.review_id,
                        round_number=payload.round, reviewed=payload.reviewed)
    return record.model_dump(mode="json")


def gate(claim: Claim, _stop: threading.Event) -> dict[str, Any]:
    """The gate of one task (sprout.worker.jobs.GatePayload); its paths on a filesystem this host shares
    with the submitter; the pull policy by default this worker's $SPROUT_PULL_POLICY, else missing."""
    import asyncio
    import tempfile

    from ..tasks import load_task
    from ..tasks.gate import gate_task

    payload = GatePayload.model_validate(claim.job.payload)
    log_dir = Path(payload.log_dir or tempfile.mkdtemp(prefix="sprout-gate-"))
    result = asyncio.run(gate_task(store_from_env(claim, payload.backend), load_task(Path(payload.task_dir)), log_dir,
                                   rebuild_before=payload.rebuild_before, pull=payload.pull))
    return result.model_dump(mode="json")


def default_handlers() -> dict[str, Any]:
    return {"rollout": rollout, "grade": grade, "swe-grade": swe_grade, "review": review, "gate": gate}
