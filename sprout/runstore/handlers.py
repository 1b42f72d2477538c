"""What a worker does for each job kind, using the sandbox, agent and tasks layers below it.

A handler takes the claim and returns the job's JSON result; raising fails the attempt (retried by
the store up to the job's max attempts). Handlers must be safe to run again after a worker died
mid-job: a rollout whose journal already has an outcome returns it instead of running twice.
"""

import os
import socket
from pathlib import Path
from typing import Any

from .models import Claim

DEFAULT_IMAGE = "docker.io/library/python:3.11-slim"


def store_from_env():
    """This host's store ($SPROUT_STORE, else the default), its commands run by $SPROUT_RUNTIME_BIN."""
    from ..sandbox import Store

    runtime = os.environ.get("SPROUT_RUNTIME_BIN")
    return Store(runtime_bin=Path(runtime) if runtime else None)


def rollout(claim: Claim) -> dict[str, Any]:
    """payload: task, image, model, turn, note; options: endpoint, key_env, journal, cwd, from_journal,
    task_dir (a fresh start in the task's sandbox, as Harbor starts it), label, step_limit, token_limit,
    wall_time_s, command_timeout_s, model_class."""
    from ..agent.journal import read_journal
    from ..agent.runner import RolloutSpec, run_rollout
    from ..tasks import load_task, start_task_sandbox

    payload, options = claim.job.payload, claim.job.payload.get("options", {})
    journal = Path(options["journal"])
    if journal.exists():
        previous = read_journal(journal)
        if previous.outcome is not None:
            return _rollout_result(claim, previous.outcome.model_dump(mode="json"), journal,
                                   [t.checkpoint for t in previous.turns])
        journal.rename(journal.with_suffix(f".crashed-{claim.lease_token}.jsonl"))  # a dead worker's attempt
    endpoint = _endpoint(options["endpoint"], options.get("key_env"))
    spec = RolloutSpec(task=payload["task"], model=payload["model"], endpoint=endpoint, journal=journal,
                       image=payload.get("image") or DEFAULT_IMAGE, cwd=options.get("cwd", "/tmp"),
                       from_journal=Path(options["from_journal"]) if options.get("from_journal") else None,
                       from_turn=payload.get("turn"), note=payload.get("note"),
                       **{k: options[k] for k in ("model_class", "step_limit", "token_limit", "wall_time_s",
                                                  "command_timeout_s") if k in options})
    store = store_from_env()
    sandbox = None
    if spec.from_journal is None and options.get("task_dir"):
        task = load_task(Path(options["task_dir"]))
        sandbox = start_task_sandbox(store, task, options.get("label") or f"job-{claim.job.id}")
    result = run_rollout(spec, store, sandbox=sandbox)
    return _rollout_result(claim, result.outcome.model_dump(mode="json"), journal, result.checkpoints)


def _endpoint(url: str, key_env: str | None):
    """The model endpoint a job names; its key comes from this worker's environment."""
    from ..agent.models import Endpoint
    from ..sandbox.errors import SproutError

    try:
        return Endpoint.resolve(url, key_env or os.environ.get("SPROUT_MODEL_KEY_ENV", "OPENAI_API_KEY"))
    except SproutError as e:
        raise SproutError(f"on this worker: {e}") from None


def _host(claim: Claim) -> str:
    return claim.job.lease_host or socket.gethostname()


def _rollout_result(claim: Claim, outcome: dict, journal: Path, checkpoints: list) -> dict[str, Any]:
    return {"outcome": outcome, "journal": str(journal), "checkpoints": checkpoints, "host": _host(claim)}


def grade(claim: Claim) -> dict[str, Any]:
    """payload: checkpoint_id, task_dir, trial_dir (where the verifier's files go; default: a temporary
    directory); the checkpoint must be in this host's store."""
    from ..tasks import grade as grade_checkpoint
    from ..tasks import load_task

    store = store_from_env()
    payload = claim.job.payload
    trial_dir = Path(payload["trial_dir"]) if payload.get("trial_dir") else None
    result = grade_checkpoint(store, store.checkpoint(payload["checkpoint_id"]), load_task(Path(payload["task_dir"])),
                              trial_dir=trial_dir)
    return result.model_dump(mode="json")


def review(claim: Claim) -> dict[str, Any]:
    """payload: reviewer (ReviewerConfig), input (ReviewInput), review_id, round, reviewed."""
    from pydantic import TypeAdapter

    from ..method.review import ReviewerConfig, ReviewInput
    from ..method.review import review as run_review

    payload = claim.job.payload
    config = TypeAdapter(ReviewerConfig).validate_python(payload["reviewer"])
    config.endpoint = _endpoint(config.endpoint.url, config.endpoint.key_env)
    record = run_review(config, TypeAdapter(ReviewInput).validate_python(payload["input"]),
                        review_id=payload["review_id"], round_number=payload["round"], reviewed=payload["reviewed"])
    return record.model_dump(mode="json")


def gate(claim: Claim) -> dict[str, Any]:
    """payload: task_dir, log_dir (both on a filesystem this host shares with the submitter)."""
    import asyncio
    import tempfile

    from ..tasks import load_task
    from ..tasks.gate import gate_task

    payload = claim.job.payload
    log_dir = Path(payload.get("log_dir") or tempfile.mkdtemp(prefix="sprout-gate-"))
    result = asyncio.run(gate_task(store_from_env(), load_task(Path(payload["task_dir"])), log_dir,
                                   rebuild_before=payload.get("rebuild_before")))
    return result.model_dump(mode="json")


def default_handlers() -> dict[str, Any]:
    return {"rollout": rollout, "grade": grade, "review": review, "gate": gate}
