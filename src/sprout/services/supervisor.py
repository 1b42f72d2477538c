"""Background services with pid files and logs: start, health, restart on crash, stop.

`up` starts `python -m sprout services _supervise NAME` detached; that supervisor runs the service,
restarts it with backoff if it dies, and on SIGTERM passes the signal on (so a worker drains) and
waits for it to exit. The pid file names the supervisor, the child and when it started.
"""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..errors import SproutError
from ..jobs.endpoints import ENDPOINTS_ENV, render_endpoints
from ..sandbox.backends import Check
from .config import (
    PROXY_KEY_ENV,
    RL_DRIVER_CONFIG,
    RL_DRIVER_TOKEN_ENV,
    ServicesConfig,
    config_dir,
    load,
    proxy_key,
    rl_driver_token,
    token,
)

# `up` in this order, `down` in reverse
SERVICES = ("litellm-proxy", "runstore-api", "runstore-worker", "rl-driver")
STOP_TIMEOUT_S = 60  # the API's; a worker's is its drain, its jobs' stop grace and this margin
START_WAIT_S = {"litellm-proxy": 120.0}  # LiteLLM's proxy imports for seconds; others: UP_WAIT_S
UP_WAIT_S = 30.0
LOG_TAIL_LINES = 12  # of a service that failed to start, shown by `up`


def configured(config: ServicesConfig) -> list[str]:
    """The services this configuration runs (the proxy and the RL driver only when they are configured)."""
    optional = {"litellm-proxy": config.proxy, "rl-driver": config.rl_driver}
    return [name for name in SERVICES if optional.get(name, True)]


def stop_timeout(name: str, config: ServicesConfig) -> float:
    """How long the supervisor waits for a service to exit on SIGTERM before it SIGKILLs it: for a worker,
    longer than its drain and the grace its stopped jobs get, so no job is killed mid-turn."""
    if name == "runstore-worker":
        from ..worker.serve import STOP_GRACE_S  # here: that module imports the whole job stack

        return config.worker_drain_s + STOP_GRACE_S + STOP_TIMEOUT_S
    return STOP_TIMEOUT_S


@dataclass
class Status:
    name: str
    pid: int | None
    port: int | None
    healthy: bool
    uptime_s: float | None
    detail: str


def command(name: str, config: ServicesConfig, directory: Path) -> list[str]:
    py = sys.executable
    if name == "runstore-api":
        return [py, "-m", "sprout", "runstore", "serve", "--db", config.db_url(directory), "--host", config.runstore_host,
                "--port", str(config.runstore_port), "--tokens", str(directory / "secrets" / "tokens.json"),
                "--log-level", "warning", *(["--endpoints", ",".join(config.endpoints)] if config.endpoints else [])]
    if name == "runstore-worker":
        return [py, "-m", "sprout", "worker", "serve", "--url", config.url, "--token-file",
                str(directory / "secrets" / "worker.token"), "--slots", str(config.worker_slots),
                "--drain-timeout", str(config.worker_drain_s), "--host-id",
                config.worker_host_id, "--alive-file", str(directory / "run" / "runstore-worker.alive"),
                *(["--ship-listen", config.worker_ship_listen] if config.worker_ship_listen else [])]
    if name == "litellm-proxy" and config.proxy:
        return [py, "-m", "litellm.proxy.proxy_cli", "--config", str(directory / "litellm.yaml"),
                "--host", config.proxy.host, "--port", str(config.proxy.port)]
    if name == "rl-driver" and config.rl_driver:
        return [py, "-m", "sprout", "rl-driver", "serve", "--config", str(directory / RL_DRIVER_CONFIG)]
    raise ValueError(name)


def service_env(config: ServicesConfig, directory: Path | None = None,
                name: str | None = None) -> dict[str, str]:
    """The services' environment: this one, plus the configured endpoints, and with a proxy its master key
    (the proxy's own and the key of the worker's endpoint that points at it). The RL driver's (`name`
    "rl-driver") also has the Run Store's URL and submitter token, and its own callers' token."""
    env = dict(os.environ)
    env[ENDPOINTS_ENV] = render_endpoints(config.endpoints)  # the only endpoints whose keys workers send
    env.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM's cost map from the package, not the web
    if config.runtime_bin:
        env["SPROUT_RUNTIME_BIN"] = config.runtime_bin
    key = proxy_key(directory) if config.proxy else None
    if key:
        env[PROXY_KEY_ENV] = key
    if name == "rl-driver" and config.rl_driver:
        env["SPROUT_RUNSTORE_URL"] = config.url
        env["SPROUT_RUNSTORE_TOKEN"] = token("submitter", directory)
        env[RL_DRIVER_TOKEN_ENV] = rl_driver_token(directory) or ""
    return env


PORT_FLAGS = {"runstore-api": "--port", "litellm-proxy": "--proxy-port", "rl-driver": "--rl-driver-port"}


def _listen_address(name: str, config: ServicesConfig) -> tuple[str, int] | None:
    if name == "runstore-api":
        return config.runstore_host, config.runstore_port
    service = {"litellm-proxy": config.proxy, "rl-driver": config.rl_driver}.get(name)
    return (service.host, service.port) if service else None


def _port_taken(name: str, config: ServicesConfig) -> str | None:
    """Why `name` cannot listen where it is configured to: another process holds the port. Its health check
    would otherwise take that process (another user's Sprout, say) for this service."""
    address = _listen_address(name, config)
    if address is None:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:  # anything but a held port (an IPv6 or unknown host) is the service's to report
            if e.errno != errno.EADDRINUSE:
                return None
            return (f"{name} cannot listen on {address[0]}:{address[1]} ({e.strerror}): another process holds "
                    f"it (another user's Sprout services?); choose another port with `sprout services init "
                    f"{PORT_FLAGS[name]} N`")
    return None


def preflight(name: str, config: ServicesConfig, directory: Path) -> str | None:
    """Why `name` cannot start with this configuration, or None."""
    if taken := _port_taken(name, config):
        return taken
    if name == "rl-driver":
        return _rl_driver_preflight(config, directory)
    if name != "litellm-proxy":
        return None
    if config.proxy is None:
        return ("litellm-proxy is not configured: run `sprout services init --proxy-model NAME "
                "--proxy-provider-model PROVIDER/MODEL ...` (or `setup`)")
    if not (directory / "litellm.yaml").exists() or proxy_key(directory) is None:
        return f"no litellm.yaml or master key in {directory}: run `sprout services init` (or `setup`)"
    if config.proxy.key_env and config.proxy.key_env not in os.environ:
        return f"{config.proxy.key_env} (the provider's key for litellm-proxy) is not set: export it first"
    return None


def _rl_driver_preflight(config: ServicesConfig, directory: Path) -> str | None:
    driver = config.rl_driver
    if driver is None:
        return ("rl-driver is not configured: run `sprout services init --rl-driver-tasks-dir DIR` "
                "(or `setup`)")
    if not (directory / RL_DRIVER_CONFIG).exists() or rl_driver_token(directory) is None:
        return (f"no {RL_DRIVER_CONFIG} or RL driver token in {directory}: "
                "run `sprout services init` (or `setup`)")
    if not (directory / "secrets" / "submitter.token").exists():
        return (f"no Run Store tokens in {directory}/secrets: "
                "run `sprout services init` (or `setup`)")
    if not Path(driver.tasks_dir).is_dir():
        return (f"the RL driver's tasks directory {driver.tasks_dir} does not exist: create it, or name "
                "another with `sprout services init --rl-driver-tasks-dir DIR --force`")
    return None


def _pid_file(name: str, directory: Path) -> Path:
    return directory / "run" / f"{name}.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def read_pid(name: str, directory: Path) -> dict | None:
    path = _pid_file(name, directory)
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if _alive(info["pid"]) else None


def _get_ok(url: str, path: str) -> tuple[bool, str]:
    try:
        response = httpx.get(f"{url}{path}", timeout=2)
        return response.status_code == 200, f"GET {path} {response.status_code}"
    except httpx.HTTPError as e:
        return False, f"GET {path}: {type(e).__name__}"


def healthy(name: str, config: ServicesConfig, directory: Path) -> tuple[bool, str]:
    if name == "runstore-api":
        return _get_ok(config.url, "/health")
    if name == "litellm-proxy":  # readiness answers without calling the model (/health would call it)
        if config.proxy is None:
            return False, "not configured"
        return _get_ok(f"http://{config.proxy.host}:{config.proxy.port}", "/health/readiness")
    if name == "rl-driver":
        return _get_ok(config.rl_driver.url, "/health") if config.rl_driver else (False, "not configured")
    alive = directory / "run" / "runstore-worker.alive"
    if not alive.exists():
        return False, "not claiming yet"
    age = time.time() - alive.stat().st_mtime
    return age < 30, f"claim loop {age:.0f}s ago"


def _log_since(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _start_failure(name: str, config: ServicesConfig, directory: Path, log: Path, offset: int, why: str) -> str:
    """Stops the half-started `name` and says why it failed: `why` and the last lines it logged, less
    traceback frames (indented), which would crowd out the error lines."""
    down(name, config, directory)
    lines = [line for line in _log_since(log, offset).splitlines() if line.strip() and not line[0].isspace()
             and not line.startswith(("Traceback (most recent call last)", "During handling of the above"))]
    tail = "\n".join(f"  | {line}" for line in lines[-LOG_TAIL_LINES:])
    return f"{name} {why}; its log ({log}) ends:\n{tail}" if tail else f"{name} {why}; its log {log} is empty"


def up(name: str, config: ServicesConfig, directory: Path, wait_s: float | None = None) -> str:
    """Starts `name` under a supervisor and waits until it is healthy. A service that exits before that
    (the supervisor logs "exited with") or stays unhealthy for `wait_s` is stopped: RuntimeError with the
    last lines of its log."""
    if read_pid(name, directory):
        ok, detail = healthy(name, config, directory)
        return f"ok    {name} already up ({detail})"
    problem = preflight(name, config, directory)
    if problem:
        raise RuntimeError(problem)
    wait_s = wait_s or START_WAIT_S.get(name, UP_WAIT_S)
    (directory / "run").mkdir(parents=True, exist_ok=True)
    (directory / "logs").mkdir(parents=True, exist_ok=True)
    log_path = directory / "logs" / f"{name}.log"
    with open(log_path, "ab") as log:
        offset = log.tell()
        subprocess.Popen([sys.executable, "-m", "sprout", "services", "_supervise", name], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                         env=service_env(config, directory, name))
    deadline = time.monotonic() + wait_s
    detail = "starting"
    while time.monotonic() < deadline:
        if read_pid(name, directory):
            ok, detail = healthy(name, config, directory)
            if ok:
                return f"done  {name} up ({detail})"
        if f"supervisor: {name} exited with" in _log_since(log_path, offset):
            raise RuntimeError(_start_failure(name, config, directory, log_path, offset, "exited while starting"))
        time.sleep(0.2)
    raise RuntimeError(_start_failure(name, config, directory, log_path, offset,
                                      f"did not become healthy in {wait_s:.0f}s ({detail})"))


def down(name: str, config: ServicesConfig, directory: Path) -> str:
    info = read_pid(name, directory)
    if info is None:
        _pid_file(name, directory).unlink(missing_ok=True)
        return f"ok    {name} not running"
    os.kill(info["pid"], signal.SIGTERM)
    deadline = time.monotonic() + stop_timeout(name, config) + 5
    while _alive(info["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    _pid_file(name, directory).unlink(missing_ok=True)
    return f"done  {name} stopped"


def status(name: str, config: ServicesConfig, directory: Path) -> Status:
    info = read_pid(name, directory)
    if info is None:
        return Status(name, None, None, False, None, "not running")
    ok, detail = healthy(name, config, directory)
    ports = {"runstore-api": config.runstore_port, "litellm-proxy": config.proxy.port if config.proxy else None,
             "rl-driver": config.rl_driver.port if config.rl_driver else None}
    return Status(name, info["pid"], ports.get(name), ok, time.time() - info["started"], detail)


def supervise(name: str) -> int:
    """Runs one service in the foreground, restarting it when it dies; SIGTERM stops it gracefully."""
    from .config import load

    directory = config_dir()
    config = load(directory)
    stopping = False
    child: subprocess.Popen | None = None

    def on_term(*_):
        nonlocal stopping
        if stopping:
            return
        stopping = True
        if child and child.poll() is None:
            child.send_signal(signal.SIGTERM)
            timer = threading.Timer(stop_timeout(name, config), kill_child)
            timer.daemon = True
            timer.start()

    def kill_child() -> None:
        if child and child.poll() is None:
            print(f"supervisor: {name} did not stop in {stop_timeout(name, config):.0f}s; killing it", flush=True)
            child.kill()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    backoff = 1.0
    while not stopping:
        started = time.time()
        child = subprocess.Popen(command(name, config, directory))
        _pid_file(name, directory).write_text(json.dumps({"pid": os.getpid(), "child": child.pid,
                                                          "started": started, "name": name}))
        try:
            code = child.wait()
        except KeyboardInterrupt:
            code = child.wait()
        if stopping:
            break
        print(f"supervisor: {name} exited with {code}; restarting in {backoff:.0f}s", flush=True)
        time.sleep(backoff)
        backoff = 1.0 if time.time() - started > 60 else min(backoff * 2, 30)
    return 0


def proxy_check() -> Check | None:
    """The bundled LiteLLM proxy, when services.json configures one: up (readiness) and serving its model."""
    if not (config_dir() / "services.json").exists():
        return None
    try:
        proxy = load().proxy
    except SproutError as e:
        return Check("llm proxy", False, str(e))
    if proxy is None:
        return None
    root = proxy.url.removesuffix("/v1")
    try:
        httpx.get(f"{root}/health/readiness", timeout=3).raise_for_status()
        response = httpx.get(f"{proxy.url}/models", timeout=5,
                             headers={"Authorization": f"Bearer {proxy_key() or ''}"})
        response.raise_for_status()
    except httpx.HTTPError as e:
        return Check("llm proxy", False, f"{proxy.url} does not answer ({type(e).__name__}: {e}): "
                                         "run sprout services up litellm-proxy")
    served = [m.get("id") for m in response.json().get("data", [])]
    if proxy.model_name not in served:
        return Check("llm proxy", False, f"{proxy.url} serves {served}, not {proxy.model_name!r}: restart it "
                                         "(sprout services down litellm-proxy; up litellm-proxy)")
    return Check("llm proxy", True, f"{proxy.url} serves {proxy.model_name} ({proxy.provider_model})")
