"""Benchmark of the Run Store: claim throughput, claim latency and end-to-end job latency.

    python bench/runstore.py [--postgres-url URL] [--http] [--workers 1,8,32] [--batch 1,8]

For each engine (SQLite; PostgreSQL when ``--postgres-url`` or SPROUT_TEST_POSTGRES_URL
is given), each access mode (the store in-process; with ``--http`` also through the API,
served by a separate uvicorn process) and each number of worker threads:

* claim: ``--jobs`` queued jobs are claimed (``limit=batch``) by the workers as fast
  as they can, and not completed; claims/s = jobs claimed per second, claim latency =
  the time of one claim call under that load.
* drain: ``--jobs`` queued jobs are claimed and completed as fast as they can be;
  jobs/s = jobs claimed and completed per second.
* paced: jobs are submitted one by one at ``--rate`` per second while the workers
  poll (HTTP: long-poll); end-to-end latency = the job's finished_at - created_at.

Every claimed job id is counted: "double" is the number of jobs claimed more than once
(must be 0). PostgreSQL runs in a fresh schema that is dropped afterwards; the table
is ANALYZEd after the bulk submit, as autovacuum would soon do.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from measure import postgres_schema
from rich.console import Console
from rich.table import Table
from sqlalchemy import text

from sprout.jobs.payloads import job_kinds
from sprout.runstore.auth import hash_token, new_token
from sprout.runstore.client import RunStoreClient
from sprout.runstore.models import JobSpec
from sprout.runstore.store import RunStore

ROOT = Path(__file__).resolve().parents[1]
PAYLOAD = {"task_dir": "bench"}


@dataclass
class Result:
    engine: str
    mode: str
    workers: int
    batch: int
    claims_per_s: float = 0.0
    jobs_per_s: float = 0.0
    claim_ms: list[float] = field(default_factory=list)
    paced_claim_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    double_claims: int = 0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Claims:
    """Counts the claims of every job id, across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[int] = Counter()

    def add(self, job_ids: list[int]) -> None:
        with self._lock:
            self.counts.update(job_ids)

    def doubles(self) -> int:
        return sum(1 for n in self.counts.values() if n > 1)


# -- databases and servers ---------------------------------------------------------------


@contextmanager
def fresh_database(engine: str, postgres_url: str | None) -> Iterator[str]:
    if engine == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            yield str(Path(tmp) / "bench.db")
        return
    assert postgres_url
    with postgres_schema(postgres_url) as url:
        yield url


def analyze(store: RunStore) -> None:
    if store.dialect == "postgresql":
        with store._db.engine.begin() as conn:
            conn.execute(text("ANALYZE jobs"))


@contextmanager
def api_server(db_url: str) -> Iterator[tuple[str, str]]:
    token = new_token()
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "tokens.json"
        tokens.write_text(json.dumps({hash_token(token): "admin"}))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "sprout.runstore.api", "--db", db_url, "--tokens", str(tokens)]
        proc = subprocess.Popen(cmd + ["--port", str(port), "--log-level", "warning"], cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        try:
            with RunStoreClient(url, token, retry_for_s=30) as probe:
                probe.health()
            yield url, token
        finally:
            proc.terminate()
            proc.wait(10)


# -- the two phases ----------------------------------------------------------------------

Store = Any  # RunStore or RunStoreClient: the same methods


def run_threads(workers: int, target: Callable[[int], None]) -> float:
    threads = [threading.Thread(target=target, args=(w,)) for w in range(workers)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def drain(
    stores: list[Store],
    jobs: int,
    batch: int,
    complete: bool,
    claims: Claims,
    after_submit: Callable[[], None],
) -> tuple[float, list[float]]:
    """Claim (and complete) ``jobs`` fresh jobs; returns jobs per second and the claim latencies."""
    group = f"drain-{uuid.uuid4().hex[:6]}"
    for start in range(0, jobs, 1000):
        chunk = min(1000, jobs - start)
        stores[0].submit_many([JobSpec(kind="gate", payload=PAYLOAD, group_id=group) for _ in range(chunk)])
    after_submit()
    latencies: list[list[float]] = [[] for _ in stores]

    def work(w: int) -> None:
        store = stores[w]
        while True:
            t0 = time.perf_counter()
            got = store.claim(f"w{w}", "bench-host", limit=batch, lease_s=300)
            latencies[w].append((time.perf_counter() - t0) * 1000)
            if not got:
                return
            claims.add([c.job.id for c in got])
            for c in got if complete else ():
                store.complete(c.job.id, c.lease_token)

    elapsed = run_threads(len(stores), work)
    return jobs / elapsed, [
        ms for per_worker in latencies for ms in per_worker[:-1]
    ]  # the last found nothing


def paced(stores: list[Store], jobs: int, rate: float, http: bool, result: Result, claims: Claims) -> None:
    done = threading.Event()
    finished: list[int] = []
    lock = threading.Lock()

    def work(w: int) -> None:
        store = stores[w]
        while not done.is_set():
            t0 = time.perf_counter()
            got = store.claim(f"w{w}", "bench-host", lease_s=300, **({"wait_s": 0.5} if http else {}))
            if not got:
                if not http:  # together, the workers poll about 200 times a second, spread out
                    time.sleep(random.uniform(0.0025, 0.0075) * len(stores))
                continue
            if not http:  # over HTTP the claim is a long-poll: its time is mostly waiting
                result.paced_claim_ms.append((time.perf_counter() - t0) * 1000)
            claims.add([c.job.id for c in got])
            for c in got:
                store.complete(c.job.id, c.lease_token)
            with lock:
                finished.extend(c.job.id for c in got)
                if len(finished) >= jobs:
                    done.set()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(len(stores))]
    for t in threads:
        t.start()
    submitted = []
    start = time.perf_counter()
    for i in range(jobs):
        time.sleep(max(0.0, start + i / rate - time.perf_counter()))
        submitted.append(stores[0].submit("gate", PAYLOAD, group_id="paced").id)
    done.wait(timeout=60)
    done.set()
    for t in threads:
        t.join()
    for job_id in submitted:
        job = stores[0].get(job_id)
        if job.finished_at:
            result.e2e_ms.append((job.finished_at - job.created_at).total_seconds() * 1000)


@contextmanager
def contextmanager_for(mode: str, db_url: str) -> Iterator[Callable[[RunStore, int], list[Store]]]:
    """Yields a function giving each worker its store: the shared RunStore, or an HTTP client each."""
    if mode == "direct":
        yield lambda store, workers: [store] * workers
        return
    with api_server(db_url) as (url, token):
        clients: list[RunStoreClient] = []

        def make(_store: RunStore, workers: int) -> list[Store]:
            clients.extend(RunStoreClient(url, token) for _ in range(workers))
            return list(clients)

        try:
            yield make
        finally:
            for client in clients:
                client.close()


def bench(engine: str, mode: str, workers: int, batch: int, args: argparse.Namespace) -> Result:
    result = Result(engine, mode, workers, batch)
    claims = Claims()
    with fresh_database(engine, args.postgres_url) as db_url:
        store = RunStore(db_url, job_kinds(), pool_size=workers + 2)
        store.submit("gate", PAYLOAD)  # warm up
        (warm,) = store.claim("warm", "bench-host")
        store.complete(warm.job.id, warm.lease_token)
        with contextmanager_for(mode, db_url) as stores_for:
            stores = stores_for(store, workers)
            result.claims_per_s, result.claim_ms = drain(
                stores, args.jobs, batch, False, claims, lambda: analyze(store)
            )
            result.jobs_per_s, _ = drain(stores, args.jobs, batch, True, claims, lambda: analyze(store))
            if batch == 1:
                paced(stores, args.latency_jobs, args.rate, mode == "http", result, claims)
        result.double_claims = claims.doubles()
        store.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", default=os.environ.get("SPROUT_TEST_POSTGRES_URL"))
    parser.add_argument("--http", action="store_true", help="also measure through the HTTP API")
    parser.add_argument("--workers", default="1,8,32")
    parser.add_argument("--batch", default="1", help="claim limits to measure, e.g. 1,8")
    parser.add_argument("--jobs", type=int, default=2000, help="jobs drained per configuration")
    parser.add_argument("--latency-jobs", type=int, default=200, help="jobs submitted in the paced phase")
    parser.add_argument("--rate", type=float, default=50.0, help="submissions per second in the paced phase")
    args = parser.parse_args()

    engines = ["sqlite"] + (["postgres"] if args.postgres_url else [])
    modes = ["direct"] + (["http"] if args.http else [])
    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title=f"Run Store benchmark ({os.cpu_count()} CPUs, {args.jobs} jobs drained per row)")
    for column in (
        "engine",
        "mode",
        "workers",
        "batch",
        "claims/s",
        "claim p50 ms",
        "claim p95 ms",
        "jobs/s",
        "paced claim p50 ms",
        "e2e p50 ms",
        "e2e p95 ms",
        "double",
    ):
        table.add_column(column, justify="right")
    for engine in engines:
        for mode in modes:
            for batch in (int(b) for b in args.batch.split(",")):
                for workers in (int(w) for w in args.workers.split(",")):
                    console.print(f"[dim]{engine} {mode} workers={workers} batch={batch}...[/dim]")
                    r = bench(engine, mode, workers, batch, args)
                    table.add_row(
                        engine,
                        mode,
                        str(workers),
                        str(batch),
                        f"{r.claims_per_s:,.0f}",
                        f"{pct(r.claim_ms, 0.5):.2f}",
                        f"{pct(r.claim_ms, 0.95):.2f}",
                        f"{r.jobs_per_s:,.0f}",
                        f"{statistics.median(r.paced_claim_ms):.2f}" if r.paced_claim_ms else "-",
                        f"{pct(r.e2e_ms, 0.5):.1f}" if r.e2e_ms else "-",
                        f"{pct(r.e2e_ms, 0.95):.1f}" if r.e2e_ms else "-",
                        str(r.double_claims),
                        style="red" if r.double_claims else None,
                    )
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
