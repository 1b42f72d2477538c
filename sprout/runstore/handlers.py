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


def _store():
    from ..sandbox import Store

    runtime = os.environ.get("SPROUT_RUNTIME_BIN")
    return Store(runtime_bin=Path(runtime) if runtime else None)


def rollout(claim: Claim) -> dict[str, Any]:
    """payload: task, image, model, turn, note; options: endpoint, key_env, journal, cwd, from_journal,
    step_limit, token_limit, wall_time_s, command_timeout_s, model_class."""
    from ..agent.journal import read_journal
    from ..agent.models import Endpoint
    from ..agent.runner import RolloutSpec, run_rollout

    payload, options = claim.job.payload, claim.job.payload.get("options", {})
    journal = Path(options["journal"])
    if journal.exists():
        previous = read_journal(journal)
        if previous.outcome is not None:
            return _rollout_result(previous.outcome.model_dump(mode="json"), journal, [t.checkpoint for t in previous.turns])
        journal.rename(journal.with_suffix(f".crashed-{claim.lease_token}.jsonl"))  # a dead worker's attempt
    key_env = options.get("key_env") or os.environ.get("SPROUT_MODEL_KEY_ENV", "OPENAI_API_KEY")
    spec = RolloutSpec(task=payload["task"], model=payload["model"], endpoint=Endpoint(options["endpoint"], key_env),
                       journal=journal, image=payload.get("image") or DEFAULT_IMAGE, cwd=options.get("cwd", "/tmp"),
                       from_journal=Path(options["from_journal"]) if options.get("from_journal") else None,
                       from_turn=payload.get("turn"), note=payload.get("note"),
                       **{k: options[k] for k in ("model_class", "step_limit", "token_limit", "wall_time_s",
                                                  "command_timeout_s") if k in options})
    result = run_rollout(spec, _store())
    return _rollout_result(result.outcome.model_dump(mode="json"), journal, result.checkpoints)


def _rollout_result(outcome: dict, journal: Path, checkpoints: list) -> dict[str, Any]:
    return {"outcome": outcome, "journal": str(journal), "checkpoints": checkpoints, "host": socket.gethostname()}


def grade(claim: Claim) -> dict[str, Any]:
    """payload: checkpoint_id, task_dir; the checkpoint must be in this host's store."""
    from ..tasks import grade as grade_checkpoint
    from ..tasks import load_task

    store = _store()
    payload = claim.job.payload
    result = grade_checkpoint(store, store.checkpoint(payload["checkpoint_id"]), load_task(Path(payload["task_dir"])))
    return result.model_dump(mode="json")


def gate(claim: Claim) -> dict[str, Any]:
    """payload: task_dir, log_dir (both on a filesystem this host shares with the submitter)."""
    import asyncio
    import tempfile

    from ..tasks import load_task
    from ..tasks.gate import gate_task

    payload = claim.job.payload
    log_dir = Path(payload.get("log_dir") or tempfile.mkdtemp(prefix="sprout-gate-"))
    result = asyncio.run(gate_task(_store(), load_task(Path(payload["task_dir"])), log_dir,
                                   rebuild_before=payload.get("rebuild_before")))
    return result.model_dump(mode="json")


def default_handlers() -> dict[str, Any]:
    return {"rollout": rollout, "grade": grade, "gate": gate}
