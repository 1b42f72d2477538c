"""The HTTP API and its client, against a live uvicorn on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn

from sprout.jobs.payloads import job_kinds
from sprout.runstore import (
    BodyTooLarge,
    EventType,
    Forbidden,
    HostNotFound,
    InvalidTransition,
    JobNotFound,
    JobState,
    LeaseLost,
    RunStoreError,
    Unauthorized,
    UnknownKind,
)
from sprout.runstore.api import create_app
from sprout.runstore.auth import Scope, hash_token, new_token
from sprout.runstore.client import RunStoreClient
from sprout.runstore.store import RunStore
from tests.conftest import free_port

pytestmark = pytest.mark.python_only  # needs no podman (pytest -m python_only)

GATE = {"task_dir": "tasks/t1"}
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LiveApi:
    url: str
    tokens: dict[Scope, str]
    store: RunStore

    def client(self, scope: Scope, **kwargs: object) -> RunStoreClient:
        return RunStoreClient(self.url, self.tokens[scope], **kwargs)  # type: ignore[arg-type]


@contextmanager
def serve(app: object) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def live_api(db_url: str, poll_s: float = 0.1) -> Iterator[LiveApi]:
    """The API over a fresh store; `poll_s`: how often a long-poll looks at the database itself."""
    tokens = {scope: new_token() for scope in Scope}
    store = RunStore(db_url, job_kinds())
    try:
        with serve(create_app(store, {hash_token(t): s.value for s, t in tokens.items()}, poll_s=poll_s)) as url:
            yield LiveApi(url, tokens, store)
    finally:
        store.close()


@pytest.fixture
def api(db_url: str) -> Iterator[LiveApi]:
    with live_api(db_url) as live:
        yield live


SUBMITTER_ROUTES = [
    ("POST", "/v1/jobs", {"kind": "gate", "payload": GATE}),
    ("POST", "/v1/jobs/batch", {"jobs": [{"kind": "gate", "payload": GATE}]}),
    ("GET", "/v1/jobs", None),
    ("GET", "/v1/jobs/1", None),
    ("POST", "/v1/jobs/1/cancel", None),
    ("GET", "/v1/groups/g/events", None),
]
WORKER_ROUTES = [
    ("POST", "/v1/claims", {"worker_id": "w", "host": "h"}),
    ("POST", "/v1/jobs/1/heartbeat", {"lease_token": 1}),
    ("POST", "/v1/jobs/1/complete", {"lease_token": 1}),
    ("POST", "/v1/jobs/1/fail", {"lease_token": 1, "error": "e"}),
    ("POST", "/v1/jobs/1/release", {"lease_token": 1}),
    ("PUT", "/v1/hosts/h", {"ship_url": "http://h:1"}),
    ("GET", "/v1/hosts/h", None),
]


def test_health_and_docs_need_no_token(api: LiveApi) -> None:
    health = httpx.get(f"{api.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["schema_version"] == 4
    assert httpx.get(f"{api.url}/docs").status_code == 200
    spec = httpx.get(f"{api.url}/openapi.json").json()
    assert "/v1/claims" in spec["paths"] and "HTTPBearer" in spec["components"]["securitySchemes"]


def test_tokens_and_scopes(api: LiveApi) -> None:
    http = httpx.Client(base_url=api.url)

    def status(method: str, path: str, body: object, token: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return http.request(method, path, json=body, headers=headers)

    bogus = new_token()
    for routes, right, wrong in (
        (SUBMITTER_ROUTES, Scope.SUBMITTER, Scope.WORKER),
        (WORKER_ROUTES, Scope.WORKER, Scope.SUBMITTER),
    ):
        for method, path, body in routes:
            missing = status(method, path, body, None)
            assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer", path
            assert missing.json()["error"] == "Unauthorized"
            unknown = status(method, path, body, bogus)
            assert unknown.status_code == 401 and bogus not in unknown.text, path
            forbidden = status(method, path, body, api.tokens[wrong])
            assert forbidden.status_code == 403, path
            assert api.tokens[wrong] not in forbidden.text
            for scope in (right, Scope.ADMIN):
                assert status(method, path, body, api.tokens[scope]).status_code not in (401, 403), (
                    path,
                    scope,
                )
    basic = http.get("/v1/jobs", headers={"Authorization": "Basic dXNlcjpwYXNz"})
    assert basic.status_code == 401
    http.close()


def test_client_round_trip_and_typed_errors(api: LiveApi) -> None:
    sub, work = api.client(Scope.SUBMITTER), api.client(Scope.WORKER)
    job = sub.submit("grade", {"checkpoint_id": "c1", "task_dir": "t"}, group_id="g", priority=3)
    assert job.state == JobState.QUEUED and job.idempotency_key  # the client adds one
    again = sub.submit_many(
        [{"kind": "grade", "payload": job.payload, "idempotency_key": job.idempotency_key}]
    )
    assert again[0].id == job.id
    (claim,) = work.claim("w1", "h1", kinds=["grade"], lease_s=30)
    assert claim.job.id == job.id and claim.lease_token == 1
    assert work.heartbeat(job.id, claim.lease_token, extend_s=30).state == JobState.LEASED
    done = work.complete(job.id, claim.lease_token, {"score": 0.5})
    assert done.state == JobState.SUCCEEDED and done.result == {"score": 0.5}
    assert sub.get(job.id) == done
    assert [j.id for j in sub.list(group_id="g", state="succeeded").jobs] == [job.id]
    assert [e.type for e in sub.events("g")] == [EventType.SUBMITTED, EventType.LEASED, EventType.SUCCEEDED]

    with pytest.raises(LeaseLost, match="is over: the job is succeeded"):
        work.fail(job.id, claim.lease_token, "late")
    with pytest.raises(JobNotFound, match="job 999 not found"):
        sub.get(999)
    with pytest.raises(UnknownKind, match="unknown job kind 'nope'"):
        sub.submit("nope", {})
    with pytest.raises(InvalidTransition):
        sub.cancel(job.id)
    with pytest.raises(Forbidden, match="a worker token may not do submitter operations"):
        work.submit("gate", GATE)
    with pytest.raises(Unauthorized):
        RunStoreClient(api.url, "wrong").get(job.id)

    other = sub.submit("gate", GATE)
    (claim,) = work.claim("w1", "h1")
    assert work.release(other.id, claim.lease_token).state == JobState.QUEUED
    (claim,) = work.claim("w1", "h1")
    assert work.fail(other.id, claim.lease_token, "no", retry=False).state == JobState.FAILED


def test_hosts_register_and_are_looked_up(api: LiveApi) -> None:
    work = api.client(Scope.WORKER)
    with pytest.raises(HostNotFound, match="no worker has registered host 'h9'"):
        work.host("h9")
    first = work.register_host("h9", "http://10.0.0.9:8471")
    assert work.host("h9") == first and first.ship_url == "http://10.0.0.9:8471"
    moved = work.register_host("h9", None)  # re-registering replaces, e.g. after a restart without a server
    assert work.host("h9").ship_url is None and work.host("h9").seen_at >= moved.seen_at - timedelta(seconds=1)
    with pytest.raises(Forbidden):
        api.client(Scope.SUBMITTER).host("h9")


def test_claim_long_poll_is_woken_by_a_submit(db_url: str) -> None:
    # The API polls the database only every 60 s here, far past the wait: only the submit's wake-up
    # can end the long-poll with the job.
    with live_api(db_url, poll_s=60) as api:
        sub, work = api.client(Scope.SUBMITTER), api.client(Scope.WORKER)
        started = time.monotonic()
        assert work.claim("w1", "h1", wait_s=0.5) == []
        assert time.monotonic() - started >= 0.45, "an empty long-poll must wait for its wait_s"
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(work.claim, "w1", "h1", wait_s=20)
            time.sleep(0.3)
            job = sub.submit("gate", GATE)
            claims = waiting.result(timeout=15)
        assert [c.job.id for c in claims] == [job.id], "the long-poll was not woken by the submit"


def test_claim_long_poll_finds_a_job_queued_behind_its_back(api: LiveApi) -> None:
    # A job queued by another process (straight into the store) wakes nobody: the poll finds it.
    work = api.client(Scope.WORKER)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(work.claim, "w1", "h1", wait_s=20)
        time.sleep(0.2)
        direct = api.store.submit("gate", GATE)
        (claim,) = waiting.result(timeout=10)
    assert claim.job.id == direct.id


def test_events_long_poll_and_stream(api: LiveApi) -> None:
    sub, work = api.client(Scope.SUBMITTER), api.client(Scope.WORKER)
    with ThreadPoolExecutor(2) as pool:
        polled = pool.submit(sub.events, "g", 0, 1000, 20)

        def follow() -> list[EventType]:
            seen = []
            for event in sub.stream_events("g"):
                seen.append(event.type)
                if event.type == EventType.SUCCEEDED:
                    return seen
            return seen

        streamed = pool.submit(follow)
        time.sleep(0.3)
        job = sub.submit("gate", GATE, group_id="g")
        assert [e.job_id for e in polled.result(timeout=10)] == [job.id]
        (claim,) = work.claim("w1", "h1")
        work.complete(job.id, claim.lease_token)
        assert streamed.result(timeout=10) == [EventType.SUBMITTED, EventType.LEASED, EventType.SUCCEEDED]
    events = sub.events("g")
    resumed = sub.stream_events("g", after_seq=events[0].seq)  # resumes via Last-Event-ID
    assert next(resumed) == events[1]
    resumed.close()


def start_server(db_url: str, tokens_file: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "sprout.runstore.api", "--db", db_url, "--tokens", str(tokens_file)]
        + ["--port", str(port), "--log-level", "warning", *extra],
        cwd=ROOT,
    )


def test_client_survives_api_restart(db_url: str, tmp_path: Path) -> None:
    token = new_token()
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps({hash_token(token): "admin"}))
    port = free_port()
    client = RunStoreClient(f"http://127.0.0.1:{port}", token, retry_for_s=30)
    server = start_server(db_url, tokens_file, port)
    try:
        client.health()  # retried until the server is up
        job = client.submit("gate", GATE)
        server.terminate()
        server.wait(10)
        with ThreadPoolExecutor(1) as pool:
            during = pool.submit(client.claim, "w1", "h1")  # the API is down: retried
            time.sleep(1.0)
            assert not during.done()
            server = start_server(db_url, tokens_file, port)
            (claim,) = during.result(timeout=30)
        assert claim.job.id == job.id
        assert client.complete(job.id, claim.lease_token).state == JobState.SUCCEEDED
    finally:
        server.terminate()
        server.wait(10)
        client.close()


def test_serve_errors_are_one_line(tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps({hash_token(new_token()): "worker"}))
    cases = [
        (["--db", "mysql://u@h/db", "--tokens", str(tokens_file)], "error: unsupported database 'mysql'"),
        (["--db", str(tmp_path / "s.db"), "--tokens", str(tmp_path / "nope.json")], "error: tokens file"),
    ]
    for args, message in cases:
        done = subprocess.run(
            [sys.executable, "-m", "sprout.runstore.api", *args],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2
        assert done.stderr.startswith(message) and "Traceback" not in done.stderr, done.stderr


def test_client_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPROUT_RUNSTORE_URL", raising=False)
    monkeypatch.delenv("SPROUT_RUNSTORE_TOKEN", raising=False)
    with pytest.raises(RunStoreError, match="set SPROUT_RUNSTORE_URL and SPROUT_RUNSTORE_TOKEN"):
        RunStoreClient.from_env()
    monkeypatch.setenv("SPROUT_RUNSTORE_URL", "http://127.0.0.1:1/")
    monkeypatch.setenv("SPROUT_RUNSTORE_TOKEN", "t")
    with RunStoreClient.from_env() as client:
        assert client.url == "http://127.0.0.1:1"


def test_client_gives_up_after_retry_window() -> None:
    client = RunStoreClient(f"http://127.0.0.1:{free_port()}", "t", retry_for_s=0.3)
    started = time.monotonic()
    with pytest.raises(RunStoreError, match="cannot reach the Run Store"):
        client.get(1)
    assert time.monotonic() - started < 5


# -- hostile requests: authentication before the body, body size cap, numbers out of range ----


def send_partial(url: str, head: str, body_start: bytes = b"") -> tuple[int, dict[str, object]]:
    """Send a request's head and only the first bytes of its body, then read the response.
    A server that reads the whole body before answering never answers: the read times out."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(head.encode() + body_start)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())


def post_head(path: str, headers: dict[str, str]) -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return "\r\n".join(lines) + "\r\n\r\n"


def test_unauthenticated_requests_are_refused_before_their_body_is_read(api: LiveApi) -> None:
    fifty_mb = {"Content-Length": str(50 * 1024 * 1024)}
    for auth in ({}, {"Authorization": f"Bearer {new_token()}"}, {"Authorization": "Basic dXNlcjpwYXNz"}):
        # 1 MiB of a declared 50 MB body: the 401 must come while 49 MB are still unsent.
        status, body = send_partial(api.url, post_head("/v1/jobs", fifty_mb | auth), b"[" * 2**20)
        assert status == 401 and body["error"] == "Unauthorized", (auth, body)
    malformed = httpx.post(f"{api.url}/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert malformed.status_code == 401 and malformed.json()["error"] == "Unauthorized"
    assert malformed.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{api.url}/health").json()["status"] == "ok"  # the server is fine afterwards
    # A real token gets on to the body: malformed JSON is then the client's error.
    token = {"Authorization": f"Bearer {api.tokens[Scope.SUBMITTER]}", "Content-Type": "application/json"}
    parsed = httpx.post(f"{api.url}/v1/jobs", content=b"{not json", headers=token)
    assert parsed.status_code == 422 and parsed.json()["error"] == "InvalidRequest"


@pytest.fixture
def capped_api(db_url: str) -> Iterator[LiveApi]:
    """The API with a 4 KiB body limit."""
    tokens = {scope: new_token() for scope in Scope}
    store = RunStore(db_url, job_kinds())
    table = {hash_token(t): s.value for s, t in tokens.items()}
    with serve(create_app(store, table, poll_s=0.1, max_body_bytes=4096)) as url:
        yield LiveApi(url, tokens, store)
    store.close()


def test_bodies_over_the_limit_get_413(capped_api: LiveApi) -> None:
    api = capped_api
    auth = {"Authorization": f"Bearer {api.tokens[Scope.SUBMITTER]}"}
    # By Content-Length: refused before any of the body is sent.
    status, body = send_partial(api.url, post_head("/v1/jobs", auth | {"Content-Length": "4097"}))
    assert (status, body["error"]) == (413, "BodyTooLarge")
    assert body["detail"] == "the request body is over the limit of 4096 bytes"
    # Chunked, no Content-Length: refused once 4 KiB have arrived, before the body ends.
    chunk = b"800\r\n" + b" " * 0x800 + b"\r\n"
    status, body = send_partial(api.url, post_head("/v1/jobs", auth | {"Transfer-Encoding": "chunked"}), chunk * 3)
    assert (status, body["error"]) == (413, "BodyTooLarge")
    # No token: 401 comes first, whatever the size.
    status, body = send_partial(api.url, post_head("/v1/jobs", {"Content-Length": "99999999"}))
    assert (status, body["error"]) == (401, "Unauthorized")

    sub = api.client(Scope.SUBMITTER)
    with pytest.raises(BodyTooLarge, match="over the limit of 4096 bytes"):
        sub.submit("gate", {"task_dir": "t" * 5000})

    def chunks(size: int) -> Iterator[bytes]:
        data = json.dumps({"kind": "gate", "payload": {"task_dir": "t" * size}}).encode()
        yield from (data[i : i + 1000] for i in range(0, len(data), 1000))

    json_auth = auth | {"Content-Type": "application/json"}
    streamed = httpx.post(f"{api.url}/v1/jobs", content=chunks(5000), headers=json_auth)
    assert streamed.status_code == 413 and streamed.json()["error"] == "BodyTooLarge"
    small = httpx.post(f"{api.url}/v1/jobs", content=chunks(3000), headers=json_auth)  # chunked, under the limit
    assert small.status_code == 201 and small.json()["payload"]["task_dir"] == "t" * 3000
    assert sub.submit("gate", {"task_dir": "t" * 3000}).state == JobState.QUEUED


def test_max_body_bytes_flag(tmp_path: Path) -> None:
    token = new_token()
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps({hash_token(token): "admin"}))
    port = free_port()
    client = RunStoreClient(f"http://127.0.0.1:{port}", token, retry_for_s=30)
    server = start_server(str(tmp_path / "s.db"), tokens_file, port, "--max-body-bytes", "2048")
    try:
        client.health()
        assert client.submit("gate", {"task_dir": "t" * 1000}).state == JobState.QUEUED
        with pytest.raises(BodyTooLarge, match="over the limit of 2048 bytes"):
            client.submit("gate", {"task_dir": "t" * 3000})
    finally:
        server.terminate()
        server.wait(10)
        client.close()
    bad = subprocess.run(
        [sys.executable, "-m", "sprout.runstore.api", "--db", "x.db", "--tokens", "t.json", "--max-body-bytes", "0"],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--max-body-bytes: must be at least 1, not 0" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_numbers_out_of_range_get_422(api: LiveApi) -> None:
    sub, work = api.client(Scope.SUBMITTER), api.client(Scope.WORKER)
    job = sub.submit("gate", GATE)
    (claim,) = work.claim("w1", "h1")
    http = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {api.tokens[Scope.ADMIN]}"})
    huge, top, bottom = 2**80, 2**63 - 1, -(2**63)
    cases: list[tuple[str, str, dict[str, object], object, str]] = [
        ("GET", f"/v1/jobs/{huge}", {}, None, "path.job_id"),
        ("GET", f"/v1/jobs/{top + 1}", {}, None, "path.job_id"),
        ("GET", f"/v1/jobs/{bottom - 1}", {}, None, "path.job_id"),
        ("POST", f"/v1/jobs/{huge}/cancel", {}, None, "path.job_id"),
        ("POST", f"/v1/jobs/{huge}/heartbeat", {}, {"lease_token": 1}, "path.job_id"),
        ("GET", "/v1/jobs", {"cursor": huge}, None, "query.cursor"),
        ("GET", "/v1/jobs", {"cursor": -huge}, None, "query.cursor"),
        ("GET", "/v1/groups/g/events", {"after_seq": huge}, None, "query.after_seq"),
        ("POST", f"/v1/jobs/{job.id}/heartbeat", {}, {"lease_token": huge}, "body.lease_token"),
        ("POST", f"/v1/jobs/{job.id}/complete", {}, {"lease_token": -huge}, "body.lease_token"),
        ("POST", f"/v1/jobs/{job.id}/fail", {}, {"lease_token": huge, "error": "e"}, "body.lease_token"),
        ("POST", f"/v1/jobs/{job.id}/release", {}, {"lease_token": huge}, "body.lease_token"),
        ("POST", "/v1/jobs", {}, {"kind": "gate", "payload": GATE, "priority": 2**31}, "body.priority"),
        ("POST", "/v1/jobs", {}, {"kind": "gate", "payload": GATE, "parent_id": huge}, "body.parent_id"),
    ]
    for method, path, params, body, where in cases:
        resp = http.request(method, path, params=params, json=body)
        assert resp.status_code == 422, (path, params, body, resp.text)
        assert resp.json()["error"] == "InvalidRequest" and resp.json()["detail"].startswith(f"{where}: "), resp.text
    streamed = http.get("/v1/groups/g/events", headers={"Accept": "text/event-stream", "Last-Event-ID": str(huge)})
    assert streamed.status_code == 422 and streamed.json()["detail"].startswith("header.last-event-id: ")

    # The extremes that are in range reach the database, which answers without a 500.
    assert http.get(f"/v1/jobs/{top}").json()["error"] == "JobNotFound"
    assert http.get(f"/v1/jobs/{bottom}").json()["error"] == "JobNotFound"
    assert http.get("/v1/jobs", params={"cursor": top}).json()["jobs"] == []
    assert http.get("/v1/groups/g/events", params={"after_seq": top}).json() == []
    assert http.post(f"/v1/jobs/{job.id}/heartbeat", json={"lease_token": top}).json()["error"] == "LeaseLost"
    assert http.post(f"/v1/jobs/{job.id}/release", json={"lease_token": bottom}).json()["error"] == "LeaseLost"
    orphan = http.post("/v1/jobs", json={"kind": "gate", "payload": GATE, "parent_id": top})
    assert orphan.status_code == 404 and orphan.json()["error"] == "JobNotFound"
    extreme = {"kind": "gate", "payload": GATE, "priority": 2**31 - 1, "parent_id": job.id}
    created = http.post("/v1/jobs", json=extreme)
    assert created.status_code == 201 and created.json()["priority"] == 2**31 - 1
    lowest = http.post("/v1/jobs", json={"kind": "gate", "payload": GATE, "priority": -(2**31)})
    assert lowest.status_code == 201 and lowest.json()["priority"] == -(2**31)
    assert work.complete(job.id, claim.lease_token).state == JobState.SUCCEEDED
    http.close()
