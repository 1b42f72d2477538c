"""Model endpoints in jobs (sprout.jobs.endpoints): workers send only the keys of their own configured
endpoints. A real API process (started with --endpoints, as `services up` starts it), a real worker process
(its endpoints in $SPROUT_ENDPOINTS, as `services up` passes them) and scripted model servers on 127.0.0.1
that record every request: review jobs make one model call each, with no sandbox."""

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sprout.runstore.auth import Scope, hash_token, new_token
from sprout.runstore.client import RunStoreClient
from sprout.runstore.errors import InvalidPayload
from sprout.testing.scripted_model import ScriptedModelServer
from tests.conftest import REPO, free_port, wait_healthy

pytestmark = pytest.mark.python_only  # needs no podman (pytest -m python_only)

KEY_ENV = "SPROUT_ENDPOINT_TEST_KEY"
SECRET = "sk-worker-secret-do-not-leak"
BAIT_ENV = "SPROUT_ENDPOINT_TEST_BAIT"  # a variable of the worker's environment a submitter would like to read
BAIT = "sk-bait-do-not-leak"
ANSWER = [{"content": json.dumps({"branch_points": []})}] * 4
INPUT = {"instruction": "fix add()", "steps": [], "verifier_output": "FAILED test_add", "reward": 0.0, "points": 1,
         "max_calls": 10}


@dataclass
class Live:
    url: str
    submitter: RunStoreClient
    token: str
    keyed: ScriptedModelServer  # endpoint "default" of the worker: answers only with the worker's key
    plain: ScriptedModelServer  # a plain URL: records whatever Authorization it gets
    worker_log: Path


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("endpoints")
    tokens = {scope: new_token() for scope in Scope}
    (tmp / "tokens.json").write_text(json.dumps({hash_token(t): s.value for s, t in tokens.items()}))
    (tmp / "worker.token").write_text(tokens[Scope.WORKER])
    url = f"http://127.0.0.1:{free_port()}"
    processes: list[subprocess.Popen] = []
    with ScriptedModelServer(ANSWER, api_key=SECRET) as keyed, ScriptedModelServer(ANSWER) as plain:
        try:
            # the API accepts "default" and "gpu"; this host's worker has only "default"
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "sprout.runstore.api", "--db", str(tmp / "rs.db"), "--tokens",
                 str(tmp / "tokens.json"), "--port", url.rsplit(":", 1)[1], "--endpoints", "default,gpu",
                 "--log-level", "warning"], cwd=REPO))
            wait_healthy(url, processes[0])
            endpoints = json.dumps({"default": {"url": keyed.base_url, "key_env": KEY_ENV}})
            env = {**os.environ, "SPROUT_ENDPOINTS": endpoints, KEY_ENV: SECRET, BAIT_ENV: BAIT,
                   "OPENAI_API_KEY": BAIT, "SPROUT_MODEL_KEY_ENV": BAIT_ENV}
            log = tmp / "worker.log"
            with log.open("w") as out:
                processes.append(subprocess.Popen(
                    [sys.executable, "-m", "sprout.worker", "serve", "--url", url, "--token-file",
                     str(tmp / "worker.token"), "--kinds", "review", "--host-id", "endpoint-test"],
                    cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
            yield Live(url, RunStoreClient(url, tokens[Scope.SUBMITTER]), tokens[Scope.SUBMITTER], keyed, plain, log)
        finally:
            for process in reversed(processes):
                process.terminate()
                process.wait(30)


def review_payload(endpoint: dict) -> dict:
    return {"reviewer": {"model": "reviewer", "retries": 0}, "endpoint": endpoint, "input": INPUT,
            "review_id": "r1", "round": 1, "reviewed": "a1"}


def run(live: Live, payload: dict):
    job = live.submitter.submit("review", payload, max_attempts=1)
    deadline = time.monotonic() + 60
    while (job := live.submitter.get(job.id)).state not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"job {job.id} still {job.state}: {live.worker_log.read_text()}"
        time.sleep(0.1)
    return job


def post_job(live: Live, kind: str, payload: dict) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/jobs", json={"kind": kind, "payload": payload},
                      headers={"Authorization": f"Bearer {live.token}"}, timeout=10)


def test_a_named_endpoint_is_called_with_the_workers_configured_key(live):
    live.keyed.reset()
    job = run(live, review_payload({"name": "default"}))
    assert job.state == "succeeded", job.error
    assert job.payload["endpoint"]["name"] == "default"
    assert [r["status"] for r in live.keyed.requests] == [200]  # 401 unless it carries the configured key
    assert job.result["endpoint_host"] == live.keyed.base_url.split("/")[2]


def test_a_plain_url_is_called_with_no_worker_key(live):
    live.plain.reset()
    job = run(live, review_payload({"url": live.plain.base_url}))
    assert job.state == "succeeded", job.error
    (request,) = live.plain.requests
    assert request["path"].endswith("/chat/completions") and "authorization" not in request["headers"]
    # the same URL that serves the worker's own endpoint is not sent its key when given as a plain URL
    live.keyed.reset()
    run(live, review_payload({"url": live.keyed.base_url}))
    assert [r["status"] for r in live.keyed.requests] == [401]
    assert "authorization" not in live.keyed.requests[0]["headers"]


def test_an_unknown_endpoint_name_is_refused_at_submit_and_nothing_is_sent(live):
    live.keyed.reset()
    live.plain.reset()
    before = live.submitter.list(limit=100).jobs
    response = post_job(live, "review", review_payload({"name": "elsewhere"}))
    assert response.status_code == 422
    assert response.json()["error"] == "InvalidPayload"
    assert "no endpoint named 'elsewhere' is configured on this Run Store (configured: default, gpu" in (
        response.json()["detail"])
    with pytest.raises(InvalidPayload, match="no endpoint named 'elsewhere'"):
        live.submitter.submit("rollout", {"task": "t", "model": "m", "options": {
            "endpoint": {"name": "elsewhere"}, "journal": "/tmp/never.jsonl"}})
    time.sleep(1.0)  # a worker that had been given the job would have called by now
    assert live.submitter.list(limit=100).jobs == before
    assert live.keyed.requests == [] and live.plain.requests == []


def test_a_name_the_worker_lacks_fails_the_job_without_any_call(live):
    live.keyed.reset()
    job = run(live, review_payload({"name": "gpu"}))  # the API knows it (another host's), this worker does not
    assert job.state == "failed"
    assert "on this worker: no endpoint named 'gpu' is configured (configured: default" in job.error
    assert live.keyed.requests == []


@pytest.mark.parametrize(("kind", "payload", "problem"), [
    ("review", review_payload({"url": "http://127.0.0.1:1/v1", "key_env": BAIT_ENV}),
     "endpoint.key_env: Extra inputs are not permitted"),
    ("review", {**review_payload({"name": "default"}), "reviewer": {"model": "m", "key_env": BAIT_ENV}},
     "reviewer.key_env: Extra inputs are not permitted"),
    ("rollout", {"task": "t", "model": "m", "options": {"endpoint": {"url": "http://127.0.0.1:1/v1"},
                                                        "key_env": BAIT_ENV, "journal": "/tmp/j.jsonl"}},
     "options.key_env: Extra inputs are not permitted"),
    ("rollout", {"task": "t", "model": "m", "options": {"endpoint": {"name": "default", "key_env": BAIT_ENV},
                                                        "journal": "/tmp/j.jsonl"}},
     "options.endpoint.key_env: Extra inputs are not permitted"),
    ("rollout", {"task": "t", "model": "m", "options": {"endpoint": "http://127.0.0.1:1/v1", "key_env": BAIT_ENV,
                                                        "journal": "/tmp/j.jsonl"}},  # the old shape
     "options.key_env: Extra inputs are not permitted"),
    ("rollout", {"task": "t", "model": "m", "options": {"endpoint": {"name": "default", "url": "http://x/v1"},
                                                        "journal": "/tmp/j.jsonl"}},
     'exactly one of "name"'),
], ids=["review-endpoint", "reviewer", "rollout-options", "rollout-endpoint", "old-shape", "name-and-url"])
def test_a_payload_naming_a_key_variable_is_refused(live, kind, payload, problem):
    response = post_job(live, kind, payload)
    assert response.status_code == 422, response.text
    assert problem in response.json()["detail"]
