"""Worker churn over a Run Store: workers SIGKILLed while they hold an evaluation's rollout jobs. A job whose
workers die is run again elsewhere (its losses counted apart from its handler's failures, up to
SPROUT_JOB_WORKER_LOSSES); one lost beyond that is recorded as lost to infrastructure, its siblings carry
on, and a resume reruns it."""

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

from sprout.eval.summary import read_summary
from sprout.runstore.client import RunStoreClient
from sprout.sandbox import Store
from sprout.testing.scripted_model import ScriptedModelServer
from tests.conftest import REPO, RUNTIME_BIN
from tests.method.conftest import evaluate_args, run_module
from tests.services.test_services import free_port, services

LEASE_S = "5"  # heartbeats every second: a killed worker's jobs are taken again within 5 s
KILLS = 15


class Workers:
    """Worker processes on the Run Store, each with one slot, started and SIGKILLed at will."""

    def __init__(self, url: str, token_file: str):
        self.url, self.token_file = url, token_file
        self.procs: list[subprocess.Popen] = []
        self.kills = 0

    def start(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sprout.worker", "serve", "--url", self.url, "--token-file", self.token_file,
             "--slots", "1", "--lease", LEASE_S],
            cwd=REPO, env={**os.environ, "SPROUT_RUNTIME_BIN": str(RUNTIME_BIN)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def kill_one_holding_a_job(self, client: RunStoreClient) -> bool:
        """SIGKILLs a live worker that holds a rollout job's current lease, and starts one in its place."""
        now = datetime.now(UTC)
        holders = {j.lease_owner for j in client.list(limit=100).jobs
                   if j.state == "leased" and j.lease_expires_at and j.lease_expires_at > now}
        for proc in self.procs:
            if proc.poll() is None and any(f"-{proc.pid}-" in (owner or "") for owner in holders):
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                self.kills += 1
                self.start()
                return True
        return False

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            proc.wait(timeout=120)


def sandbox_ids() -> set[str]:
    return {s.id for s in Store().sandboxes()}


def test_worker_churn_loses_no_attempt_and_a_lost_one_is_rerun_by_a_resume(dataset, outputs, tmp_path):
    cfg = tmp_path / "cfg"
    assert services(cfg, "init", "--port", str(free_port())).returncode == 0
    up = services(cfg, "up", "runstore-api")
    before = sandbox_ids()
    out = tmp_path / "restarts"
    outputs.append(out)
    workers = None
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        exports = dict(item.split("=", 1) for item in services(cfg, "env").stdout.split()[1:])
        client = RunStoreClient(exports["SPROUT_RUNSTORE_URL"], exports["SPROUT_RUNSTORE_TOKEN"])
        workers = Workers(exports["SPROUT_RUNSTORE_URL"], str(cfg / "secrets" / "worker.token"))
        with ScriptedModelServer([{"thought": "look", "command": "ls /app"}] * 2000, delay_s=1.0) as model:
            args = evaluate_args(dataset, out, model.base_url, "--parallel", "2", method="restarts")
            at = args.index("--model-key-env")
            del args[at:at + 2]  # over a Run Store, a plain URL is called with no key
            args[args.index("--step-limit") + 1] = "3"
            args[args.index("--branches") + 1] = "3"  # 4 attempts of 3 turns, in waves of 2

            # a job may lose one worker: the one killed under a1 or a2 loses that attempt, the other carries on
            for _ in range(2):
                workers.start()
            result: dict = {}
            run = threading.Thread(target=lambda: result.update(done=run_module(
                "sprout.eval.evaluate", *args, env={**exports, "SPROUT_JOB_WORKER_LOSSES": "1"}, timeout=600)))
            run.start()
            deadline = time.monotonic() + 120
            while not workers.kill_one_holding_a_job(client):
                assert time.monotonic() < deadline and run.is_alive(), "no worker took a rollout job"
                time.sleep(0.5)
            workers.procs[-1].send_signal(signal.SIGKILL)  # not replaced: the lost job has no one to rerun it
            run.join()
            lost = result["done"]
            assert lost.returncode == 1, lost.stdout + lost.stderr
            assert "Traceback" not in lost.stderr and "lost to infrastructure" in lost.stderr
            summary = read_summary(out)
            assert summary.status == "lost" and "run the same command again" in (summary.error or "")
            assert len(summary.attempts) == 1 and summary.attempts[0].id in ("a1", "a2")  # the sibling finished

            # the resume under churn: 15 workers killed while they hold its jobs, each job may lose 30
            workers.start(), workers.start()
            run = threading.Thread(target=lambda: result.update(done=run_module(
                "sprout.eval.evaluate", *args, env={**exports, "SPROUT_JOB_WORKER_LOSSES": "30"},
                timeout=600)))
            run.start()
            deadline = time.monotonic() + 400
            while workers.kills < 1 + KILLS and run.is_alive():
                assert time.monotonic() < deadline, f"only {workers.kills - 1} kills"
                if workers.kill_one_holding_a_job(client):
                    time.sleep(1.5)  # a replacement starts; the others carry on
                time.sleep(0.3)
            run.join()
        resumed = result["done"]
        assert workers.kills == 1 + KILLS, f"the evaluation ended after {workers.kills - 1} kills"
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        summary = read_summary(out)
        assert summary.status == "unsolved" and [a.id for a in summary.attempts] == ["a1", "a2", "a3", "a4"]
        assert all(a.turns == 3 and a.verdict == "fail" for a in summary.attempts)
        jobs = [j for j in client.list(limit=200).jobs if j.kind == "rollout"]
        assert sum(j.lease_expiries for j in jobs) >= 1 + KILLS  # every kill cost a lease
        assert sum(j.state == "succeeded" for j in jobs) == 4  # each attempt's work was done once in the end
    finally:
        if workers is not None:
            workers.stop()
        services(cfg, "down")
    # what the killed workers left is reaped by the workers after them, or by gc: a sandbox the last killed
    # worker's podman made after that worker died has no worker after it
    Store().gc()
    assert sandbox_ids() <= before
