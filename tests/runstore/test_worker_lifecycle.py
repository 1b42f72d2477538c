"""A worker's life with real processes: SIGKILLed mid-rollout, cancelled mid-rollout, drained mid-rollout.

A real API process, real worker processes, real sandboxes, and a scripted model on 127.0.0.1 whose turns
are slow enough to act in the middle of a rollout."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sprout.agent.journal import read_journal
from sprout.runstore.auth import Scope, hash_token, new_token
from sprout.runstore.client import RunStoreClient
from sprout.sandbox import Store, btrfs
from sprout.testing.scripted_model import ScriptedModelServer
from tests.conftest import REPO, RUNTIME_BIN, free_port, removing_what_is_made, turns_so_far, wait_healthy

TURN = {"thought": "work", "command": "sleep 0.3; echo turn >> /root/turns", "delay_s": 0.2}
SUBMIT = {"thought": "done", "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}


@dataclass
class Live:
    url: str
    client: RunStoreClient
    tmp: Path
    model: ScriptedModelServer
    workers: list[subprocess.Popen]

    def worker(self, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"worker-{len(self.workers)}.log", "wb")  # noqa: SIM115 - the process keeps it
        proc = subprocess.Popen([sys.executable, "-m", "sprout.worker", "serve", "--url", self.url,
                                 "--token-file", str(self.tmp / "worker.token"), "--lease", "3", *args],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "SPROUT_RUNTIME_BIN": str(RUNTIME_BIN)})
        self.workers.append(proc)
        return proc

    def log(self, proc: subprocess.Popen) -> str:
        return (self.tmp / f"worker-{self.workers.index(proc)}.log").read_text()

    def rollout(self, journal: Path) -> int:
        return self.client.submit("rollout", {"task": "work slowly", "model": "scripted", "options": {
            "endpoint": {"url": self.model.base_url}, "journal": str(journal), "step_limit": 100}}).id


@pytest.fixture
def live(tmp_path) -> Iterator[Live]:
    tokens = {scope: new_token() for scope in Scope}
    (tmp_path / "tokens.json").write_text(json.dumps({hash_token(t): s.value for s, t in tokens.items()}))
    (tmp_path / "worker.token").write_text(tokens[Scope.WORKER])
    url = f"http://127.0.0.1:{free_port()}"
    api = subprocess.Popen([sys.executable, "-m", "sprout.runstore.api", "--db", str(tmp_path / "rs.db"),
                            "--tokens", str(tmp_path / "tokens.json"), "--port", url.rsplit(":", 1)[1],
                            "--log-level", "warning"], cwd=REPO)
    wait_healthy(url, api)
    with removing_what_is_made(Store(runtime_bin=RUNTIME_BIN)), \
            ScriptedModelServer([TURN] * 12 + [SUBMIT]) as model:
        live = Live(url, RunStoreClient(url, tokens[Scope.SUBMITTER]), tmp_path, model, [])
        try:
            yield live
        finally:
            for proc in [*live.workers, api]:
                proc.kill()
                proc.wait()


def wait_for(condition, timeout_s: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def container_names() -> str:
    listed = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True)
    return listed.stdout


def test_a_killed_worker_leaves_nothing_and_its_job_finishes_elsewhere(live):
    journal = live.tmp / "killed.jsonl"
    job_id = live.rollout(journal)
    doomed = live.worker()
    wait_for(lambda: len(turns_so_far(journal)) >= 2, what="two turns on the first worker")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    dead = read_journal(journal)
    dead_sandbox, dead_checkpoints = dead.header.sandbox, [t.checkpoint for t in dead.turns]
    store = Store(runtime_bin=RUNTIME_BIN)
    assert store.sandbox(dead_sandbox).running  # left running by the kill
    half_made = store.root / "checkpoints" / f"cp-killed-{uuid.uuid4().hex[:8]}"  # a kill mid-snapshot
    btrfs.create(half_made)
    try:
        second = live.worker()
        wait_for(lambda: "reaped sandbox " + dead_sandbox in live.log(second), 30, "the next start to reap")
        assert f"reaped orphan checkpoint subvolume {half_made.name}" in live.log(second)
        assert not half_made.exists()
    finally:
        btrfs.delete(half_made)
    assert dead_sandbox not in {s.id for s in store.sandboxes()}
    assert f"sprout-{dead_sandbox}" not in container_names()
    assert not set(dead_checkpoints) & {c.id for c in store.checkpoints()}
    done = wait_for(lambda: (job := live.client.get(job_id)).state in ("succeeded", "failed") and job, 120,
                    "the job to finish on the second worker")
    assert done.state == "succeeded", done.error
    # the killed worker's lease lapsed (under load a live worker's may lapse too): every attempt before the
    # last was a lost worker, none a failure of the rollout itself
    assert done.lease_expiries >= 1 and done.attempts == done.lease_expiries + 1, done
    finished = read_journal(journal)
    assert finished.outcome.status == "submitted" and finished.header.sandbox != dead_sandbox
    assert done.result["checkpoints"] == [t.checkpoint for t in finished.turns]
    assert all(store.checkpoint(c).exists for c in done.result["checkpoints"])
    reaped = [line for line in store.gc(dry_run=True) if "dead owner" in line]
    assert reaped == []  # the finished attempt's checkpoints were adopted by the second worker


def test_a_cancelled_rollout_stops_within_a_turn(live):
    journal = live.tmp / "cancelled.jsonl"
    job_id = live.rollout(journal)
    worker = live.worker()
    wait_for(lambda: len(turns_so_far(journal)) >= 1, what="a first turn")
    sandbox_id = read_journal(journal).header.sandbox
    live.client.cancel(job_id)
    wait_for(lambda: not journal.exists(), 20, "the cancelled rollout to discard its journal")
    store = Store(runtime_bin=RUNTIME_BIN)
    assert sandbox_id not in {s.id for s in store.sandboxes()}
    assert f"sprout-{sandbox_id}" not in container_names()
    assert live.client.get(job_id).state == "cancelled"
    assert f"job {job_id} stopped" in live.log(worker)
    assert worker.poll() is None  # the worker goes on


def test_a_draining_worker_stops_its_rollout_before_releasing_it(live):
    journal = live.tmp / "drained.jsonl"
    job_id = live.rollout(journal)
    worker = live.worker("--drain-timeout", "1")
    wait_for(lambda: len(turns_so_far(journal)) >= 1, what="a first turn")
    sandbox_id = read_journal(journal).header.sandbox
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    log = live.log(worker)
    assert log.index(f"job {job_id} stopped") < log.index(f"releasing job {job_id}")
    store = Store(runtime_bin=RUNTIME_BIN)
    assert sandbox_id not in {s.id for s in store.sandboxes()} and not journal.exists()
    assert live.client.get(job_id).state == "queued"  # back in the queue at once, for another worker
    live.worker()
    done = wait_for(lambda: (job := live.client.get(job_id)).state in ("succeeded", "failed") and job, 120,
                    "another worker to run it")
    assert done.state == "succeeded", done.error


def test_a_rollout_finished_by_a_dead_worker_reports_the_host_that_made_it(live):
    journal = live.tmp / "finished.jsonl"
    first = live.rollout(journal)
    live.worker()
    done = wait_for(lambda: (job := live.client.get(first)).state in ("succeeded", "failed") and job, 120,
                    "the first run")
    assert done.state == "succeeded", done.error
    lines = journal.read_text().splitlines()
    header = json.loads(lines[0])
    header["host"] = "the-host-that-made-it"  # as if another host's worker had run it and died unreported
    journal.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    again = live.rollout(journal)
    rerun = wait_for(lambda: (job := live.client.get(again)).state in ("succeeded", "failed") and job, 60,
                     "the rerun")
    assert rerun.state == "succeeded", rerun.error
    assert rerun.result["host"] == "the-host-that-made-it"
    assert rerun.result["checkpoints"] == done.result["checkpoints"]
    assert len(live.model.requests) == len(read_journal(journal).turns)  # the model was not called again
