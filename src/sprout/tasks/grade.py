"""Grading with Harbor's own Verifier, as a Harbor trial runs it.

Live: in the attempt's own running sandbox, after its final checkpoint was taken (as Harbor runs the
verifier in the agent's container, so servers the agent left running are there; the checkpoint, a
read-only snapshot, stays as it was). Branch: in a throwaway branch of a stored checkpoint (re-grading
later). A task with a separate verifier (`[verifier] environment_mode = "separate"`, DeepSWE) runs its
`[[verifier.collect]]` commands in the agent's sandbox, then `test.sh` in its own container built from
tests/, with the collected artifacts re-created at the same paths; the agent's sandbox is not graded.
"""

import asyncio
import logging
import shutil
import tempfile
import time
from pathlib import Path, PurePath
from typing import Literal

from harbor.constants import MAIN_SERVICE_NAME
from harbor.models.task.config import NetworkPolicy
from harbor.models.task.task import Task
from harbor.models.trial.paths import EnvironmentPaths, TrialPaths
from harbor.trial.artifact_handler import ArtifactHandler
from harbor.verifier.verifier import (
    RewardFileEmptyError,
    RewardFileNotFoundError,
    Verifier,
    VerifierOutputParseError,
)
from pydantic import BaseModel, ValidationError

from ..sandbox import Checkpoint, Sandbox, SproutError, Store
from .harbor_env import SproutEnvironment
from .network import describe, network_plan
from .pull import PullPolicy

MAX_OUTPUT_CHARS = 64_000  # the tail of test-stdout.txt kept in the result (the file keeps all of it)

Verdict = Literal["pass", "fail", "error"]
GradeMode = Literal["live", "branch", "fresh"]  # fresh: a fresh sandbox of the image (SWE-rebench)


class GradeResult(BaseModel):
    reward: float | None  # rewards[decided_by]; None when grading failed
    rewards: dict[str, float]  # everything reward.txt / reward.json held
    verdict: Verdict  # pass: reward >= 1; fail: a lower reward; error: no usable reward
    verifier_output: str  # what test.sh printed (/logs/verifier/test-stdout.txt), tail
    error: str | None
    duration_s: float
    mode: GradeMode = "branch"  # live: in the attempt's own sandbox; branch: in a branch of a checkpoint
    decided_by: str | None = None  # the rewards key that decides pass: "reward", or the only key
    verifier_environment: Literal["shared", "separate"] = "shared"
    network: str | None = None  # the verifier phase's network, as enforced
    touched_test_paths: list[str] | None = None  # test files the graded change touched, when they are known


async def grade_async(store: Store, source: Checkpoint | Sandbox, task: Task, *, trial_dir: Path | None = None,
                      timeout_sec: float | None = None, logger: logging.Logger | None = None,
                      pull: PullPolicy | None = None) -> GradeResult:
    """Runs the task's tests with Harbor's Verifier (as the task's verifier user, cut off after its
    verifier timeout): live in `source` when it is a running sandbox (which stays the caller's), else
    in a branch of the checkpoint `source`, deleted afterwards. `trial_dir` keeps the verifier's
    files (verifier/test-stdout.txt, reward.*, artifacts/); by default a temporary directory."""
    if trial_dir is None:
        with tempfile.TemporaryDirectory(prefix="sprout-grade-") as tmp:
            return await grade_async(store, source, task, trial_dir=Path(tmp), timeout_sec=timeout_sec,
                                     logger=logger, pull=pull)
    started = time.monotonic()
    logger = logger or logging.getLogger("sprout.grade")
    timeout = timeout_sec or task.config.verifier.timeout_sec
    paths = TrialPaths(trial_dir)
    paths.mkdir()
    shutil.rmtree(paths.verifier_dir)  # a reward left from an earlier grade must not count
    paths.verifier_dir.mkdir()
    plan = network_plan(task)
    separate = plan.verifier_env_baseline is not None
    live = isinstance(source, Sandbox)
    env = SproutEnvironment.for_task(task, paths, store=store, session_id=f"{task.short_name}__grade", logger=logger,
                                     pull=pull, sandbox=source if isinstance(source, Sandbox) else None,
                                     checkpoint=None if isinstance(source, Sandbox) else source)
    rewards: dict[str, float] = {}
    error: str | None = None
    try:
        await env.start(force_build=False)
        artifacts = await _collect(env, task, paths, logger)
        if separate:
            rewards = await _verify_separately(store, artifacts, _artifacts_dir(env), task, paths, plan.verifier_phase,
                                               timeout, logger, pull)
        else:
            rewards = await _verify(env, task, paths, plan.verifier_phase, timeout, logger)
    except asyncio.TimeoutError:
        error = f"the verifier timed out after {timeout:g}s ([verifier].timeout_sec); its processes were killed"
    except RewardFileNotFoundError:
        error = "the verifier wrote no reward (/logs/verifier/reward.txt or reward.json)"
    except (RewardFileEmptyError, VerifierOutputParseError, ValidationError) as e:
        error = f"the verifier's reward file is unreadable: {_one_line(e)}"
    except Exception as e:  # noqa: BLE001 - any failure to grade is an error verdict, with its message
        error = f"grading failed: {type(e).__name__}: {_one_line(e)}"
    finally:
        await env.stop(delete=True)
    decided_by = "reward" if "reward" in rewards else (next(iter(rewards)) if len(rewards) == 1 else None)
    if error is None and decided_by is None:
        error = f"the rewards {rewards} have no 'reward' key (with several keys, 'reward' decides)"
    reward = None if error or decided_by is None else float(rewards[decided_by])
    verdict: Verdict = "error" if reward is None else ("pass" if reward >= 1 else "fail")
    output = paths.test_stdout_path.read_text(errors="replace") if paths.test_stdout_path.exists() else ""
    return GradeResult(reward=reward, rewards=rewards, verdict=verdict, verifier_output=output[-MAX_OUTPUT_CHARS:],
                       error=error, duration_s=time.monotonic() - started, mode="live" if live else "branch",
                       decided_by=decided_by, verifier_environment="separate" if separate else "shared",
                       network=describe(plan.verifier_phase))


async def _verify(env: SproutEnvironment, task: Task, paths: TrialPaths, phase: NetworkPolicy, timeout: float,
                  logger: logging.Logger, *, tests_in_image: bool = False) -> dict[str, float]:
    """Harbor's Verifier in `env`, under the verifier phase's network; the rewards it read."""
    verifier_dir = str(EnvironmentPaths.for_os(env.os).verifier_dir)
    try:
        await env.empty_dirs([verifier_dir])  # as a fresh Harbor log mount: only this run's reward counts
        await env.set_network_policy(phase)
        with env.with_default_user(task.config.verifier.user):
            verifier = Verifier(task=task, trial_paths=paths, environment=env, logger=logger,
                                skip_tests_upload=tests_in_image)
            return dict((await asyncio.wait_for(verifier.verify(), timeout)).rewards or {})
    finally:
        if not paths.test_stdout_path.exists():  # timed out or failed before Harbor downloaded it
            try:
                await env.download_file(f"{verifier_dir}/test-stdout.txt", paths.test_stdout_path)
            except (SproutError, OSError):
                pass


async def _collect(env: SproutEnvironment, task: Task, paths: TrialPaths, logger: logging.Logger) -> ArtifactHandler:
    """As a Harbor trial does before verifying: the [[verifier.collect]] commands run in the agent's
    sandbox (best effort), then the task's artifacts (and /logs/artifacts) are downloaded to the trial."""
    artifacts = ArtifactHandler(artifacts=task.config.artifacts, logger=logger)
    artifacts.begin_collection()
    for hook in task.config.verifier.collect:
        result = await env.exec(hook.command, timeout_sec=int(hook.timeout_sec), user=hook.user)
        if result.return_code != 0:  # the verifier judges whatever is there
            logger.warning(f"collect hook {hook.command!r} exited with {result.return_code}: {result.stdout}")
    await artifacts.download_artifacts(env, paths.artifacts_dir, source_artifacts_dir=_artifacts_dir(env),
                                       services={MAIN_SERVICE_NAME})
    return artifacts


async def _verify_separately(store: Store, artifacts: ArtifactHandler, agent_artifacts: PurePath, task: Task,
                             paths: TrialPaths, phase: NetworkPolicy, timeout: float, logger: logging.Logger,
                             pull: PullPolicy | None) -> dict[str, float]:
    """The verifier's own container (tests baked into its image), the collected artifacts re-created
    in it at the paths they came from."""
    verifier_env = SproutEnvironment.for_verifier(task, paths, store=store, logger=logger, pull=pull,
                                                  session_id=f"{task.short_name}__grade-verifier")
    try:
        await verifier_env.start(force_build=False)
        await artifacts.upload_artifacts(verifier_env, paths.artifacts_dir, source_artifacts_dir=agent_artifacts,
                                         target_artifacts_dir=_artifacts_dir(verifier_env))
        return await _verify(verifier_env, task, paths, phase, timeout, logger, tests_in_image=True)
    finally:
        await verifier_env.stop(delete=True)


def _artifacts_dir(env: SproutEnvironment) -> PurePath:
    return EnvironmentPaths.for_os(env.os).artifacts_dir


def grade(store: Store, source: Checkpoint | Sandbox, task: Task, **kwargs) -> GradeResult:
    """grade_async for synchronous callers (not from inside a running event loop)."""
    return asyncio.run(grade_async(store, source, task, **kwargs))


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    cause = error.__cause__
    return f"{text} ({' '.join(str(cause).split())})" if cause and str(cause) else text
