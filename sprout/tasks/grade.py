"""Grading a checkpoint: Harbor's own Verifier in a throwaway branch, so the graded state never changes."""

import asyncio
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Literal

from harbor.models.task.task import Task
from harbor.models.trial.paths import EnvironmentPaths, TrialPaths
from harbor.verifier.verifier import (RewardFileEmptyError, RewardFileNotFoundError, Verifier,
                                      VerifierOutputParseError)
from pydantic import BaseModel, ValidationError

from ..sandbox import Checkpoint, SproutError, Store
from .harbor_env import SproutEnvironment

MAX_OUTPUT_CHARS = 64_000  # the tail of test-stdout.txt kept in the result (the file keeps all of it)

Verdict = Literal["pass", "fail", "error"]


class GradeResult(BaseModel):
    reward: float | None  # rewards["reward"] (or the only value); None when grading failed
    rewards: dict[str, float]
    verdict: Verdict  # pass: reward >= 1; fail: a lower reward; error: no usable reward
    verifier_output: str  # what test.sh printed (/logs/verifier/test-stdout.txt), tail
    error: str | None
    duration_s: float


async def grade_async(store: Store, checkpoint: Checkpoint, task: Task, *, trial_dir: Path | None = None,
                      timeout_sec: float | None = None, logger: logging.Logger | None = None) -> GradeResult:
    """Branches `checkpoint`, runs the task's tests there with Harbor's Verifier (as the task's verifier
    user, cut off after its verifier timeout), then deletes the branch. `trial_dir` keeps the
    verifier's files (verifier/test-stdout.txt, reward.*); by default they go to a temporary dir."""
    if trial_dir is None:
        with tempfile.TemporaryDirectory(prefix="sprout-grade-") as tmp:
            return await grade_async(store, checkpoint, task, trial_dir=Path(tmp), timeout_sec=timeout_sec,
                                     logger=logger)
    started = time.monotonic()
    timeout = timeout_sec or task.config.verifier.timeout_sec
    paths = TrialPaths(trial_dir)
    paths.mkdir()
    shutil.rmtree(paths.verifier_dir)  # a reward left from an earlier grade must not count
    paths.verifier_dir.mkdir()
    rewards: dict[str, float] = {}
    error: str | None = None
    env = SproutEnvironment.for_task(task, paths, store=store, checkpoint=checkpoint,
                                     session_id=f"{task.short_name}__grade", logger=logger)
    try:
        await env.start(force_build=False)
        verifier_dir = str(EnvironmentPaths.for_os(env.os).verifier_dir)
        await env.empty_dirs([verifier_dir])  # as a fresh Harbor log mount: only this run's reward counts
        with env.with_default_user(task.config.verifier.user):
            verifier = Verifier(task=task, trial_paths=paths, environment=env, logger=logger)
            rewards = dict((await asyncio.wait_for(verifier.verify(), timeout)).rewards or {})
    except asyncio.TimeoutError:
        error = f"the verifier timed out after {timeout:g}s ([verifier].timeout_sec); its processes were killed"
    except RewardFileNotFoundError:
        error = "the verifier wrote no reward (/logs/verifier/reward.txt or reward.json)"
    except (RewardFileEmptyError, VerifierOutputParseError, ValidationError) as e:
        error = f"the verifier's reward file is unreadable: {_one_line(e)}"
    except Exception as e:  # noqa: BLE001 - any failure to grade is an error verdict, with its message
        error = f"grading failed: {type(e).__name__}: {_one_line(e)}"
    finally:
        if not paths.test_stdout_path.exists():  # timed out or failed before Harbor downloaded it
            try:
                await env.download_file(f"{EnvironmentPaths.verifier_dir}/test-stdout.txt", paths.test_stdout_path)
            except (SproutError, OSError):
                pass
        await env.stop(delete=True)
    reward = rewards.get("reward", next(iter(rewards.values())) if len(rewards) == 1 else None)
    if error is None and reward is None:
        error = f"the rewards {rewards} have no 'reward' key"
    verdict: Verdict = "error" if error else ("pass" if reward >= 1 else "fail")
    output = paths.test_stdout_path.read_text(errors="replace") if paths.test_stdout_path.exists() else ""
    return GradeResult(reward=None if error else float(reward), rewards=rewards, verdict=verdict,
                       verifier_output=output[-MAX_OUTPUT_CHARS:], error=error,
                       duration_s=time.monotonic() - started)


def grade(store: Store, checkpoint: Checkpoint, task: Task, **kwargs) -> GradeResult:
    """grade_async for synchronous callers (not from inside a running event loop)."""
    return asyncio.run(grade_async(store, checkpoint, task, **kwargs))


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    cause = error.__cause__
    return f"{text} ({' '.join(str(cause).split())})" if cause and str(cause) else text
