"""The gate for one task: its reference solution (oracle) must score 1 and doing nothing (nop) 0,
each run in a fresh sandbox of the task's image: the oracle's solve.sh under the agent phase's
network, the final checkpoint taken, then Harbor's verifier run in that same live sandbox (so a
server solve.sh left running is there, as in Harbor). `gate_task` is what `sprout gate` runs per task, in-process or as a
Run Store `gate` job on a worker."""

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from harbor.agents.oracle import OracleAgent
from harbor.models.agent.context import AgentContext
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths
from pydantic import BaseModel

from ..sandbox import Image, SproutError, Store, trust
from .grade import GradeResult, grade_async
from .harbor_env import CommandTimeoutError, SproutEnvironment
from .images import ImageSource, ensure_image
from .loading import task_name
from .network import describe, network_plan
from .pull import PullPolicy

DEFAULT_AGENT_TIMEOUT_S = 900.0  # for tasks without [agent].timeout_sec (Harbor's default: no limit)
# pass: the oracle scored 1 and the nop 0 (in every trial); fail: not, alike in every trial; flaky: the
# trials disagree (`sprout gate --trials K`); error: an attempt could not be made or graded.
GateVerdict = Literal["pass", "fail", "flaky", "error"]


class Attempt(BaseModel):
    """One side of the gate: oracle (solve.sh ran) or nop (nothing ran), then graded."""

    grade: GradeResult | None = None
    agent_note: str | None = None  # the oracle timed out or exited non-zero (it is graded anyway, as in Harbor)
    error: str | None = None  # the attempt could not be made or graded
    agent_network: str | None = None  # the agent phase's network, as enforced
    duration_s: float = 0.0


class TaskGate(BaseModel):
    task: str
    verdict: GateVerdict
    reason: str | None = None
    oracle: Attempt | None = None
    nop: Attempt | None = None
    image: str | None = None
    image_source: ImageSource | None = None  # present, pulled, built (now) or cached (an earlier build)
    image_warning: str | None = None  # e.g. the prebuilt image could not be pulled, its Dockerfile was built
    image_stand_in: bool | None = None  # the image is, or is built on, an offline stand-in base image
    image_s: float = 0.0
    host_trust: bool | None = None  # whether sandboxes and builds got the host's CA bundle and proxy settings
    duration_s: float = 0.0
    log_dir: str
    # With --trials K (oracle and nop are then the first trial's): each trial's rewards, and the share of
    # trials in which the oracle scored 1 and the nop 0. Each trial's own result is <log_dir>/trial-<k>/.
    trials: int = 1
    oracle_rewards: list[float | None] | None = None
    nop_rewards: list[float | None] | None = None
    oracle_pass_rate: float | None = None
    nop_zero_rate: float | None = None


def _task_logger(name: str, path: Path) -> tuple[logging.Logger, logging.Handler]:
    """A logger for one task's gate.log; Harbor's environment and verifier log through its children."""
    logger = logging.getLogger(f"sprout.gate.{name}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    return logger, handler


async def _run_oracle(env: SproutEnvironment, task: Task, paths: TrialPaths, logger: logging.Logger) -> str | None:
    """Harbor's OracleAgent as Trial runs it (as [agent].user, cut off at the agent timeout); a note or None."""
    timeout = task.config.agent.timeout_sec or DEFAULT_AGENT_TIMEOUT_S
    agent = OracleAgent(logs_dir=paths.agent_dir, task_dir=task.task_dir, trial_paths=paths,
                        agent_timeout_sec=timeout, logger=logger)
    try:
        with env.with_default_user(task.config.agent.user):
            await asyncio.wait_for(agent.run(task.instruction, env, AgentContext()), timeout)
    except (asyncio.TimeoutError, CommandTimeoutError):
        return f"solve.sh timed out after {timeout:g}s ([agent].timeout_sec)"
    exit_code = paths.agent_dir / "exit-code.txt"
    return f"solve.sh exited with {exit_code.read_text().strip()}" if exit_code.exists() else None


async def _attempt(store: Store, task: Task, image: Image, kind: str, log_dir: Path, logger: logging.Logger,
                   pull: PullPolicy | None) -> Attempt:
    """A fresh sandbox of the task's image; the oracle runs there (or nothing does); the final
    checkpoint; the verifier in the same live sandbox."""
    started = time.monotonic()
    paths = TrialPaths(log_dir / kind)
    paths.mkdir()
    env = SproutEnvironment.for_task(task, paths, store=store, session_id=f"{task_name(task)}__{kind}",
                                     logger=logger, image=image)
    agent_phase = network_plan(task).agent_phase
    note, checkpoint = None, None
    try:
        await env.start(force_build=False)
        logger.info(f"{kind}: sandbox {env.sandbox.id}")
        await env.run_healthcheck()
        await env.set_network_policy(agent_phase)
        if kind == "oracle":
            note = await _run_oracle(env, task, paths, logger)
            logger.info(f"oracle: {note or 'solve.sh finished'}")
        checkpoint = await asyncio.to_thread(env.sandbox.checkpoint, label=f"gate {task_name(task)} {kind}")
        logger.info(f"{kind}: checkpoint {checkpoint.id}")
        grade = await grade_async(store, env.sandbox, task, trial_dir=paths.trial_dir, logger=logger, pull=pull)
    except Exception as e:  # noqa: BLE001 - reported as this attempt's error, the gate goes on
        logger.exception(f"{kind} attempt failed")
        return Attempt(error=f"{kind}: {' '.join(str(e).split()) or type(e).__name__}",
                       duration_s=time.monotonic() - started)
    finally:
        await env.stop(delete=True)
        if checkpoint is not None:
            await asyncio.to_thread(store.remove_checkpoint, checkpoint.id)
    logger.info(f"{kind}: {grade.verdict} reward={grade.reward} error={grade.error} ({grade.mode})")
    return Attempt(grade=grade, agent_note=note, agent_network=describe(agent_phase),
                   duration_s=time.monotonic() - started)


def _verdict(oracle: Attempt, nop: Attempt) -> tuple[GateVerdict, str | None]:
    for kind, attempt in (("oracle", oracle), ("nop", nop)):
        if attempt.error or attempt.grade is None:
            return "error", attempt.error or f"{kind}: not graded"
        if attempt.grade.error:
            return "error", f"{kind}: {attempt.grade.error}"
    assert oracle.grade is not None and nop.grade is not None  # (each was checked just above)
    reasons = []
    if oracle.grade.reward != 1:
        note = f" ({oracle.agent_note})" if oracle.agent_note else ""
        reasons.append(f"oracle scored {oracle.grade.reward:g}, must be 1{note}")
    if nop.grade.reward != 0:
        reasons.append(f"nop scored {nop.grade.reward:g}, must be 0")
    return ("fail", "; ".join(reasons)) if reasons else ("pass", oracle.agent_note)


async def gate_task(store: Store, task: Task, log_dir: Path, *, rebuild_before: float | None = None,
                    pull: PullPolicy | None = None,
                    on_phase: Callable[[str], None] = lambda phase: None) -> TaskGate:
    """The gate for one task (its image built if needed, then oracle and nop); never raises for the task's faults."""
    started = time.monotonic()
    name = task_name(task)
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    logger, handler = _task_logger(name, log_dir / "gate.log")
    try:
        result = await _gate(store, task, log_dir, logger, rebuild_before, pull, on_phase)
    finally:
        logger.removeHandler(handler)
        handler.close()
    result.duration_s = time.monotonic() - started
    (log_dir / "result.json").write_text(result.model_dump_json(indent=2))
    return result


async def _gate(store: Store, task: Task, log_dir: Path, logger: logging.Logger, rebuild_before: float | None,
                pull: PullPolicy | None, on_phase: Callable[[str], None]) -> TaskGate:
    name = task_name(task)
    on_phase("image")
    try:
        image = await asyncio.to_thread(ensure_image, store, task.paths.environment_dir, task.config.environment,
                                        name=name, rebuild_before=rebuild_before, log_path=log_dir / "build.log",
                                        pull=pull)
    except SproutError as e:
        logger.error(str(e))
        return TaskGate(task=name, verdict="error", reason=str(e), log_dir=str(log_dir))
    logger.info(f"image {image.reference} ({image.source}, {image.seconds:.1f}s)")
    if image.warning:
        logger.warning(f"image: {image.warning}")
    on_phase("oracle")
    oracle = await _attempt(store, task, image.image, "oracle", log_dir, logger, pull)
    on_phase("nop")
    nop = await _attempt(store, task, image.image, "nop", log_dir, logger, pull)
    verdict, reason = _verdict(oracle, nop)
    return TaskGate(task=name, verdict=verdict, reason=reason, oracle=oracle, nop=nop, image=image.reference,
                    image_source=image.source, image_warning=image.warning, image_s=round(image.seconds, 3),
                    image_stand_in=image.stand_in,
                    host_trust=trust.host_trust().enabled, log_dir=str(log_dir))


def _reward(attempt: Attempt | None) -> float | None:
    return attempt.grade.reward if attempt is not None and attempt.grade is not None else None


def combine_trials(trials: list[TaskGate], log_dir: Path) -> TaskGate:
    """One task's verdict over K trials of its gate (each a whole gate: oracle and nop): an error in any
    trial is the task's error; else `pass` or `fail` when every trial says so, `flaky` when they differ
    (the oracle scored 1 in some trials and not in others, or the nop 0 in some and not in others)."""
    first = trials[0]
    oracle = [_reward(t.oracle) for t in trials]
    nop = [_reward(t.nop) for t in trials]
    combined = first.model_copy(update={
        "trials": len(trials), "oracle_rewards": oracle, "nop_rewards": nop, "log_dir": str(log_dir),
        "duration_s": max(t.duration_s for t in trials)})
    if failed := next((t for t in trials if t.verdict == "error"), None):
        return combined.model_copy(update={"verdict": "error", "reason": failed.reason})
    oracle_rate = sum(r == 1 for r in oracle) / len(trials)
    nop_rate = sum(r == 0 for r in nop) / len(trials)
    combined = combined.model_copy(update={"oracle_pass_rate": oracle_rate, "nop_zero_rate": nop_rate})
    if 0 < oracle_rate < 1 or 0 < nop_rate < 1:
        reason = (f"over {len(trials)} trials the oracle scored 1 in {oracle_rate:.0%} and the nop 0 in "
                  f"{nop_rate:.0%}")
        return combined.model_copy(update={"verdict": "flaky", "reason": reason})
    return combined
