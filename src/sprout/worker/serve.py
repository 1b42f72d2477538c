"""The Run Store worker loop, `serve(WorkerConfig)`: claims jobs for its host and capacity, runs them,
heartbeats, reports. What it does for its user is `sprout worker serve --help` (sprout.cli.worker.SERVE_HELP).
"""

import logging
import os
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import SproutError, UsageError
from ..jobs.payloads import Shipped
from ..runstore.client import RunStoreClient
from ..runstore.errors import LeaseLost, RunStoreError
from ..runstore.models import Claim
from .shipping import CheckpointUnavailable, fetch_checkpoint

Handler = Callable[[Claim, threading.Event], Any]  # the event is set when the job must stop
Fetch = Callable[[Claim], Shipped | None]  # brings a job's checkpoint here; says what moved
REGISTER_EVERY_S = 60.0
HEARTBEAT_MAX_S = 2.0  # a cancelled job's handler is told to stop within this (then stops within a turn)
STOP_GRACE_S = 60.0  # how long a stopped handler may take to return (a turn: one model call, one command)
log = logging.getLogger("sprout.worker")


class Worker:
    def __init__(self, client: RunStoreClient, handlers: dict[str, Handler], *, host: str, slots: int = 1,
                 lease_s: float = 120.0, heartbeat_s: float = 20.0, wait_s: float = 5.0,
                 alive_file: Path | None = None, fetch: Fetch | None = None, ship_url: str | None = None):
        self.client, self.handlers, self.host, self.slots = client, handlers, host, slots
        self.lease_s, self.heartbeat_s, self.wait_s = lease_s, heartbeat_s, wait_s
        self.worker_id = f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.alive_file, self.fetch, self.ship_url = alive_file, fetch, ship_url
        self._next_register = 0.0  # monotonic time of the next host registration
        self.draining = threading.Event()
        self._active: dict[int, Claim] = {}
        self._stops: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="job")

    def run(self, drain_timeout_s: float = 600.0) -> None:
        log.info("worker %s: %d slot(s), kinds %s", self.worker_id, self.slots, ", ".join(self.handlers))
        outage: float | None = None  # since when claims fail (the API restarting)
        while not self.draining.is_set():
            if self.alive_file:
                self.alive_file.touch()
            self._register()
            free = self.slots - len(self._active)
            if free <= 0:
                time.sleep(0.2)
                continue
            try:
                claims = self.client.claim(self.worker_id, self.host, kinds=list(self.handlers), limit=free,
                                           lease_s=self.lease_s, wait_s=self.wait_s, retry_for_s=0)
            except RunStoreError as e:
                if outage is None:
                    log.warning("claim failed: %s; trying again every second", e)
                    outage = time.monotonic()
                time.sleep(1)
                continue
            if outage is not None:
                log.info("the Run Store answers again, after %.0fs", time.monotonic() - outage)
                outage = None
            for claim in claims:
                with self._lock:
                    self._active[claim.job.id] = claim
                    self._stops[claim.job.id] = threading.Event()
                self._pool.submit(self._run_one, claim)
        self._drain(drain_timeout_s)

    def _register(self) -> None:
        """Tells the Run Store this host's name and checkpoint server, now and then."""
        if time.monotonic() < self._next_register:
            return
        try:
            self.client.register_host(self.host, self.ship_url, retry_for_s=0)
        except RunStoreError as e:
            log.warning("could not register host %s: %s", self.host, e)
            self._next_register = time.monotonic() + 5  # try again soon
        else:
            self._next_register = time.monotonic() + REGISTER_EVERY_S

    def stop(self, *_args) -> None:
        if not self.draining.is_set():
            log.info("draining: no new claims; %d job(s) running", len(self._active))
        self.draining.set()

    def _drain(self, timeout_s: float) -> None:
        """Waits for running jobs; past `timeout_s` stops them (each releases its lease once stopped)."""
        self._wait_idle(time.monotonic() + timeout_s)
        with self._lock:
            leftover = list(self._active)
            for job_id in leftover:
                self._stops[job_id].set()
        if leftover:
            log.info("drain timeout: stopping job(s) %s", ", ".join(map(str, leftover)))
            self._wait_idle(time.monotonic() + STOP_GRACE_S)
        with self._lock:
            for job_id in self._active:
                log.warning("job %d did not stop in %.0fs; its lease is left to expire", job_id, STOP_GRACE_S)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _wait_idle(self, deadline: float) -> None:
        while self._active and time.monotonic() < deadline:
            time.sleep(0.2)

    def _heartbeat(self, claim: Claim, done: threading.Event, stop: threading.Event) -> None:
        while not done.wait(self.heartbeat_s):
            try:
                self.client.heartbeat(claim.job.id, claim.lease_token, extend_s=self.lease_s)
            except LeaseLost as e:
                log.warning("job %d: %s; stopping it", claim.job.id, e)
                stop.set()
                return
            except RunStoreError as e:
                log.warning("job %d: heartbeat failed: %s", claim.job.id, e)

    def _run_one(self, claim: Claim) -> None:
        job, done = claim.job, threading.Event()
        with self._lock:
            stop = self._stops[job.id]
        beat = threading.Thread(target=self._heartbeat, args=(claim, done, stop), daemon=True)
        beat.start()
        log.info("job %d (%s) started%s", job.id, job.kind, f", ship from {claim.ship_from}" if claim.ship_from else "")
        try:
            if stop.is_set():
                raise RuntimeError("stopped before it started")
            shipped = self.fetch(claim) if self.fetch and claim.ship_from else None
            result = self.handlers[job.kind](claim, stop)
            if shipped and isinstance(result, dict):
                result = {**result, "shipped": shipped.model_dump()}
        except Exception as e:
            done.set()
            if stop.is_set():
                self._stopped(claim, e)
                return
            retry = not isinstance(e, CheckpointUnavailable)  # another try would not find it either
            log.error("job %d failed%s: %s", job.id, "" if retry else " (not retried)", e)
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"
            self._report(lambda: self.client.fail(job.id, claim.lease_token, error, retry=retry))
        else:
            done.set()
            self._report(lambda: self.client.complete(job.id, claim.lease_token, result))
            log.info("job %d succeeded", job.id)
        finally:
            with self._lock:
                self._active.pop(job.id, None)
                self._stops.pop(job.id, None)

    def _stopped(self, claim: Claim, reason: Exception) -> None:
        """A job stopped on purpose: drained jobs go back to the queue; a cancelled one or one whose lease
        was lost has nothing to report (the store refuses it)."""
        log.info("job %d stopped (%s)", claim.job.id, reason)
        if self.draining.is_set():
            log.info("releasing job %d for another worker", claim.job.id)
            self._report(lambda: self.client.release(claim.job.id, claim.lease_token))

    def _report(self, call: Callable[[], Any]) -> None:
        try:
            call()
        except LeaseLost as e:
            log.warning("result refused: %s", e)
        except RunStoreError as e:
            log.error("could not report a result: %s", e)


class WorkerConfig(BaseModel):
    """A worker: which Run Store, which host it serves and how much it takes on."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="the Run Store API")
    token: str = Field(description="a worker token (a secret: never printed)", repr=False)
    host_id: str = Field(default_factory=socket.gethostname, description="this host's name, for job affinity")
    slots: int = Field(1, ge=1, description="jobs run at once")
    kinds: list[str] | None = Field(None, description="the job kinds it takes (default: every kind it can run)")
    lease_s: float = Field(120.0, gt=0, description="lease seconds, renewed by heartbeats")
    drain_timeout_s: float = Field(600.0, ge=0, description="on SIGTERM, how long running jobs may finish")
    alive_file: Path | None = Field(None, description="touched on every claim loop (for `sprout services status`)")
    ship_listen: str | None = Field(None, description="ADDR:PORT where it serves this host's checkpoints to other "
                                                      "hosts' workers (port 0: any free port)")
    ship_advertise: str | None = Field(None, description="the URL other hosts reach that server at")


def serve(config: WorkerConfig) -> None:
    """Runs the worker until SIGTERM or SIGINT (then it drains); reaps first what a killed worker left."""
    from .handlers import default_handlers, store_for

    for noisy in ("httpx", "minisweagent"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    handlers = default_handlers()
    if config.kinds:
        if unknown := set(config.kinds) - set(handlers):
            raise UsageError(f"this worker cannot run {', '.join(sorted(unknown))} (it runs {', '.join(handlers)})")
        handlers = {k: v for k, v in handlers.items() if k in config.kinds}
    try:
        for line in store_for().gc():  # what a killed worker left: its sandboxes, half-made subvolumes
            log.info("reaped %s", line)
    except SproutError as e:
        log.warning("could not reap what a killed worker left: %s", e)
    server = _ship_server(config) if config.ship_listen else None
    client = RunStoreClient(config.url, config.token)
    worker = Worker(client, handlers, host=config.host_id, slots=config.slots, lease_s=config.lease_s,
                    heartbeat_s=max(1.0, min(HEARTBEAT_MAX_S, config.lease_s / 6)), alive_file=config.alive_file,
                    fetch=lambda claim: fetch_checkpoint(claim, client, store_for(), config.token),
                    ship_url=server.url if server else None)
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    try:
        worker.run(drain_timeout_s=config.drain_timeout_s)
    finally:
        if server is not None:
            server.stop()


def _ship_server(config: WorkerConfig):
    from .handlers import store_for
    from .shipping import ShipServer

    assert config.ship_listen is not None
    bind, _, port = config.ship_listen.rpartition(":")
    if not port.isdigit():
        raise UsageError(f"--ship-listen wants ADDR:PORT, got {config.ship_listen!r}")
    try:
        server = ShipServer(store_for(), config.token, bind=bind or "0.0.0.0", port=int(port),
                            advertise=config.ship_advertise)
    except (OSError, SproutError) as e:
        raise UsageError(f"cannot serve checkpoints on {config.ship_listen}: {e}") from None
    server.start()
    log.info("serving this host's checkpoints at %s", server.url)
    return server
