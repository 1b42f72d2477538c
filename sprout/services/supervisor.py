"""Background services with pid files and logs: start, health, restart on crash, stop.

`up` starts `python -m sprout.services _supervise NAME` detached; that supervisor runs the service,
restarts it with backoff if it dies, and on SIGTERM passes the signal on (so a worker drains) and
waits for it to exit. The pid file names the supervisor, the child and when it started.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..runstore.endpoints import ENDPOINTS_ENV, render_endpoints
from ..runstore.worker import STOP_GRACE_S
from .config import ServicesConfig, config_dir

SERVICES = ("runstore-api", "runstore-worker")
STOP_TIMEOUT_S = 60  # the API's; a worker's is its drain, its jobs' stop grace and this margin


def stop_timeout(name: str, config: ServicesConfig) -> float:
    """How long the supervisor waits for a service to exit on SIGTERM before it SIGKILLs it: for a worker,
    longer than its drain and the grace its stopped jobs get, so no job is killed mid-turn."""
    if name == "runstore-worker":
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
        return [py, "-m", "sprout.runstore.api", "--db", config.db_url(directory), "--host", config.runstore_host,
                "--port", str(config.runstore_port), "--tokens", str(directory / "secrets" / "tokens.json"),
                "--log-level", "warning", *(["--endpoints", ",".join(config.endpoints)] if config.endpoints else [])]
    if name == "runstore-worker":
        return [py, "-m", "sprout.runstore.worker", "--url", config.url, "--token-file",
                str(directory / "secrets" / "worker.token"), "--slots", str(config.worker_slots),
                "--drain-timeout", str(config.worker_drain_s), "--host-id",
                config.worker_host_id, "--alive-file", str(directory / "run" / "runstore-worker.alive"),
                *(["--ship-listen", config.worker_ship_listen] if config.worker_ship_listen else [])]
    raise ValueError(name)


def service_env(config: ServicesConfig) -> dict[str, str]:
    env = dict(os.environ)
    env[ENDPOINTS_ENV] = render_endpoints(config.endpoints)  # the only endpoints whose keys workers send
    if config.runtime_bin:
        env["SPROUT_RUNTIME_BIN"] = config.runtime_bin
    return env


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


def healthy(name: str, config: ServicesConfig, directory: Path) -> tuple[bool, str]:
    if name == "runstore-api":
        try:
            response = httpx.get(f"{config.url}/health", timeout=2)
            return response.status_code == 200, f"GET /health {response.status_code}"
        except httpx.HTTPError as e:
            return False, f"GET /health: {type(e).__name__}"
    alive = directory / "run" / "runstore-worker.alive"
    if not alive.exists():
        return False, "not claiming yet"
    age = time.time() - alive.stat().st_mtime
    return age < 30, f"claim loop {age:.0f}s ago"


def up(name: str, config: ServicesConfig, directory: Path, wait_s: float = 30) -> str:
    if read_pid(name, directory):
        ok, detail = healthy(name, config, directory)
        return f"ok    {name} already up ({detail})"
    (directory / "run").mkdir(parents=True, exist_ok=True)
    (directory / "logs").mkdir(parents=True, exist_ok=True)
    log = open(directory / "logs" / f"{name}.log", "ab")
    subprocess.Popen([sys.executable, "-m", "sprout.services", "_supervise", name], stdin=subprocess.DEVNULL,
                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=service_env(config))
    deadline = time.monotonic() + wait_s
    detail = "starting"
    while time.monotonic() < deadline:
        if read_pid(name, directory):
            ok, detail = healthy(name, config, directory)
            if ok:
                return f"done  {name} up ({detail})"
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not become healthy in {wait_s:.0f}s ({detail}); see "
                       f"python -m sprout.services logs {name}")


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
    port = config.runstore_port if name == "runstore-api" else None
    return Status(name, info["pid"], port, ok, time.time() - info["started"], detail)


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
