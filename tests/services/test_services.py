"""`python -m sprout.services`: init/setup files, up/status/env/down, and a job through the API and worker."""

import json
import os
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sprout.agent.journal import read_journal
from sprout.jobs.endpoints import ConfiguredEndpoint
from sprout.runstore.client import RunStoreClient
from sprout.runstore.errors import InvalidPayload
from sprout.sandbox import Store
from sprout.services import supervisor
from sprout.services.config import load
from sprout.testing.scripted_model import ScriptedModelServer
from sprout.worker.serve import STOP_GRACE_S
from tests.conftest import REPO, free_port, turns_so_far


def services(config_dir: Path, *args: str, stdin: str | None = None, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "sprout.services", *args], cwd=REPO, input=stdin, text=True,
                          capture_output=True, timeout=120,
                          env={**os.environ, "SPROUT_CONFIG_DIR": str(config_dir), **(env or {})})


def test_init_then_setup_with_scripted_answers(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    flags = ["--model-endpoint", "http://127.0.0.1:9999/v1", "--model-key-env", "MY_KEY", "--port", "18471",
             "--slots", "3"]
    assert services(a, "init", *flags).returncode == 0
    answers = "http://127.0.0.1:9999/v1\nMY_KEY\n18471\n3\n"
    setup = services(b, "setup", stdin=answers)
    assert "host checks" in setup.stdout
    assert json.loads((a / "services.json").read_text()) == json.loads((b / "services.json").read_text())
    for scope in ("admin", "worker", "submitter"):
        assert stat.S_IMODE((b / "secrets" / f"{scope}.token").stat().st_mode) == 0o600
    assert stat.S_IMODE((b / "secrets" / "tokens.json").stat().st_mode) == 0o600
    token = (b / "secrets" / "submitter.token").read_text().strip()
    assert token not in (b / "secrets" / "tokens.json").read_text()  # stored hashed
    before = (b / "services.json").read_text()
    again = services(b, "setup", stdin="http://elsewhere:1/v1\nOTHER\n18471\n3\nn\n")
    assert "replace" in again.stdout and "---" in again.stdout  # showed a diff and asked
    assert (b / "services.json").read_text() == before
    assert "kept" in again.stdout
    init_again = services(a, "init", "--port", "18472")
    assert "differs" in init_again.stdout and json.loads((a / "services.json").read_text())["runstore_port"] == 18471


def test_named_endpoints_in_services_json_reach_the_api_and_the_worker_but_no_key_value(tmp_path):
    old = tmp_path / "old"  # a services.json from before named endpoints
    old.mkdir()
    (old / "services.json").write_text(json.dumps({"model_endpoint": "http://127.0.0.1:9999/v1",
                                                   "model_key_env": "MY_KEY", "runstore_port": 18473}))
    assert load(old).endpoints == {"default": ConfiguredEndpoint(url="http://127.0.0.1:9999/v1", key_env="MY_KEY")}
    flags = ["--endpoint", "gpu=http://10.0.0.2:8000/v1/", "--endpoint-key-env", "gpu=GPU_KEY",
             "--endpoint", "policy=http://127.0.0.1:11002/v1", "--force"]
    init = services(old, "init", *flags, env={"MY_KEY": "sk-value-never-in-files"})
    assert init.returncode == 0, init.stdout + init.stderr
    written = json.loads((old / "services.json").read_text())
    assert "model_endpoint" not in written and "model_key_env" not in written
    assert written["endpoints"] == {"default": {"url": "http://127.0.0.1:9999/v1", "key_env": "MY_KEY"},
                                    "gpu": {"url": "http://10.0.0.2:8000/v1", "key_env": "GPU_KEY"},
                                    "policy": {"url": "http://127.0.0.1:11002/v1", "key_env": None}}
    config = load(old)
    assert supervisor.command("runstore-api", config, old)[-2:] == ["--endpoints", "default,gpu,policy"]
    env = supervisor.service_env(config)
    assert json.loads(env["SPROUT_ENDPOINTS"]) == written["endpoints"]
    assert "sk-value-never-in-files" not in (old / "services.json").read_text() + env["SPROUT_ENDPOINTS"]
    bad = services(old, "init", "--endpoint-key-env", "nope=X", "--force")
    assert bad.returncode == 1 and "no endpoint 'nope'" in bad.stderr and "Traceback" not in bad.stderr
    bad = services(old, "init", "--endpoint", "gpu=ftp://x", "--force")
    assert bad.returncode == 1 and "must be an http(s) URL" in bad.stderr and "Traceback" not in bad.stderr


def test_up_status_env_rollout_job_down(tmp_path):
    config = tmp_path / "cfg"
    port = free_port()
    script = [{"thought": "hi", "command": "echo hello > /tmp/x && cat /tmp/x"},
              {"thought": "done", "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]
    with ScriptedModelServer(script, api_key="sk-test") as model:  # 401 unless the worker passes the key
        assert services(config, "init", "--port", str(port), "--model-endpoint", model.base_url).returncode == 0
        env = {"SPROUT_MODEL_API_KEY": "sk-test", "OPENAI_API_KEY": "sk-test"}  # neither goes to a plain URL
        up = services(config, "up", "runstore-api", "runstore-worker", env=env)
        try:
            assert up.returncode == 0, up.stdout + up.stderr
            assert "runstore-api up" in up.stdout and "runstore-worker up" in up.stdout
            assert "already up" in services(config, "up", "runstore-api", env=env).stdout
            status = services(config, "status")
            assert status.returncode == 0 and status.stdout.count("healthy") == 2 and str(port) in status.stdout
            exports = services(config, "env").stdout.strip()
            assert exports.startswith("export SPROUT_RUNSTORE_URL=http://127.0.0.1:")
            url = exports.split("SPROUT_RUNSTORE_URL=")[1].split()[0]
            token = exports.split("SPROUT_RUNSTORE_TOKEN=")[1].strip()
            client = RunStoreClient(url, token)
            journal = tmp_path / "job.jsonl"
            with pytest.raises(InvalidPayload, match="no endpoint named 'elsewhere' is configured"):
                client.submit("rollout", {"task": "say hello", "model": "scripted", "options": {
                    "endpoint": {"name": "elsewhere"}, "journal": str(journal)}})
            job = client.submit("rollout", {"task": "say hello", "model": "scripted",  # the worker's key
                                            "options": {"endpoint": {"name": "default"}, "journal": str(journal)}})
            done = wait_done(client, job.id)
            assert done.state == "succeeded", done.error
            assert done.result["outcome"]["status"] == "submitted" and done.result["journal"] == str(journal)
            assert "hello" in read_journal(journal).turns[0].observation
            assert [r["status"] for r in model.requests] == [200, 200]
            model.reset()  # the same server as a plain URL: the worker sends no key of its own, so 401
            plain = tmp_path / "plain.jsonl"
            job = client.submit("rollout", {"task": "say hello", "model": "scripted", "options": {
                "endpoint": {"url": model.base_url}, "journal": str(plain)}}, max_attempts=1)
            wait_done(client, job.id)
            assert model.requests and {r["status"] for r in model.requests} == {401}
        finally:
            down = services(config, "down")
        assert "stopped" in down.stdout
        assert services(config, "status").stdout.count("not running") == 2
    store = Store()
    for path in (journal, plain):
        for turn in read_journal(path).turns if path.exists() else []:
            store.remove_checkpoint(turn.checkpoint, force=True)


def test_up_refuses_a_port_another_process_holds(tmp_path):
    """Another user's Run Store on the configured port answers /health too: `up` must not take it for its
    own (its worker would then talk to the other user's API), but say whose port it is not and how to move."""
    config, port = tmp_path / "cfg", free_port()
    assert services(config, "init", "--port", str(port), "--model-endpoint", "http://127.0.0.1:9/v1").returncode == 0

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    other = ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        up = services(config, "up", "runstore-api")
        assert up.returncode != 0 and "Traceback" not in up.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in up.stdout + up.stderr
        assert "sprout services init --port N" in up.stdout + up.stderr
        assert supervisor.read_pid("runstore-api", config) is None
    finally:
        services(config, "down")
        other.shutdown()
        other.server_close()


def test_a_service_that_exits_while_starting_says_why_from_its_log(tmp_path):
    config, nothing_there = tmp_path / "cfg", free_port()
    db = f"postgresql+psycopg://sprout:secret-pw@127.0.0.1:{nothing_there}/none"
    assert services(config, "init", "--port", str(free_port()), "--db", db).returncode == 0
    up = services(config, "up", "runstore-api")
    assert up.returncode == 1 and "Traceback" not in up.stderr, up.stderr
    assert "runstore-api exited while starting; its log" in up.stderr
    assert "cannot open database" in up.stderr and "Connection refused" in up.stderr and "secret-pw" not in up.stderr
    assert "not running" in services(config, "status").stdout  # the supervisor was stopped too


def wait_done(client: RunStoreClient, job_id: int, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and client.get(job_id).state not in ("succeeded", "failed"):
        time.sleep(0.5)
    return client.get(job_id)


@pytest.mark.rootless
def test_gate_through_the_run_store_gives_the_in_process_summary(tmp_path):
    config, port = tmp_path / "cfg", free_port()
    tasks = REPO / "tests" / "fixtures" / "tasks"
    assert services(config, "init", "--port", str(port), "--slots", "3").returncode == 0
    assert services(config, "up", "runstore-api", "runstore-worker").returncode == 0
    try:
        exports = services(config, "env").stdout.split()
        remote_env = dict(item.split("=", 1) for item in exports[1:])
        gate = [sys.executable, "-m", "sprout.eval.gate", "--tasks-dir", str(tasks), "--workers", "3",
                "--runtime-bin", str(REPO / "runtime" / "sprout-runtime")]
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("SPROUT_RUNSTORE")}
        remote = subprocess.run([*gate, "--output", str(tmp_path / "remote")], cwd=REPO, capture_output=True,
                                text=True, timeout=600, env={**base_env, **remote_env})
        jobs = RunStoreClient(remote_env["SPROUT_RUNSTORE_URL"], remote_env["SPROUT_RUNSTORE_TOKEN"]).list(kind="gate")
    finally:
        services(config, "down")
    local = subprocess.run([*gate, "--output", str(tmp_path / "local")], cwd=REPO, capture_output=True, text=True,
                           timeout=600, env=base_env)
    assert remote.returncode == local.returncode == 1, remote.stdout + remote.stderr  # fixtures fail on purpose

    def reward(attempt: dict | None) -> float | str | None:  # an attempt that could not be graded: its error
        return attempt and (attempt["grade"]["reward"] if attempt["grade"] else f"error: {attempt['error']}")

    def verdicts(path: Path) -> dict:
        summary = json.loads((path / "summary.json").read_text())
        return {r["task"]: (r["verdict"], reward(r["oracle"]), reward(r["nop"])) for r in summary["results"]}

    assert verdicts(tmp_path / "remote") == verdicts(tmp_path / "local")
    assert verdicts(tmp_path / "local")["py-bugfix"] == ("pass", 1.0, 0.0)
    assert len(jobs.jobs) == 5 and all(j.state == "succeeded" for j in jobs.jobs)  # malformed-toml never ran
    assert (tmp_path / "remote" / "py-bugfix" / "gate.log").exists()


def test_down_mid_rollout_stops_the_job_and_releases_it(tmp_path):
    config = tmp_path / "cfg"
    slow = [{"thought": "work", "command": "sleep 0.3", "delay_s": 0.3}] * 40
    with ScriptedModelServer(slow) as model:
        init = services(config, "init", "--port", str(free_port()), "--model-endpoint", model.base_url,
                        "--drain-timeout", "1")
        assert init.returncode == 0, init.stderr
        assert load(config).worker_drain_s == 1
        assert supervisor.stop_timeout("runstore-worker", load(config)) > 1 + STOP_GRACE_S
        env = {"SPROUT_MODEL_API_KEY": "unused"}
        up = services(config, "up", "runstore-api", "runstore-worker", env=env)
        try:
            assert up.returncode == 0, up.stdout + up.stderr
            exports = services(config, "env").stdout.strip()
            client = RunStoreClient(exports.split("SPROUT_RUNSTORE_URL=")[1].split()[0],
                                    exports.split("SPROUT_RUNSTORE_TOKEN=")[1].strip())
            journal = tmp_path / "drained.jsonl"
            job = client.submit("rollout", {"task": "work", "model": "scripted", "options": {
                "endpoint": {"url": model.base_url}, "journal": str(journal), "step_limit": 100}})
            deadline = time.monotonic() + 60
            while not turns_so_far(journal):
                assert time.monotonic() < deadline, "no turn in 60 s"
                time.sleep(0.2)
            sandbox_id = read_journal(journal).header.sandbox
            started = time.monotonic()
            down = services(config, "down")
            assert "runstore-worker stopped" in down.stdout
            assert time.monotonic() - started < 30  # the drain (1 s) and one turn, not the supervisor's limit
        finally:
            services(config, "down")
        log = (config / "logs" / "runstore-worker.log").read_text()
        assert f"job {job.id} stopped" in log and f"releasing job {job.id}" in log
        assert not journal.exists()
        assert sandbox_id not in {s.id for s in Store().sandboxes()}
