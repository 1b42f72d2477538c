"""The bundled LiteLLM proxy: the scripted model server as the upstream provider (LiteLLM's `openai/`
provider at its base URL), the real proxy process in between, and `worker run` through it."""

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sprout.agent.journal import read_journal
from sprout.sandbox import Store
from sprout.services import supervisor
from sprout.services.config import PROXY_KEY_ENV, load, proxy_key
from sprout.testing.scripted_model import ScriptedModelServer
from tests.agent.test_run import SCRIPT, TASK
from tests.conftest import REPO, RUNTIME_BIN, free_port
from tests.services.test_services import services

UPSTREAM_KEY = "sk-upstream-never-in-files"


def proxy_flags(base_url: str, port: int) -> list[str]:
    return ["--proxy-model", "scripted", "--proxy-provider-model", "openai/scripted", "--proxy-api-base", base_url,
            "--proxy-key-env", "UPSTREAM_KEY", "--proxy-port", str(port)]


def exports(config: Path) -> dict[str, str]:
    """`services env` as variables."""
    out = services(config, "env")
    assert out.returncode == 0, out.stderr
    return dict(item.split("=", 1) for line in out.stdout.splitlines() for item in line.split()[1:])


def worker_run(journal: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sprout.worker", "run", "--model", "scripted", "--runtime-bin", str(RUNTIME_BIN),
           "--sandbox-image", "docker.io/library/python:3.11-slim", "--cwd", "/tmp", "--journal", str(journal),
           "--model-retries", "1", TASK]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **env})


def chat(upstream: ScriptedModelServer) -> list[dict]:
    """The Chat Completions calls the upstream saw (the proxy also lists its models now and then)."""
    return [r for r in upstream.requests if r["path"].endswith("/chat/completions")]


def remove_checkpoints(*journals: Path) -> None:
    store = Store()
    for path in journals:
        for turn in read_journal(path).turns if path.exists() else []:
            if turn.checkpoint:
                store.remove_checkpoint(turn.checkpoint, force=True)


def test_init_and_setup_write_litellm_yaml_with_key_names_only(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    init = services(a, "init", *proxy_flags("http://127.0.0.1:9999/v1", 14000), env={"UPSTREAM_KEY": UPSTREAM_KEY})
    assert init.returncode == 0, init.stdout + init.stderr
    assert "done  " + str(a / "litellm.yaml") in init.stdout
    yaml = (a / "litellm.yaml").read_text()
    assert '"openai/scripted"' in yaml and '"os.environ/UPSTREAM_KEY"' in yaml and "http://127.0.0.1:9999/v1" in yaml
    assert f'master_key: "os.environ/{PROXY_KEY_ENV}"' in yaml
    key_file = a / "secrets" / "litellm-master.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and proxy_key(a).startswith("sk-")
    config = load(a)
    assert config.endpoints["default"].url == "http://127.0.0.1:14000/v1"  # the agent's endpoint: the proxy
    assert config.endpoints["default"].key_env == PROXY_KEY_ENV
    files = "".join(p.read_text() for p in a.rglob("*") if p.is_file())
    assert UPSTREAM_KEY not in files
    env = supervisor.service_env(config, a)  # the proxy's master key, and the worker's key for "default"
    assert env[PROXY_KEY_ENV] == proxy_key(a) and env["LITELLM_LOCAL_MODEL_COST_MAP"]
    assert json.loads(env["SPROUT_ENDPOINTS"])["default"]["key_env"] == PROXY_KEY_ENV
    assert supervisor.command("litellm-proxy", config, a)[2:] == [
        "litellm.proxy.proxy_cli", "--config", str(a / "litellm.yaml"), "--host", "127.0.0.1", "--port", "14000"]
    # the same answers to `setup` give the same files; "proxy" as the endpoint asks for the proxy's settings
    answers = "proxy\nscripted\nopenai/scripted\nhttp://127.0.0.1:9999/v1\nUPSTREAM_KEY\n14000\n8470\n2\n"
    setup = services(b, "setup", stdin=answers)
    assert "litellm.yaml" in setup.stdout, setup.stdout + setup.stderr
    assert json.loads((a / "services.json").read_text()) == json.loads((b / "services.json").read_text())
    assert (b / "litellm.yaml").read_text() == yaml
    again = services(a, "init", "--force")
    assert proxy_key(a) == key_file.read_text().strip() and "(kept)" in again.stdout
    env = exports(a)
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:14000/v1" and env["OPENAI_API_KEY"] == proxy_key(a)


@pytest.mark.parametrize(("flags", "message"), [
    (["--proxy-model", "m", "--proxy-provider-model", "no-provider"], "--proxy-provider-model: String should match"),
    (["--proxy-model", "m", "--proxy-provider-model", "openai/x", "--proxy-key-env", "OPENAI_API_KEY"],
     "--proxy-key-env: OPENAI_API_KEY is the proxy's own key"),
    (["--proxy-model", "m", "--proxy-provider-model", "openai/x", "--proxy-api-base", "ftp://x"],
     "--proxy-api-base: must be an http(s) URL"),
    (["--proxy-model", "m"], "--proxy-provider-model: Field required"),
])
def test_bad_proxy_flags_give_one_line(tmp_path, flags, message):
    bad = services(tmp_path / "cfg", "init", *flags)
    assert bad.returncode == 1 and message in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "cfg" / "services.json").exists()


def test_up_refuses_an_unconfigured_proxy_or_a_missing_provider_key(tmp_path):
    config = tmp_path / "cfg"
    assert services(config, "init").returncode == 0
    up = services(config, "up", "litellm-proxy")
    assert up.returncode == 1 and "litellm-proxy is not configured" in up.stderr and "Traceback" not in up.stderr
    assert "litellm-proxy" not in services(config, "status").stdout  # not configured, not listed
    assert services(config, "init", *proxy_flags("http://127.0.0.1:9/v1", free_port()), "--force").returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "UPSTREAM_KEY"}
    up = subprocess.run([sys.executable, "-m", "sprout.services", "up", "litellm-proxy"], cwd=REPO, text=True,
                        capture_output=True, env={**env, "SPROUT_CONFIG_DIR": str(config)}, timeout=60)
    assert up.returncode == 1 and "UPSTREAM_KEY (the provider's key for litellm-proxy) is not set" in up.stderr


def test_a_proxy_whose_port_is_taken_is_refused_before_it_starts(tmp_path):
    config = tmp_path / "cfg"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert services(config, "init", *proxy_flags("http://127.0.0.1:9/v1", port)).returncode == 0
        up = services(config, "up", "litellm-proxy", env={"UPSTREAM_KEY": "x"})
    assert up.returncode == 1 and "Traceback" not in up.stderr, up.stderr
    assert f"litellm-proxy cannot listen on 127.0.0.1:{port}" in up.stderr and "--proxy-port N" in up.stderr
    assert "not running" in services(config, "status").stdout  # no supervisor was started


def test_worker_run_through_the_proxy_then_a_wrong_upstream_key_then_down(tmp_path, monkeypatch):
    config, port = tmp_path / "cfg", free_port()
    journal, refused = tmp_path / "fizzbuzz.jsonl", tmp_path / "refused.jsonl"
    with ScriptedModelServer(SCRIPT, api_key=UPSTREAM_KEY) as upstream:
        assert services(config, "init", *proxy_flags(upstream.base_url, port)).returncode == 0
        up = services(config, "up", "litellm-proxy", env={"UPSTREAM_KEY": UPSTREAM_KEY})
        try:
            assert up.returncode == 0, up.stdout + up.stderr
            assert "litellm-proxy up (GET /health/readiness 200)" in up.stdout
            status = services(config, "status")
            assert "litellm-proxy" in status.stdout and str(port) in status.stdout
            assert status.stdout.count("healthy") == 1
            monkeypatch.setenv("SPROUT_CONFIG_DIR", str(config))
            from sprout.services.supervisor import proxy_check

            check = proxy_check()
            assert check.ok and "serves scripted (openai/scripted)" in check.detail, check.detail
            env = exports(config)
            env = {"OPENAI_BASE_URL": env["OPENAI_BASE_URL"], "OPENAI_API_KEY": env["OPENAI_API_KEY"]}
            result = worker_run(journal, env)
            assert result.returncode == 0, result.stdout + result.stderr
            assert "submitted" in result.stdout and "final checkpoint ck-" in result.stdout
            j = read_journal(journal)
            assert j.outcome.status == "submitted" and [t.turn for t in j.turns] == [1, 2, 3, 4, 5]
            assert all(t.checkpoint for t in j.turns) and "FizzBuzz" in j.turns[2].observation
            assert j.header.endpoint_host == f"127.0.0.1:{port}"
            assert [r["status"] for r in chat(upstream)] == [200] * 5  # through the proxy, with its key

            assert "stopped" in services(config, "down", "litellm-proxy").stdout
            upstream.reset()
            up = services(config, "up", "litellm-proxy", env={"UPSTREAM_KEY": "sk-wrong"})
            assert up.returncode == 0, up.stdout + up.stderr
            result = worker_run(refused, env)
            assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
            lines = result.stdout.splitlines()
            outcome = next(i for i, line in enumerate(lines) if "error (ChatRefused) after" in line)
            error = lines[outcome + 1]  # the proxy's 401, the upstream's own words, on one line, not asked again
            assert "answered HTTP 401 for model 'scripted' (the key was refused)" in error, result.stdout
            assert "invalid or missing API key" in error
            assert [r["status"] for r in chat(upstream)] == [401]
        finally:
            down = services(config, "down")
            remove_checkpoints(journal, refused)
    assert "litellm-proxy stopped" in down.stdout
    assert "not running" in services(config, "status").stdout
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
