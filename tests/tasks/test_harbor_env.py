"""SproutEnvironment as Harbor sees it: Harbor's own CLI runs a task with it, exec is killed in the
sandbox when cancelled, and host-side file transfer never leaves the sandbox's rootfs."""

import asyncio
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths

from sprout.sandbox import TransferError
from sprout.tasks import (
    CommandTimeoutError,
    SproutEnvironment,
    UnsupportedTaskError,
    load_task,
    start_task_sandbox,
)
from tests.conftest import REPO, RUNTIME_BIN
from tests.tasks.conftest import FIXTURES, SLOW_FIXTURES

HARBOR = REPO / ".venv" / "bin" / "harbor"


def test_harbor_cli_runs_the_oracle_on_a_sprout_sandbox(tmp_path):
    proc = subprocess.run(
        [str(HARBOR), "run", "-p", str(FIXTURES / "shell-count"), "-a", "oracle",
         "-e", "sprout.tasks.harbor_env:SproutEnvironment", "--ek", f"runtime_bin={RUNTIME_BIN}",
         "-o", str(tmp_path / "jobs"), "-y", "-q"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [trial] = [json.loads(p.read_text()) for p in (tmp_path / "jobs").glob("*/shell-count__*/result.json")]
    assert trial["exception_info"] is None, trial["exception_info"]
    assert trial["verifier_result"]["rewards"] == {"reward": 1.0}
    [stdout] = (tmp_path / "jobs").glob("*/shell-count__*/verifier/test-stdout.txt")
    assert "FAIL" not in stdout.read_text() and "ok   network_mode = no-network" in stdout.read_text()


def test_exec_is_killed_in_the_sandbox_when_cancelled(store, tmp_path):
    task = load_task(SLOW_FIXTURES / "verifier-hangs")

    async def scenario():
        env = SproutEnvironment.for_task(task, TrialPaths(tmp_path), store=store)
        await env.start(force_build=False)
        try:
            started = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(env.exec("(sleep 301 &); sleep 302 & sleep 303"), 1)
            assert time.monotonic() - started < 10
            await asyncio.sleep(0.2)
            survivors = (await env.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '")).stdout
            assert "sleep 30" not in survivors, survivors
            with pytest.raises(CommandTimeoutError, match="timed out after 1 seconds"):
                await env.exec("sleep 5", timeout_sec=1)
            result = await env.exec("pwd; id -un; echo $X; exit 4", cwd="/tmp", env={"X": "y"}, user="root")
            assert (result.stdout, result.return_code) == ("/tmp\nroot\ny\n", 4)
            nobody = await env.exec("id -un; grep CapEff /proc/self/status", user="nobody")
            assert nobody.stdout.split() == ["nobody", "CapEff:", "0000000000000000"]
            with env.with_default_user(0):
                assert (await env.exec("true")).return_code == 0
            assert (env.sandbox.path / "logs" / "verifier").stat().st_mode & 0o777 == 0o777
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())


def test_file_transfer_stays_inside_the_sandbox(fast_store, tmp_path):
    task = load_task(SLOW_FIXTURES / "verifier-hangs")
    name = f"sprout-test-{uuid.uuid4().hex[:8]}"
    local = tmp_path / "local"
    (local / "sub").mkdir(parents=True)
    (local / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (local / "run.sh").chmod(0o755)
    (local / "sub" / "data.txt").write_text("data\n")
    (local / "link").symlink_to("sub/data.txt")

    async def scenario():
        env = SproutEnvironment.for_task(task, TrialPaths(tmp_path / "trial"), store=fast_store)
        await env.start(force_build=False)
        try:
            await env.upload_dir(local, "/opt/up")
            result = await env.exec("/opt/up/run.sh && cat /opt/up/link && stat -c %U /opt/up/sub/data.txt")
            assert result.stdout == "ran\ndata\nroot\n"
            setup = ("mkdir -p /tmp/t && ln -s /etc /tmp/t/etc-link && echo inside > /root/inside && "
                     "ln -s /../../../../../root/inside /tmp/t/escape && ln -s /no/such /tmp/t/dangling && "
                     "ln -s /root /tmp/t/dir-link && echo plain > /tmp/t/plain")
            assert (await env.exec(setup)).return_code == 0
            await env.upload_file(local / "sub" / "data.txt", f"/tmp/t/etc-link/{name}")
            assert not Path(f"/etc/{name}").exists()  # the host's /etc is untouched
            assert (await env.exec(f"cat /etc/{name}")).stdout == "data\n"
            await env.download_file("/tmp/t/escape", tmp_path / "escape.txt")
            assert (tmp_path / "escape.txt").read_text() == "inside\n"
            await env.download_dir("/tmp/t", tmp_path / "down")
            assert sorted(p.name for p in (tmp_path / "down").iterdir()) == ["escape", "plain"]
            assert not any(p.is_symlink() for p in (tmp_path / "down").iterdir())
            with pytest.raises(TransferError, match="not part of the sandbox's disk"):
                await env.download_file("/etc/hosts", tmp_path / "hosts")
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())


def test_what_one_sandbox_cannot_do_is_refused_by_the_environment(fast_store, copy_task, tmp_path):
    task = load_task(FIXTURES / "shell-count")

    def create(task, **kwargs):
        return SproutEnvironment(task.paths.environment_dir, task.short_name, "s", TrialPaths(tmp_path),
                                 task.config.environment.model_copy(deep=True), store=fast_store, **kwargs)

    logs = {"type": "bind", "source": str(tmp_path), "target": "/logs/verifier"}
    assert create(task, mounts=[logs]).capabilities.mounted is False  # Harbor downloads the logs instead
    with pytest.raises(UnsupportedTaskError, match=r"bind mounts \(/data\) are not supported"):
        create(task, mounts=[logs, {"type": "bind", "source": str(tmp_path), "target": "/data"}])
    compose = copy_task("shell-count", **{"environment/docker-compose.yaml": "services: {}\n"})
    with pytest.raises(UnsupportedTaskError, match="docker-compose environments are not supported"):
        create(Task(compose))  # Harbor's own loading: Sprout's load_task refuses such tasks first
    gpus = copy_task("py-bugfix")
    (gpus / "task.toml").write_text((gpus / "task.toml").read_text() + "gpus = 1\n")
    with pytest.raises(RuntimeError, match="GPU"):
        create(Task(gpus))


def test_environment_env_reaches_every_command_and_branches_keep_it(fast_store, copy_task):
    task_dir = copy_task("py-bugfix")
    toml = task_dir / "task.toml"
    toml.write_text(toml.read_text() + '\n[environment.env]\nTASK_FLAVOUR = "strict"\n')
    sandbox = start_task_sandbox(fast_store, load_task(task_dir), "tasks-test")
    made = [sandbox]
    try:
        assert sandbox.exec("echo $TASK_FLAVOUR").output.strip() == "strict"  # as the agent's commands run
        checkpoint = sandbox.checkpoint(label="tasks-test")
        made.append(checkpoint.branch(label="tasks-test"))
        assert made[-1].exec("echo $TASK_FLAVOUR").output.strip() == "strict"
    finally:
        for one in made:
            one.destroy()
        for checkpoint in fast_store.checkpoints(sandbox.id):
            fast_store.remove_checkpoint(checkpoint.id, force=True)
