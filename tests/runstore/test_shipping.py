"""Host affinity across two stores: a branch whose checkpoint is on a busy host is claimed by another
host's worker, which ships the checkpoint over the first worker's checkpoint server (btrfs send |
btrfs receive as root, tar streams rootless; incremental the second time), then runs the branch there;
once that host is gone, a branch from a checkpoint only it held fails at once, saying so."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sprout.agent.journal import read_journal
from sprout.agent.models import Endpoint
from sprout.agent.runner import RolloutSpec, run_rollout
from sprout.jobs.payloads import RolloutResult, job_kinds
from sprout.runstore.api import create_app
from sprout.runstore.auth import Scope, hash_token, new_token
from sprout.runstore.client import RunStoreClient
from sprout.runstore.store import RunStore
from sprout.sandbox import Store
from sprout.sandbox.errors import SproutError
from sprout.sandbox.ship import holds
from sprout.testing.scripted_model import ScriptedModelServer
from sprout.worker.shipping import HttpSource
from tests.conftest import PYTHON_IMAGE, REPO, RUNTIME_BIN
from tests.runstore.test_api import serve

KEY_ENV = "SPROUT_SHIP_TEST_KEY"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
FIRST = [{"thought": "one", "command": "echo first > /root/f"},
         {"thought": "two", "command": "head -c 1048576 /dev/urandom > /root/blob && echo second >> /root/f"},
         {"thought": "done", "command": SUBMIT}]
BRANCHES = [{"thought": "look", "command": "cat /root/f; ls /root"}, {"thought": "done", "command": SUBMIT}] * 2


def start_worker(url: str, token_file: Path, host: str, store: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, KEY_ENV: "sk-test", "SPROUT_STORE": str(store), "SPROUT_RUNTIME_BIN": str(RUNTIME_BIN)}
    return subprocess.Popen([sys.executable, "-m", "sprout.worker", "serve", "--url", url, "--token-file",
                             str(token_file), "--host-id", host, "--lease", "30", *flags], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(client: RunStoreClient, job_id: int, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while (job := client.get(job_id)).state not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"job {job_id} still {job.state}"
        time.sleep(0.2)
    return job


@pytest.mark.rootless
def test_busy_host_checkpoint_is_shipped_to_the_claiming_host(base_store, other_store, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    here = Store(base_store.root, runtime_bin=RUNTIME_BIN)
    tokens = {scope: new_token() for scope in Scope}
    token_file = tmp_path / "worker.token"
    token_file.write_text(tokens[Scope.WORKER])
    workers: list[subprocess.Popen] = []
    with ScriptedModelServer(FIRST) as model:
        spec = RolloutSpec(task="make f", model="scripted", endpoint=Endpoint(model.base_url, KEY_ENV),
                           journal=tmp_path / "first.jsonl", image=PYTHON_IMAGE, cwd="/root")
        first = run_rollout(spec, here)
    cp1, cp2 = (t.checkpoint for t in read_journal(first.journal).turns[:2])
    rs = RunStore(str(tmp_path / "rs.db"), job_kinds())
    try:
        elsewhere = RolloutSpec(task="", model="scripted", endpoint=spec.endpoint, journal=tmp_path / "x.jsonl",
                                from_journal=first.journal, from_turn=1)
        with pytest.raises(SproutError, match=f"checkpoint {cp1} is not in the store {other_store.root} "
                                              f"\\(it was made in {here.root} on "):
            run_rollout(elsewhere, other_store)
        with serve(create_app(rs, {hash_token(t): s.value for s, t in tokens.items()}, poll_s=0.1)) as url, \
                ScriptedModelServer(BRANCHES) as model:
            submitter = RunStoreClient(url, tokens[Scope.SUBMITTER])
            worker_client = RunStoreClient(url, tokens[Scope.WORKER])
            # host-a holds the checkpoints but takes no rollouts (busy); host-b has an empty store
            workers.append(start_worker(url, token_file, "host-a", here.root, "--kinds", "gate",
                                        "--ship-listen", "127.0.0.1:0"))
            workers.append(start_worker(url, token_file, "host-b", other_store.root, "--kinds", "rollout"))
            deadline = time.monotonic() + 30
            while not _registered(worker_client, "host-a"):
                assert time.monotonic() < deadline and workers[0].poll() is None, "host-a's worker did not register"
                time.sleep(0.2)
            ship_url = worker_client.host("host-a").ship_url
            assert ship_url.startswith("http://127.0.0.1:")
            with pytest.raises(SproutError, match="refused this worker's token"):
                HttpSource(ship_url, "wrong-token").checkpoint(cp1)

            def branch(turn: int, checkpoint: str, name: str):
                payload = {"task": "make f", "model": "scripted", "turn": turn, "from_checkpoint": checkpoint,
                           "options": {"endpoint": {"url": model.base_url}, "cwd": "/root",
                                       "journal": str(tmp_path / f"{name}.jsonl"),
                                       "from_journal": str(first.journal)}}
                job = submitter.submit("rollout", payload, host="host-a", affinity_timeout_s=1.0)
                return wait_for(submitter, job.id)

            one = branch(1, cp1, "b1")
            assert one.state == "succeeded", one.error
            assert (one.lease_host, one.shipped_from, one.result["host"]) == ("host-b", "host-a", "host-b")
            # what a submitter reads (an evaluation, the RL driver): the same contract, shipping included
            shipped = RolloutResult.model_validate(one.result).shipped
            image_key = here.checkpoint(cp1).image_key
            assert shipped and (shipped.host, shipped.checkpoint) == ("host-a", cp1)
            assert shipped.subvolumes == [image_key, cp1] and shipped.parent == image_key
            assert read_journal(tmp_path / "b1.jsonl").turns[0].observation.split() == ["first", "f"]

            two = branch(2, cp2, "b2")
            assert two.state == "succeeded", two.error
            shipped = RolloutResult.model_validate(two.result).shipped
            assert shipped and shipped.subvolumes == [cp2] and shipped.parent == cp1  # incremental
            assert shipped.bytes < 3 * 1024 * 1024  # the turn's delta, not the rootfs
            assert read_journal(tmp_path / "b2.jsonl").turns[0].observation.split() == ["first", "second", "blob", "f"]
            assert other_store.checkpoint(cp2).parent == cp1 and read_journal(tmp_path / "b2.jsonl").header.host

            # a checkpoint whose host serves nothing: one clear error, not a branch from the wrong state
            worker_client.register_host("host-c", None)
            gone = submitter.submit("rollout", {"task": "t", "model": "scripted", "turn": 1, "from_checkpoint": "cp-x",
                                                "options": {"endpoint": {"url": model.base_url},
                                                            "journal": str(tmp_path / "g")}},
                                    host="host-c", affinity_timeout_s=0)
            gone = wait_for(submitter, gone.id)
            assert gone.state == "failed" and "cp-x is on host host-c, whose worker serves no checkpoints" in gone.error
            assert gone.attempts == 1  # not retried: no other try could find it

            # host-a dies (its worker and so its checkpoint server, SIGKILLed): a branch from a checkpoint only
            # it held fails at once with the reason, rather than being tried again
            cp3 = read_journal(first.journal).turns[2].checkpoint
            assert cp3 and not holds(other_store, cp3)
            workers[0].kill()
            workers[0].wait()
            started = time.monotonic()
            lost = branch(3, cp3, "b3")
            assert lost.state == "failed" and lost.attempts == 1 and lost.lease_host == "host-b", lost
            assert (f"CheckpointUnavailable: checkpoint {cp3} exists only on host host-a, and its checkpoint server "
                    f"at {ship_url} does not answer") in lost.error
            assert "the host is down or its worker is gone, so nothing can start from it" in lost.error
            assert time.monotonic() - started < 30  # the 1 s affinity, a claim and one failed fetch
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            output = worker.communicate(timeout=60)[0]
            assert "Traceback" not in output, output
        rs.close()
        for checkpoint in first.checkpoints:
            here.remove_checkpoint(checkpoint, force=True)


def _registered(client: RunStoreClient, host: str) -> bool:
    try:
        return bool(client.host(host).ship_url)
    except Exception:
        return False
