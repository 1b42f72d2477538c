"""The RL driver end to end: a real uvicorn driver (`python -m sprout.rl_driver serve`), the scripted model
as the policy, real sandboxes graded by the task's Harbor verifier, driven by a client written here from
the contract's facts (what Miles' rollout function does): POST, GET until terminal, DELETE in a finally."""

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from sprout.rl_driver.protocol import RolloutGroupResult
from sprout.sandbox import CheckpointNotFound, Store, btrfs
from sprout.testing.scripted_model import ScriptedModelServer
from tests.conftest import REPO, RUNTIME_BIN, free_port
from tests.services.test_services import services

INSTRUCTION = "Fix it so that"  # in the first call's last message only (the task)
OBSERVATION = "returncode"  # in every tool result
FIX = "sed -i 's/return a - b/return a + b/' /app/calc.py"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
POLICY_KEY = "sk-policy-never-echoed"
DRIVER_TOKEN = "driver-token-for-tests"
TERMINAL = {"completed", "early_stopped", "failed", "cancelled"}
HINTS = ("<sprout_training_hint>", "</sprout_training_hint>")


def first(command: str, n: int = 1) -> list[dict]:
    return [{"thought": "start", "command": command, "match": INSTRUCTION}] * n


def then(command: str, n: int = 1) -> list[dict]:
    return [{"thought": "next", "command": command, "match": OBSERVATION}] * n


class MilesShapedClient:
    """Miles' side of the wire, from the contract: a bearer token when set, a 30 s timeout per call,
    every answer below 400 parsed as JSON, errors raised with their body, DELETE always sent."""

    def __init__(self, url: str, token: str | None = DRIVER_TOKEN):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=30)

    def call(self, method: str, path: str, **kwargs) -> dict:
        response = self.http.request(method, path, **kwargs)
        assert response.status_code < 400, f"{method} {path}: {response.status_code} {response.text[:500]}"
        return response.json()

    def run_group(self, request: dict, poll_s: float = 0.5, on_running=None, post: bool = True) -> dict:
        """POST (unless `post` is False: a group already posted), GET until terminal, DELETE."""
        group_id = request["rollout_job_id"]
        limit = request["budgets"]["max_wall_time_seconds"] + request["finalization_timeout_seconds"]
        try:
            started = time.monotonic()
            if post:
                ack = self.call("POST", "/rollout-groups", json=request)
                assert ack == {"rollout_job_id": group_id, "status": "queued"}
                assert time.monotonic() - started < 5  # POST only enqueues
            while True:
                result = self.call("GET", f"/rollout-groups/{group_id}")
                check_result(result, request)
                if result["status"] in TERMINAL:
                    return result
                if on_running is not None:
                    on_running(result)
                assert time.monotonic() - started < limit + 30, "the group outlived its wall time and finalization"
                time.sleep(poll_s)
        finally:
            deleted = self.http.delete(f"/rollout-groups/{group_id}")
            assert deleted.status_code in (200, 404), deleted.text
            if deleted.status_code == 200:
                assert deleted.json()["rollout_job_id"] == group_id and deleted.json()["status"] in TERMINAL


def check_result(result: dict, request: dict) -> None:
    """What Miles checks of a result before it trains on it (and Sprout's own strict model)."""
    RolloutGroupResult.model_validate(result)
    assert result["rollout_job_id"] == request["rollout_job_id"] and result["max_samples"] == request["max_samples"]
    assert result["actual_samples"] == len(result["trajectories"])
    if result["status"] == "completed" and "search" not in request:  # a search leaves unneeded slots unused
        assert result["actual_samples"] == request["max_samples"]
    for trajectory in result["trajectories"]:
        assert trajectory["hints_removed"] is True and math.isfinite(trajectory["reward"])
        assert set(trajectory["metadata"]["provenance"]) == {"prefix_messages", "inserted_messages"}
        pending: list[str] = []
        ids: set[str] = set()
        for message in trajectory["messages"]:
            assert message["role"] in ("system", "user", "assistant", "tool")
            assert message.get("content") is None or isinstance(message["content"], str)
            if message["role"] in ("system", "user"):
                assert not any(tag in (message["content"] or "") for tag in HINTS)
            for call in message.get("tool_calls") or []:
                assert call["id"] and call["id"] not in ids and call["type"] == "function"
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
                ids.add(call["id"])
                pending.append(call["id"])
            if message["role"] == "tool":
                pending.remove(message["tool_call_id"])
        assert not pending and any(m["role"] == "assistant" for m in trajectory["messages"])


def group_request(prompt: dict, endpoint: str, n: int, **overrides) -> dict:
    job = f"miles-1-3-{uuid.uuid4().hex}"
    slots = [{"sample_slot_id": f"{job}:slot:{11 + i}", "sample_index": 11 + i} for i in range(n)]
    request = {"rollout_job_id": job, "rollout_id": 1, "prompt_group_id": "3", "task_id": prompt["metadata"]["task_id"],
               "image": prompt["metadata"]["image"], "prompt": prompt["prompt"], "model_endpoint": endpoint,
               "model": "policy", "sample_slots": slots, "max_samples": n, "minimum_returned_samples": n,
               "max_turns": 10, "finalization_timeout_seconds": 120.0,
               "sampling_params": {"temperature": 0.6, "top_p": 1.0, "top_k": -1, "max_new_tokens": 512,
                                   "stop": ["stop-here"]},
               "budgets": {"max_wall_time_seconds": 180.0}}
    return request | overrides


def endpoint_of(model: ScriptedModelServer) -> str:
    """The policy as Miles names it: the router's base URL, without /v1."""
    return model.base_url.removesuffix("/v1")


class DriverProcess:
    def __init__(self, config: Path, port: int, env: dict | None = None):
        self.config, self.port, self.env = config, port, env or {}
        self.url = f"http://127.0.0.1:{port}"
        self.log = config.parent / f"driver-{port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "DriverProcess":
        env = {**os.environ, "SPROUT_RL_DRIVER_TOKEN": DRIVER_TOKEN, "SPROUT_MODEL_API_KEY": POLICY_KEY,
               "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1", **self.env}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "sprout.rl_driver", "serve", "--config", self.config,
                                          "--port", str(self.port)], cwd=REPO, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the driver did not start: {self.log.read_text()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=120)


def write_config(path: Path, tasks_dir: Path, **extra) -> Path:
    """A driver config for the tests; over a Run Store, the hosts are prepared at start only where asked
    (test_prepare_hosts): elsewhere the workers' store already holds the images."""
    config = {"tasks_dir": str(tasks_dir), "data_dir": str(path.parent / "data"), "local_slots": 4,
              "runtime_bin": str(RUNTIME_BIN), "miles": {"api_key_env": "SPROUT_MODEL_API_KEY"},
              "prepare_hosts": False, **extra}
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def driver(tasks, tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-driver")
    process = DriverProcess(write_config(root / "driver.json", tasks[0]), free_port()).start()
    yield process
    process.stop()


def sandbox_ids() -> set[str]:
    return {s.id for s in Store().sandboxes()}


WRITE_TESTS = "mkdir -p /tests && echo 'def test_ok(): pass' > /tests/test_calc.py"  # where Harbor puts the tests


@pytest.mark.rootless
def test_a_group_of_four_returns_four_graded_trajectories(driver, tasks):
    script = first(FIX, 2) + first(WRITE_TESTS, 2) + then(SUBMIT, 4)
    before = sandbox_ids()
    with ScriptedModelServer(script, api_key=POLICY_KEY) as model:
        request = group_request(tasks[1], endpoint_of(model), 4)
        result = MilesShapedClient(driver.url).run_group(request)
        calls = [r for r in model.requests if r["path"].endswith("/chat/completions")]
    assert result["status"] == "completed" and result["actual_samples"] == 4 and result["failed_samples"] == []
    assert sorted(t["reward"] for t in result["trajectories"]) == [0.0, 0.0, 1.0, 1.0]
    assert [t["sample_slot_id"] for t in result["trajectories"]] == [s["sample_slot_id"] for s in request["sample_slots"]]
    for trajectory in result["trajectories"]:
        assert trajectory["status"] == "completed" and trajectory["stop_reason"] is None
        assert [m["role"] for m in trajectory["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool"]
        assert trajectory["tools"][0]["function"]["name"] == "bash"
        meta = trajectory["metadata"]
        assert meta["zero_reason"] is None and meta["search"] is None and meta["source_image"] == request["image"]
        assert len(meta["checkpoints"]) == 2 and meta["graded_snapshot_id"] == meta["checkpoints"][-1]
        assert meta["touched_test_paths"] == ([] if trajectory["reward"] else ["/tests/test_calc.py"])
        for checkpoint in meta["checkpoints"]:  # released when the group was DELETEd
            with pytest.raises(CheckpointNotFound):
                Store().checkpoint(checkpoint)
    budget = result["consumed_budget"]
    assert budget["model_calls"] == 8 and budget["tool_calls"] == 8 and budget["sandbox_seconds"] > 0
    assert len(calls) == 8 and all(c["path"] == "/v1/chat/completions" for c in calls)  # /v1 appended
    for call in calls:  # every policy call carried the sampling parameters, the model name and the key
        body = call["body"]
        assert (body["model"], body["temperature"], body["top_p"], body["top_k"], body["max_tokens"],
                body["stop"]) == ("policy", 0.6, 1.0, -1, 512, ["stop-here"])
        assert call["headers"]["authorization"] == "<redacted>"
    assert sandbox_ids() <= before  # the samples' sandboxes are gone
    assert POLICY_KEY not in driver.log.read_text()


def test_strictness_auth_and_idempotency(driver, tasks):
    client = MilesShapedClient(driver.url)
    base = group_request(tasks[1], "http://127.0.0.1:9", 2)
    bad = {
        "unknown field": base | {"protocol_version": 1},
        "duplicate slots": base | {"sample_slots": [base["sample_slots"][0]] * 2},
        "bounds": base | {"max_samples": 3},
        "max_turns 0": base | {"max_turns": 0},
        "budget key": base | {"budgets": {"max_wall_time_seconds": 5.0, "max_tool_calls": 3}},
    }
    for name, body in bad.items():
        response = client.http.post("/rollout-groups", json=body)
        assert response.status_code == 422, name
        assert "detail" in response.json()
    unknown_task = client.http.post("/rollout-groups", json=base | {"task_id": "no-such-task"})
    assert unknown_task.status_code == 400 and "no-such-task" in unknown_task.json()["detail"]
    anonymous = httpx.post(f"{driver.url}/rollout-groups", json=base)
    assert anonymous.status_code == 401
    huge = client.http.post("/rollout-groups", content=b"{" + b" " * (5 * 1024 * 1024) + b"}",
                            headers={"content-type": "application/json"})
    assert huge.status_code == 413
    assert client.http.get("/rollout-groups/never-posted").status_code == 404
    assert client.http.delete("/rollout-groups/never-posted").status_code == 404
    # an identical re-POST answers the current status; another body under the same id is refused
    request = base | {"budgets": {"max_wall_time_seconds": 1.0}, "finalization_timeout_seconds": 1.0}
    assert client.call("POST", "/rollout-groups", json=request)["status"] == "queued"
    again = client.call("POST", "/rollout-groups", json=request)
    assert set(again) == {"rollout_job_id", "status"}
    conflict = client.http.post("/rollout-groups", json=request | {"max_turns": 3})
    assert conflict.status_code == 409
    deleted = client.call("DELETE", f"/rollout-groups/{request['rollout_job_id']}")
    assert deleted["status"] in TERMINAL
    assert client.http.get(f"/rollout-groups/{request['rollout_job_id']}").status_code == 404


def test_truncation_by_max_turns_and_by_wall_time_is_still_graded(driver, tasks):
    client = MilesShapedClient(driver.url)
    with ScriptedModelServer(first("ls /app") + then("ls /app", 5), api_key=POLICY_KEY) as turns, \
            ScriptedModelServer(first("ls /app") + then("ls /app", 20), api_key=POLICY_KEY, delay_s=1.5) as slow:
        by_turns = client.run_group(group_request(tasks[1], endpoint_of(turns), 1, max_turns=2))
        by_time = client.run_group(group_request(tasks[1], endpoint_of(slow), 1,
                                                 budgets={"max_wall_time_seconds": 6.0}))
    (t,) = by_turns["trajectories"]
    assert (t["status"], t["stop_reason"], t["reward"], t["metadata"]["zero_reason"]) == (
        "truncated", "max_turns_reached", 0.0, None)
    assert sum(m["role"] == "assistant" for m in t["messages"]) == 2 and by_turns["status"] == "completed"
    (t,) = by_time["trajectories"]
    assert (t["status"], t["stop_reason"], t["metadata"]["zero_reason"]) == ("truncated", "timeout", None)
    assert 1 <= sum(m["role"] == "assistant" for m in t["messages"]) <= 4


def test_a_failed_actor_is_listed_in_failed_samples(driver, tasks):
    refusal = {"status": 400, "body": "the policy refused", "match": INSTRUCTION}
    script = [refusal, *first(SUBMIT), refusal]  # one of the pair fails, then the one alone
    client = MilesShapedClient(driver.url)
    with ScriptedModelServer(script, api_key=POLICY_KEY) as model:
        request = group_request(tasks[1], endpoint_of(model), 2, minimum_returned_samples=1)
        result = client.run_group(request)
        alone = client.run_group(group_request(tasks[1], endpoint_of(model), 1))
    assert result["status"] == "early_stopped" and result["actual_samples"] == 1
    (failed,) = result["failed_samples"]
    (trajectory,) = result["trajectories"]
    assert {failed["sample_slot_id"], trajectory["sample_slot_id"]} == {s["sample_slot_id"]
                                                                        for s in request["sample_slots"]}
    assert "actor failed" in failed["reason"]
    assert (alone["status"], alone["actual_samples"], len(alone["failed_samples"])) == ("failed", 0, 1)
    assert "fewer than the minimum 1" in alone["stop_reason"]


def test_a_grade_without_a_verdict_sets_zero_reason(driver, tasks):
    with ScriptedModelServer(first(FIX) + then(SUBMIT), api_key=POLICY_KEY) as model:
        result = MilesShapedClient(driver.url).run_group(group_request(tasks[2], endpoint_of(model), 1))
    (trajectory,) = result["trajectories"]
    assert result["status"] == "completed"
    assert (trajectory["reward"], trajectory["metadata"]["zero_reason"]) == (0.0, "grade_failed")
    assert trajectory["metadata"]["grade"]["verdict"] == "error"


def journals(data: Path, group_id: str) -> list[Path]:
    return sorted(data.glob("groups/*/slot-*/journal.jsonl"))


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_delete_mid_group_cancels_within_one_turn(driver, tasks):
    before = sandbox_ids()
    client = MilesShapedClient(driver.url)
    with ScriptedModelServer(first("ls /app", 2) + then("ls /app", 40), api_key=POLICY_KEY, delay_s=1.0) as model:
        request = group_request(tasks[1], endpoint_of(model), 2)
        client.call("POST", "/rollout-groups", json=request)
        wait_for(lambda: len(model.requests) >= 4, 60, "two turns of each sample")
        started = time.monotonic()
        deleted = client.call("DELETE", f"/rollout-groups/{request['rollout_job_id']}")
        assert deleted == {"rollout_job_id": request["rollout_job_id"], "status": "cancelled"}
        assert time.monotonic() - started < 5
        asked = len(model.requests)
        wait_for(lambda: sandbox_ids() <= before, 30, "the samples' sandboxes to go")
        assert len(model.requests) <= asked + 2  # at most the turn each sample was in
    assert client.http.get(f"/rollout-groups/{request['rollout_job_id']}").status_code == 404


def polled(client: MilesShapedClient, request: dict, condition):
    """`condition`, checked while the client polls the group as Miles does (so it is not abandoned)."""
    return lambda: bool(client.call("GET", f"/rollout-groups/{request['rollout_job_id']}")) and condition()


def test_a_driver_killed_mid_group_carries_it_on_after_a_restart(tasks, tmp_path):
    config = write_config(tmp_path / "driver.json", tasks[0], abandon_after_s=10)  # the client comes back in time
    port = free_port()
    driver = DriverProcess(config, port).start()
    client = MilesShapedClient(driver.url)
    before, checkpoints = sandbox_ids(), {c.id for c in Store().checkpoints()}
    try:
        with ScriptedModelServer(first("ls /app", 4) + then("cat /app/calc.py", 4) + then(SUBMIT, 4),
                                 api_key=POLICY_KEY, delay_s=1.0) as model:
            request = group_request(tasks[1], endpoint_of(model), 2)
            client.call("POST", "/rollout-groups", json=request)
            wait_for(polled(client, request, lambda: len(model.requests) >= 2), 60, "the first turn of each sample")
            driver.stop(signal.SIGKILL)
            half_made = Store().root / "checkpoints" / f"cp-killed-{uuid.uuid4().hex[:8]}"  # killed mid-snapshot
            btrfs.create(half_made)
            # killed between a snapshot and its journal line: a checkpoint of the killed driver's sample
            unjournaled = Store().sandbox(sorted(sandbox_ids() - before)[0]).checkpoint(label="never journaled")
            try:
                driver = DriverProcess(config, port).start()
                assert not half_made.exists()  # the restarted driver cleaned up after the killed one
                assert unjournaled.id not in {c.id for c in Store().checkpoints()}
            finally:
                btrfs.delete(half_made)
            again = client.call("POST", "/rollout-groups", json=request)  # an identical re-POST: its status
            assert again == {"rollout_job_id": request["rollout_job_id"], "status": "running"}
            result = client.run_group(request, post=False)
        assert result["status"] == "completed" and result["actual_samples"] == 2
        assert sandbox_ids() <= before and {c.id for c in Store().checkpoints()} <= checkpoints
    finally:
        driver.stop()


def test_a_group_whose_client_never_comes_back_is_abandoned_and_released(tasks, tmp_path):
    """The driver is SIGKILLed mid-group, restarted, and no client polls again: the group is cancelled after
    abandon_after_s, keeping its finished sample; a driver killed while it releases the group finishes that."""
    config = write_config(tmp_path / "driver.json", tasks[0], abandon_after_s=6)
    port = free_port()
    driver = DriverProcess(config, port).start()
    client = MilesShapedClient(driver.url)
    before, checkpoints = sandbox_ids(), {c.id for c in Store().checkpoints()}
    # both samples' first turns, one submits at its second, the other (and its rerun) lists /app for ever
    script = first("ls /app", 3) + then(SUBMIT) + then("ls /app", 200)
    try:
        with ScriptedModelServer(script, api_key=POLICY_KEY, delay_s=1.0) as model:
            request = group_request(tasks[1], endpoint_of(model), 2, minimum_returned_samples=1)
            group = f"/rollout-groups/{request['rollout_job_id']}"
            client.call("POST", "/rollout-groups", json=request)
            wait_for(polled(client, request, lambda: client.call("GET", group)["actual_samples"] == 1), 90,
                     "one sample to finish")
            driver.stop(signal.SIGKILL)
            driver = DriverProcess(config, port).start()  # resumes the group; nobody asks after it
            wait_for(lambda: "abandoned" in driver.log.read_text(), 60, "the group to be abandoned")
            asked = len(model.requests)
            driver.stop(signal.SIGKILL)  # while its samples stop and its checkpoints are released
            driver = DriverProcess(config, port).start()
            wait_for(lambda: sandbox_ids() <= before, 30, "the samples' sandboxes to go")
            wait_for(lambda: {c.id for c in Store().checkpoints()} <= checkpoints, 30, "the checkpoints' release")
            assert len(model.requests) <= asked + 2  # at most the turn each sample was in
            result = client.call("GET", group)
            check_result(result, request)
            assert (result["status"], result["actual_samples"]) == ("cancelled", 1)  # the finished sample stays
            assert result["stop_reason"] == "abandoned: no client polled it for 6 s, so its samples were stopped"
            (failed,) = result["failed_samples"]
            assert failed["reason"] == result["stop_reason"]
            assert client.call("POST", "/rollout-groups", json=request) == {  # a late identical re-POST
                "rollout_job_id": request["rollout_job_id"], "status": "cancelled"}
            status = [json.loads(p.read_text()) for p in (tmp_path / "data").glob("groups/*/status.json")]
            assert status == [{"status": "cancelled", "reason": result["stop_reason"]}]
            assert client.call("DELETE", group)["status"] == "cancelled"
            assert client.http.get(group).status_code == 404
    finally:
        driver.stop()


def test_over_a_run_store_a_worker_killed_mid_group_still_yields_the_group(tasks, tmp_path):
    cfg = tmp_path / "cfg"
    assert services(cfg, "init", "--port", str(free_port()), "--slots", "2").returncode == 0
    up = services(cfg, "up", "runstore-api")
    workers: list[subprocess.Popen] = []
    driver = None
    before = sandbox_ids()

    def worker() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "sprout.worker", "serve", "--url", exports["SPROUT_RUNSTORE_URL"],
             "--token-file", str(cfg / "secrets" / "worker.token"), "--slots", "2", "--lease", "6"],
            cwd=REPO, env={**os.environ, "SPROUT_RUNTIME_BIN": str(RUNTIME_BIN),
                           "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    try:
        assert up.returncode == 0, up.stdout + up.stderr
        exports = dict(item.split("=", 1) for item in services(cfg, "env").stdout.split()[1:])
        workers.append(worker())
        driver = DriverProcess(write_config(tmp_path / "driver.json", tasks[0]), free_port(),
                               env=exports).start()
        with ScriptedModelServer(first("ls /app", 4) + then("cat /app/calc.py", 4) + then(SUBMIT, 4),
                                 delay_s=1.0) as model:  # workers call a URL a job names with no key
            request = group_request(tasks[1], endpoint_of(model), 2)

            def kill_the_worker_once(result: dict) -> None:
                if len(workers) == 1 and len(model.requests) >= 2:
                    workers[0].send_signal(signal.SIGKILL)
                    workers[0].wait()
                    workers.append(worker())  # takes the jobs once their leases expire

            result = MilesShapedClient(driver.url).run_group(request, on_running=kill_the_worker_once)
        assert len(workers) == 2, "the worker was not killed mid-group"
        assert result["status"] == "completed" and result["actual_samples"] == 2
        assert all(t["metadata"]["job_id"] for t in result["trajectories"])
        assert sandbox_ids() <= before
    finally:
        stop_fleet(driver, workers, cfg)


def stop_fleet(driver: "DriverProcess | None", workers: list[subprocess.Popen], cfg: Path) -> None:
    """Stops a test's driver, its workers (they drain) and its services."""
    if driver is not None:
        driver.stop()
    for proc in workers:
        proc.send_signal(signal.SIGTERM)
    for proc in workers:
        proc.wait(timeout=60)
    services(cfg, "down")


def test_samples_run_and_are_graded_in_microvms(tasks, tmp_path):
    """`backend: microvm` in the driver's config: each sample's rollout, checkpoints and grade are in VMs
    (with network, as py-bugfix's policy asks)."""
    config = write_config(tmp_path / "driver.json", tasks[0], backend="microvm", local_slots=2)
    process = DriverProcess(config, free_port()).start()
    script = first(FIX) + first("cat /proc/1/comm") + then(SUBMIT, 2)
    try:
        with ScriptedModelServer(script, api_key=POLICY_KEY) as model:
            # VMs boot under TCG here, beside three other test workers on two cores: a roomier wall budget
            request = group_request(tasks[1], endpoint_of(model), 2, budgets={"max_wall_time_seconds": 420.0})
            result = MilesShapedClient(process.url).run_group(request)
    finally:
        process.stop()
    assert result["status"] == "completed" and result["failed_samples"] == [], (
        result["stop_reason"], result["failed_samples"])
    assert sorted(t["reward"] for t in result["trajectories"]) == [0.0, 1.0]
    first_outputs = [t["messages"][3]["content"] for t in result["trajectories"]]
    assert any("sprout-agent" in output for output in first_outputs), first_outputs  # PID 1 of a VM
    assert all(t["metadata"]["touched_test_paths"] is None for t in result["trajectories"])
