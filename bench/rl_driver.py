"""Throughput and overhead of Sprout's RL driver: one Miles rollout group of --group-size samples, its
samples in the driver's own slots (local_slots = group size) and over a Run Store (2 workers x group
size / 2 slots), each at 0 s and at --latency s per model call, in one run.

    .venv/bin/python bench/rl_driver.py [--group-size 8] [--latency 1.0] [--turns 3] [--store PATH] [--keep]
    .venv/bin/python bench/rl_driver.py --scale [--latency 1.0] [--turns 3] [--postgres-url URL]

The task is the py-bugfix fixture, prepared with `python -m sprout.rl_driver prepare` (its image built
once). The policy is the scripted model: every sample makes exactly --turns model calls, `ls /app` then an
`echo` of a per-turn marker on calls 1 .. turns-1 (call k is answered by a step matching the marker of
call k-1's tool result, so concurrent samples cannot take each other's steps) and the submit command on
the last; the task is not fixed, so every reward is 0. A driver (`python -m sprout.rl_driver serve`)
runs per placement, and each placement first runs a full group at 0 s that is not reported (a warm-up:
a worker's first job pays its imports, seconds on a small host; a trainer's driver and workers stay up
between groups). The client acts as Miles does: POST /rollout-groups, GET every 0.2 s until a terminal
status, DELETE (which releases the group's checkpoints). A group counts only when it completed with
every sample making exactly --turns calls; anything else is printed below the table, as are sandboxes or
checkpoints left in the store.

Reported, per group:
  wall s             POST sent to the terminal GET answered (client clock).
  samples/min        returned samples x 60 / wall s.
  slowest sample s   max over samples of the sample's own work: its rollout (journal outcome.wall_s:
                     the agent's turns, from after its sandbox is created to its outcome) plus its live
                     grade (the verifier's duration_s). Read from the driver's ledger: each slot's
                     budget["sandbox_seconds"] is exactly outcome.wall_s + grade duration_s; the grade
                     time is that minus the journal's outcome.wall_s (GET answers only the group's sum).
  overhead ms/sample wall s - slowest sample s, in ms: the latency the driver adds to a sample beyond
                     its rollout and grade (sandbox creation, waiting for a slot or a worker, Run Store
                     job submission and polling, trajectory export, the ledger, the client's 0.2 s
                     polling). The samples run all at once, so this is the critical path's overhead, not
                     the group's wall time divided among the samples.
  sandbox s/sample   consumed_budget["sandbox_seconds"] / actual_samples (the driver's accounting:
                     rollout + grade seconds, sandbox creation not included).

With --search (local slots only, --latency s per model call, the scripted model as policy and reviewer):
  search             an FF search group: 2 roots of --turns calls that fail, each reviewed (2 reviewer
                     calls, answered at once) at turn --turns - 1, a student and one repair
                     continuation from there: 6 samples
  independent        a plain group of as many samples (6 roots of --turns calls)
  replayed           the 4 branches re-executed from scratch instead of restored from the checkpoint:
                     the prefix's --turns - 1 turns replayed, then the branch's own turns (students 1,
                     repairs 2: the repair's command and the submit), as two plain groups
and per trainable sample (graded trajectories): wall s, sandbox s, model calls; then the time a branch
from a checkpoint saves against replaying its prefix (replayed sandbox s/sample - branch sandbox s/sample).

With --scale, a fleet on this machine: a PostgreSQL Run Store (a fresh schema), two worker hosts (bench-a
on the store, bench-b on a second btrfs filesystem in a loop file: two stores, two host ids, each worker
serving its checkpoints to the other) with room for every sample at once, and one driver that prepares
both hosts' images at start. After a warm-up group, 8 plain groups of 8 and 2 search groups of 6 (as
--search) are posted at once. Branches take either host (--branch-affinity 0), so some ship their
checkpoint. Reported:
  samples/min        returned samples x 60 / the wall time of the whole burst.
  overhead s/sample  mean over the plain groups of wall s - slowest sample s (as above).
  CPU s/sample       the machine's busy CPU-seconds over the burst, less the bench process's own (the
                     scripted models and the client), per returned sample.
  memory MB/sample   (peak memory in use - memory in use before the burst) / peak sandboxes.
  sandboxes at peak  per host, counted in its store every 0.5 s.
then the CPU by component (cgroup v1 cpuacct groups: the driver, each worker with what it runs (podman,
btrfs, the runtime), the API, PostgreSQL, the containers and their conmons, the rest being the kernel's)
and a plain sample's time by phase (means): submitted (POST to its job), queued (to a worker taking it),
sandbox start/stop (its job less rollout and grade), model calls, commands, checkpoints, the agent's
rest, grade, and after its job (until its group's terminal GET: the group waits for its slowest).
"""

import argparse
import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from measure import (
    CpuGroups,
    Peaks,
    loop_btrfs,
    machine_cpu_s,
    memory_used_bytes,
    postgres_schema,
    sample_peaks,
)
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sqlalchemy import create_engine, text  # noqa: E402

from sprout.agent.journal import read_journal  # noqa: E402
from sprout.rl_driver.ledger import Ledger  # noqa: E402
from sprout.sandbox import Store  # noqa: E402
from sprout.tasks import GradeResult  # noqa: E402
from sprout.testing.scripted_model import ScriptedModelServer  # noqa: E402

RUNTIME_BIN = REPO / "runtime" / "sprout-runtime"
FIXTURE = REPO / "tests" / "fixtures" / "tasks" / "py-bugfix"
INSTRUCTION = "Fix it so that"  # only in the first call's last message (the task)
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
TERMINAL = {"completed", "early_stopped", "failed", "cancelled"}
POLL_S = 0.2
WALL_LIMIT_S = 900.0  # the group's budget: far above what a group takes here
RUNSTORE_VARS = ("SPROUT_RUNSTORE_URL", "SPROUT_RUNSTORE_TOKEN")


def marker(k: int) -> str:
    return f"sprout-bench-turn-{k}."


def script(samples: int, turns: int) -> list[dict]:
    """`samples` x `turns` steps: call k of a sample matches what call k-1 left in its tool result."""
    steps = []
    for k in range(1, turns + 1):
        command = SUBMIT if k == turns else f"ls /app && echo {marker(k)}"
        match = INSTRUCTION if k == 1 else re.escape(marker(k - 1))
        steps += [{"thought": f"turn {k}", "command": command, "match": match}] * samples
    return steps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args: str | Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                            env=env or dict(os.environ), timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args[:3]))} failed:\n{result.stdout}{result.stderr}")
    return result


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout:g} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, timeout: float = 120) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Row:
    where: str
    latency: float
    samples: int
    actual: int = 0
    wall_s: float = math.nan
    slowest_s: float = math.nan
    sandbox_s: float = math.nan
    problems: list[str] = field(default_factory=list)

    @property
    def per_min(self) -> float:
        return self.actual * 60 / self.wall_s

    @property
    def overhead_ms(self) -> float:
        return (self.wall_s - self.slowest_s) * 1000


@dataclass
class WorkerHost:
    """A worker host of a Run Store placement: its host id, its store (default: the machine's) and slots."""

    host_id: str
    slots: int
    store: Path | None = None


class Placement:
    """A driver process under `root` and, with `hosts`, a Run Store API (on `db`, default SQLite) and a
    worker per host."""

    def __init__(self, name: str, root: Path, tasks: Path, group_size: int, base_env: dict,
                 review: dict | None = None, hosts: list[WorkerHost] | None = None, db: str | None = None,
                 config: dict | None = None):
        self.name, self.root, self.hosts, self.db = name, root, hosts or [], db
        self.procs: list[subprocess.Popen] = []
        self.workers: dict[str, subprocess.Popen] = {}
        self.driver: subprocess.Popen | None = None
        self.services_dir: Path | None = None
        self.token = secrets.token_urlsafe(24)
        root.mkdir(parents=True)
        config = {"tasks_dir": str(tasks), "data_dir": str(root / "data"), "local_slots": group_size,
                  "runtime_bin": str(RUNTIME_BIN)} | ({"miles": {"review": review}} if review else {}) | (config or {})
        (root / "driver.json").write_text(json.dumps(config))
        self.ledger = Ledger(f"sqlite:///{root / 'data' / 'driver.sqlite3'}")
        self.env = {k: v for k, v in base_env.items() if k not in RUNSTORE_VARS} | {
            "SPROUT_RL_DRIVER_TOKEN": self.token, "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
            "SPROUT_RUNTIME_BIN": str(RUNTIME_BIN),
            "SPROUT_HOST_SLOTS": str(group_size)}  # local samples all at once, as the Run Store's workers run them
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=30,
                                 headers={"Authorization": f"Bearer {self.token}"})

    def start(self) -> None:
        if self.hosts:
            self._start_runstore()
        log = self.root / "driver.log"
        with open(log, "ab") as out:
            self.driver = subprocess.Popen([sys.executable, "-m", "sprout.rl_driver", "serve", "--config",
                                            str(self.root / "driver.json"), "--port", str(self.port)],
                                           cwd=REPO, env=self.env, stdout=out, stderr=out)
        self.procs.insert(0, self.driver)  # stopped first
        wait_healthy(self.url, self.driver, log)

    def api_pids(self) -> list[int]:
        """The Run Store API's supervisor and server processes."""
        assert self.services_dir is not None
        info = json.loads((self.services_dir / "run" / "runstore-api.json").read_text())
        return [info["pid"], info["child"]]

    def _start_runstore(self) -> None:
        self.services_dir = self.root / "services"
        env = self.env | {"SPROUT_CONFIG_DIR": str(self.services_dir)}
        run("-m", "sprout.services", "init", "--port", str(free_port()), "--slots", "1",
            *(("--db", self.db) if self.db else ()), env=env)
        run("-m", "sprout.services", "up", "runstore-api", env=env)
        exports = {}
        for line in run("-m", "sprout.services", "env", env=env).stdout.splitlines():
            for item in shlex.split(line)[1:]:
                key, _, value = item.partition("=")
                exports[key] = value
        self.env |= {k: exports[k] for k in RUNSTORE_VARS}
        worker_env = {k: v for k, v in self.env.items() if k not in RUNSTORE_VARS}
        for host in self.hosts:
            with open(self.root / f"worker-{host.host_id}.log", "ab") as out:
                self.workers[host.host_id] = proc = subprocess.Popen(
                    [sys.executable, "-m", "sprout.worker", "serve", "--url", exports["SPROUT_RUNSTORE_URL"],
                     "--token-file", str(self.services_dir / "secrets" / "worker.token"),
                     "--slots", str(host.slots), "--host-id", host.host_id, "--ship-listen", "127.0.0.1:0"],
                    cwd=REPO, env=worker_env | ({"SPROUT_STORE": str(host.store)} if host.store else {}),
                    stdout=out, stderr=out)
            self.procs.append(proc)

    def close(self) -> list[str]:
        problems = []
        self.http.close()
        for proc in self.procs:
            stop(proc)
        self.ledger.engine.dispose()
        if self.services_dir is not None:
            env = self.env | {"SPROUT_CONFIG_DIR": str(self.services_dir)}
            try:
                run("-m", "sprout.services", "down", env=env, timeout=180)
            except RuntimeError as e:
                problems.append(f"services down: {e}")
        return problems

    def run(self, body: dict, problems: list[str]) -> tuple[dict, float, object]:
        """POST a group, GET it every POLL_S until terminal, DELETE it (a failed DELETE goes in `problems`):
        its result, the client's wall seconds and its ledger row (read before DELETE forgets it)."""
        job = body["rollout_job_id"]
        started = time.monotonic()
        response = self.http.post("/rollout-groups", json=body)
        if response.status_code != 202:
            raise RuntimeError(f"POST: {response.status_code} {response.text[:500]}")
        try:
            while True:
                response = self.http.get(f"/rollout-groups/{job}")
                if response.status_code != 200:
                    raise RuntimeError(f"GET: {response.status_code} {response.text[:500]}")
                result = response.json()
                if result["status"] in TERMINAL:
                    break
                if time.monotonic() - started > WALL_LIMIT_S + 180:
                    raise RuntimeError("the group outlived its wall time and finalization")
                time.sleep(POLL_S)
            return result, time.monotonic() - started, self.ledger.group(job)
        finally:
            deleted = self.http.delete(f"/rollout-groups/{job}")
            if deleted.status_code != 200:
                problems.append(f"DELETE: {deleted.status_code} {deleted.text[:200]}")

    def group(self, prompt: dict, endpoint: str, samples: int, turns: int, row: Row) -> None:
        """Runs a plain group of `samples` x `turns` calls; fills `row`."""
        result, row.wall_s, ledger = self.run(request_body(prompt, endpoint, samples, turns), row.problems)
        row.actual = result["actual_samples"]
        row.sandbox_s = result["consumed_budget"]["sandbox_seconds"] / max(row.actual, 1)
        if result["status"] != "completed":
            row.problems.append(f"status {result['status']}: {result.get('stop_reason')}")
        row.problems += [f"{f['sample_slot_id']}: {f['reason']}" for f in result["failed_samples"]]
        calls = result["consumed_budget"]["model_calls"]
        if calls != samples * turns:
            row.problems.append(f"{calls} model calls, expected {samples} x {turns}")
        work = []
        journals = {t["sample_slot_id"]: t["metadata"]["journal"] for t in result["trajectories"]}
        for slot in ledger.slots if ledger else []:
            if slot.slot_id not in journals:
                continue
            journal = read_journal(Path(journals[slot.slot_id]))
            exit_status = journal.outcome.exit_status if journal.outcome else None
            if len(journal.turns) != turns or exit_status != "Submitted":
                row.problems.append(f"{slot.slot_id}: {len(journal.turns)} turns, {exit_status}")
            work.append(slot.budget.get("sandbox_seconds", math.nan))
        row.slowest_s = max(work, default=math.nan)


CONTINUE = "Carry on from here."


def request_body(prompt: dict, endpoint: str, samples: int, turns: int, search: dict | None = None) -> dict:
    """A Miles-shaped request: `samples` slots, room for `turns` model calls, a search when given."""
    job = f"bench-{uuid.uuid4().hex}"
    body = {"rollout_job_id": job, "rollout_id": 1, "prompt_group_id": "0", "task_id": prompt["metadata"]["task_id"],
            "image": prompt["metadata"]["image"], "prompt": prompt["prompt"], "model_endpoint": endpoint,
            "model": "policy", "max_samples": samples, "minimum_returned_samples": 1 if search else samples,
            "sample_slots": [{"sample_slot_id": f"{job}:slot:{i}", "sample_index": i} for i in range(samples)],
            "max_turns": turns + 2, "finalization_timeout_seconds": 120.0,
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 512},
            "budgets": {"max_wall_time_seconds": WALL_LIMIT_S}}
    return body | ({"search": search} if search else {})


@dataclass
class SearchRow:
    name: str
    samples: int = 0
    trainable: int = 0
    wall_s: float = 0.0
    sandbox_s: float = 0.0
    model_calls: int = 0

    def add(self, result: dict, wall_s: float) -> None:
        self.samples += result["actual_samples"]
        self.trainable += sum(t["metadata"]["zero_reason"] is None for t in result["trajectories"])
        self.wall_s += wall_s
        self.sandbox_s += result["consumed_budget"]["sandbox_seconds"]
        self.model_calls += result["consumed_budget"]["model_calls"]


def search_scripts(turns: int) -> tuple[list[dict], list[dict]]:
    """The policy (2 failing roots, then 4 branches that submit) and the reviewer (2 reviews of turn turns-1)."""
    repair = {"reasoning": "Look at the code again.", "command": "ls /app && echo repair-ran"}
    policy = script(2, turns) + [{"thought": "submit", "command": SUBMIT,
                                  "match": f"{re.escape(CONTINUE)}|repair-ran"}] * 4
    point = {"turn": turns - 1, "mistake_turn": turns, "mistake": "The agent never changed calc.py.",
             "reason": "before it gave up", "note": "change calc.py"}
    review = ([{"content": json.dumps({"branch_points": [point]}), "match": "Choose up to"}] * 2
              + [{"content": json.dumps({"repairs": [{"turn": turns - 1, "candidates": [repair]}]}),
                  "match": "next turn"}] * 2)
    return policy, review


def search_main(args, console: Console, root: Path, prompt: dict) -> list[str]:
    """The --search comparison (see the module's docstring); returns problems."""
    spec = {"roots": 2, "points": 1, "candidates": 1, "student_continuations": 1, "candidate_continuations": 1,
            "tf_student_continuations": 0, "repair_rounds": 1, "review_seconds": 120.0, "wall_time_seconds": 300.0}
    policy, review = search_scripts(args.turns)
    rows = {name: SearchRow(name) for name in ("search", "independent", "replayed")}
    problems: list[str] = []
    with ScriptedModelServer(review) as reviewer:
        placement = Placement("local", root / "search", root / "tasks", 6, dict(os.environ), review={
            "endpoint": reviewer.base_url, "model": "reviewer", "continuation_prompt": CONTINUE})
        try:
            placement.start()
            groups = [("search", policy, 6, args.turns, spec), ("independent", script(6, args.turns), 6, args.turns,
                                                                  None),
                      ("replayed", script(2, args.turns), 2, args.turns, None),  # the students, replayed
                      ("replayed", script(2, args.turns + 1), 2, args.turns + 1, None)]  # the repairs
            for name, steps, samples, turns, search in groups:
                console.print(f"{name}: a group of {samples} at {args.latency:g} s per call ...")
                with ScriptedModelServer(steps, delay_s=args.latency) as model:
                    result, wall, _ = placement.run(request_body(prompt, model.base_url.removesuffix("/v1"),
                                                                 samples, turns, search), problems)
                rows[name].add(result, wall)
                if result["status"] != "completed" or result["actual_samples"] != samples:
                    problems.append(f"{name}: {result['status']}, {result['actual_samples']} of {samples} samples: "
                                    f"{result['stop_reason']} {result['failed_samples'][:2]}")
        finally:
            problems += placement.close()
    table = Table("group", "samples", "trainable", "wall s", "sandbox s", "model calls", "wall s/trainable",
                  "sandbox s/trainable", title=f"SPROUT search vs independent samples, {args.latency:g} s per "
                  f"model call, roots of {args.turns} calls (local slots)")
    for row in rows.values():
        per = max(row.trainable, 1)
        table.add_row(row.name, str(row.samples), str(row.trainable), f"{row.wall_s:.1f}", f"{row.sandbox_s:.1f}",
                      str(row.model_calls), f"{row.wall_s / per:.2f}", f"{row.sandbox_s / per:.2f}")
    console.print(table)
    search, replayed = rows["search"], rows["replayed"]
    branch_s = search.sandbox_s - 2 * (rows["independent"].sandbox_s / 6)  # the search's sandbox s less its roots'
    saved = replayed.sandbox_s / 4 - branch_s / 4
    console.print(f"a branch from the checkpoint of turn {args.turns - 1} instead of replaying it: {saved:.2f} sandbox s "
                  f"and {args.turns - 1} model calls saved per branch ({replayed.sandbox_s / 4:.2f} s replayed vs "
                  f"{branch_s / 4:.2f} s restored)")
    return problems


SCALE_GROUPS = 8  # plain groups of SCALE_GROUP_SIZE, posted at once, and a search group per host
SCALE_GROUP_SIZE = 8
SEARCH_SPEC = {"roots": 2, "points": 1, "candidates": 1, "student_continuations": 1, "candidate_continuations": 1,
               "tf_student_continuations": 0, "repair_rounds": 1, "review_seconds": 120.0,
               "wall_time_seconds": 300.0}


def postgres_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-x", "postgres"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def sandbox_count(store: Path) -> Callable[[], int]:
    return lambda: sum(1 for _ in (store / "sandboxes").iterdir()) if (store / "sandboxes").is_dir() else 0


def wait_prepared(placement: Placement, hosts: list[str], timeout: float = 600) -> None:
    """Waits for the driver's start-up prepare job to report every host (its log line per host)."""
    deadline = time.monotonic() + timeout
    log = placement.root / "driver.log"
    while not all(f"host {h}: " in log.read_text() for h in hosts):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the hosts were not prepared in {timeout:g} s:\n{log.read_text()[-2000:]}")
        time.sleep(1)


@dataclass
class GroupRun:
    kind: str  # "plain" or "search"
    posted_unix: float
    result: dict
    wall_s: float
    slowest_s: float  # its slowest sample's own work: rollout + grade (the ledger's sandbox seconds)


def timing(runs: list[GroupRun], jobs: dict[int, Any], turns: int) -> tuple[dict[str, float], list[str]]:
    """Mean seconds per plain sample in each phase (see --scale in the module's docstring) and problems."""
    phases: dict[str, list[float]] = {}
    problems: list[str] = []
    for group in (g for g in runs if g.kind == "plain"):
        for t in group.result["trajectories"]:
            job = jobs[t["metadata"]["job_id"]]
            journal = read_journal(Path(t["metadata"]["journal"]))
            if journal.outcome is None or len(journal.turns) != turns:
                problems.append(f"{t['sample_slot_id']}: {len(journal.turns)} turns")
                continue
            grade = GradeResult.model_validate_json((Path(t["metadata"]["journal"]).parent / "grade.json").read_text())
            model = sum(turn.model_latency_s for turn in journal.turns)
            commands = sum(turn.command_s for turn in journal.turns)
            checkpoints = sum(turn.checkpoint_ms or 0 for turn in journal.turns) / 1000
            rollout = journal.outcome.wall_s
            for phase, seconds in {
                "submitted": job.created_at - group.posted_unix, "queued": job.started_at - job.created_at,
                "sandbox start, stop": job.finished_at - job.started_at - rollout - grade.duration_s,
                "model calls": model, "commands": commands, "checkpoints": checkpoints,
                "agent, rest": rollout - model - commands - checkpoints, "grade": grade.duration_s,
                "after its job": group.posted_unix + group.wall_s - job.finished_at,
            }.items():
                phases.setdefault(phase, []).append(seconds)
    return {phase: sum(v) / len(v) for phase, v in phases.items()}, problems


def scale_main(args, console: Console, root: Path, prompt: dict) -> list[str]:
    """The --scale fleet (see the module's docstring); returns problems."""
    if not args.postgres_url:
        raise SystemExit("--scale needs a PostgreSQL Run Store: --postgres-url URL or SPROUT_TEST_POSTGRES_URL")
    plain, problems = SCALE_GROUPS * SCALE_GROUP_SIZE, []
    slots = plain // 2 + 6 + 2  # a host's half of the plain samples, a search group and two spare
    search_policy, review = search_scripts(args.turns)
    runs: list[GroupRun] = []
    with (postgres_schema(args.postgres_url) as db, loop_btrfs(root / "host-b.img") as store_b,
          ScriptedModelServer(review * 2) as reviewer):
        hosts = [WorkerHost("bench-a", slots), WorkerHost("bench-b", slots, store_b)]
        placement = Placement("fleet", root / "fleet", root / "tasks", slots, dict(os.environ), hosts=hosts, db=db,
                              review={"endpoint": reviewer.base_url, "model": "reviewer",
                                      "continuation_prompt": CONTINUE},
                              config={"branch_affinity_s": args.branch_affinity})
        cpu = CpuGroups(f"sprout-bench-{os.getpid()}")
        try:
            placement.start()
            assert placement.driver is not None
            cpu.add("driver", placement.driver.pid)
            cpu.add("Run Store API", *placement.api_pids())
            for host_id, proc in placement.workers.items():
                cpu.add(f"worker {host_id} (podman, btrfs, runtime)", proc.pid)
            cpu.add("PostgreSQL", *postgres_pids())
            cpu.add("bench (client, scripted models)", os.getpid())
            console.print("fleet: waiting for the driver to prepare both hosts' images ...")
            wait_prepared(placement, [h.host_id for h in hosts])
            console.print(f"fleet: a warm-up group of {SCALE_GROUP_SIZE} at 0 s per call ...")
            with ScriptedModelServer(script(SCALE_GROUP_SIZE, args.turns)) as model:
                warmup = Row("fleet", 0.0, SCALE_GROUP_SIZE)
                placement.group(prompt, model.base_url.removesuffix("/v1"), SCALE_GROUP_SIZE, args.turns, warmup)
                problems += [f"warm-up: {p}" for p in warmup.problems]
            console.print(f"fleet: {SCALE_GROUPS} groups of {SCALE_GROUP_SIZE} and 2 search groups at "
                          f"{args.latency:g} s per call, all at once ...")
            before = (cpu.usage_s(), machine_cpu_s(), memory_used_bytes(), time.monotonic())
            counters = {h.host_id: sandbox_count(h.store or Store(runtime_bin=RUNTIME_BIN).root) for h in hosts}
            with (ScriptedModelServer(script(plain, args.turns), delay_s=args.latency) as model,
                  ScriptedModelServer(search_policy * 2, delay_s=args.latency) as search_model,
                  sample_peaks(counters) as peaks, ThreadPoolExecutor(SCALE_GROUPS + 2) as pool):
                def one(kind: str) -> GroupRun:
                    endpoint = (model if kind == "plain" else search_model).base_url.removesuffix("/v1")
                    body = (request_body(prompt, endpoint, SCALE_GROUP_SIZE, args.turns) if kind == "plain"
                            else request_body(prompt, endpoint, 6, args.turns, SEARCH_SPEC))
                    posted = time.time()
                    result, wall, ledger = placement.run(body, problems)
                    returned = {t["sample_slot_id"] for t in result["trajectories"]}
                    slowest = max((slot.budget.get("sandbox_seconds", math.nan) for slot in ledger.slots
                                   if slot.slot_id in returned), default=math.nan) if ledger else math.nan
                    return GroupRun(kind, posted, result, wall, slowest)

                runs = list(pool.map(one, ["plain"] * SCALE_GROUPS + ["search"] * 2))
                if len(model.remaining) or len(search_model.remaining):
                    problems.append(f"{len(model.remaining) + len(search_model.remaining)} scripted steps unused")
            after = (cpu.usage_s(), machine_cpu_s(), memory_used_bytes(), time.monotonic())
            jobs = placement_jobs(db)
        finally:
            problems += placement.close()
            cpu.close()
    problems += [f"{g.kind} group: {g.result['status']}, {g.result['actual_samples']} samples, "
                 f"{g.result['failed_samples'][:2]}" for g in runs if g.result["status"] != "completed"]
    report_scale(console, args, runs, jobs, before, after, peaks, problems)
    return problems


def placement_jobs(db: str) -> dict[int, Any]:
    engine = create_engine(db)
    try:
        with engine.connect() as conn:
            return {row.id: row for row in conn.execute(text(
                "SELECT id, kind, created_at, started_at, finished_at, shipped_from, lease_host FROM jobs"))}
    finally:
        engine.dispose()


def report_scale(console: Console, args, runs: list[GroupRun], jobs: dict[int, Any], before: tuple, after: tuple,
                 peaks: Peaks, problems: list[str]) -> None:
    cpu = {name: after[0][name] - before[0].get(name, 0.0) for name in after[0]}
    machine_s, wall_s = after[1] - before[1], after[3] - before[3]
    samples = sum(g.result["actual_samples"] for g in runs)
    plain = [g for g in runs if g.kind == "plain"]
    sprout_s = sum(v for k, v in cpu.items() if not k.startswith("bench")) + (
        machine_s - sum(cpu.values()))  # the kernel's work (btrfs, page cache) is Sprout's too
    table = Table("samples", "wall s", "samples/min", "overhead s/sample", "CPU s/sample", "memory MB/sample",
                  "sandboxes at peak", title=f"Sprout RL fleet on one machine: {SCALE_GROUPS} groups x "
                  f"{SCALE_GROUP_SIZE} and 2 search groups of 6, {args.turns} calls per root sample at "
                  f"{args.latency:g} s, 2 hosts (workers, stores), PostgreSQL Run Store")
    overhead = [g.wall_s - g.slowest_s for g in plain]
    memory_mb = (peaks.memory_bytes - before[2]) / 2**20 / max(peaks.total, 1)
    table.add_row(str(samples), f"{wall_s:.1f}", f"{samples * 60 / wall_s:.1f}",
                  f"{sum(overhead) / len(overhead):.2f}", f"{sprout_s / samples:.2f}", f"{memory_mb:.0f}",
                  ", ".join(f"{h} {n}" for h, n in peaks.counts.items()))
    console.print(table)
    where = Table("component", "CPU s", "CPU s/sample", "share", title=f"Where the CPU went ({machine_s:.0f} "
                  f"CPU-s over {wall_s:.0f} s on {os.cpu_count()} cores; the bench's scripted models are not "
                  "Sprout's)")
    cpu["kernel and the rest (btrfs, page cache, ...)"] = machine_s - sum(cpu.values())
    for name, seconds in sorted(cpu.items(), key=lambda kv: -kv[1]):
        where.add_row(name, f"{seconds:.1f}", f"{seconds / samples:.3f}", f"{seconds / machine_s:.0%}")
    console.print(where)
    phases, timing_problems = timing(runs, jobs, args.turns)
    problems += timing_problems
    when = Table("phase", "mean s", title=f"Where a plain sample's time went ({len(plain) * SCALE_GROUP_SIZE} "
                 "samples; its group waits for the slowest)")
    for phase, seconds in phases.items():
        when.add_row(phase, f"{seconds:.2f}")
    console.print(when)
    branches = [j for j in jobs.values() if j.kind == "rollout" and j.shipped_from]
    console.print(f"search groups: {[g.result['actual_samples'] for g in runs if g.kind == 'search']} samples, "
                  f"{len(branches)} branch(es) ran on the other host, their checkpoint shipped "
                  f"(branch affinity {args.branch_affinity:g} s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group-size", type=int, default=8, help="samples per group (default 8)")
    p.add_argument("--latency", type=float, default=1.0, help="seconds per model call, with 0 (default 1.0)")
    p.add_argument("--turns", type=int, default=3, help="model calls per sample (default 3)")
    p.add_argument("--store", type=Path, help="btrfs store (default: $SPROUT_STORE or ~/sprout-btrfs)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, journals)")
    p.add_argument("--search", action="store_true", help="compare a search group with independent samples and "
                   "with replaying its branches' prefixes (local slots only)")
    p.add_argument("--scale", action="store_true", help=f"a fleet: {SCALE_GROUPS} groups of {SCALE_GROUP_SIZE} "
                   "and a search group per host at once, over a PostgreSQL Run Store with workers on 2 hosts")
    p.add_argument("--postgres-url", default=os.environ.get("SPROUT_TEST_POSTGRES_URL"),
                   help="--scale's Run Store database (a fresh schema, dropped afterwards; default "
                   "$SPROUT_TEST_POSTGRES_URL)")
    p.add_argument("--branch-affinity", type=float, default=0.0, help="--scale: seconds a branch waits for the "
                   "host holding its checkpoint (default 0: either host, shipping it to the other)")
    args = p.parse_args()
    if args.group_size < 1 or args.turns < 1 or args.latency < 0:
        p.error("--group-size and --turns must be at least 1, --latency not negative")
    if args.store is not None:
        os.environ["SPROUT_STORE"] = str(args.store.expanduser().resolve())
    console = Console(width=None if sys.stdout.isatty() else 140)
    store = Store(runtime_bin=RUNTIME_BIN)
    before = {s.id for s in store.sandboxes()}
    checkpoints = {c.id for c in store.checkpoints()}
    root = Path(tempfile.mkdtemp(prefix="sprout-bench-rl-"))
    rows: list[Row] = []
    problems: list[str] = []
    try:
        shutil.copytree(FIXTURE, root / "tasks" / "py-bugfix")
        console.print(f"preparing py-bugfix in {os.environ.get('SPROUT_STORE', store.root)} ...")
        run("-m", "sprout.rl_driver", "prepare", "--tasks-dir", root / "tasks", "-o", root / "miles.jsonl")
        (line,) = (root / "miles.jsonl").read_text().splitlines()
        prompt = json.loads(line)
        if args.search:
            problems += search_main(args, console, root, prompt)
        if args.scale:
            problems += scale_main(args, console, root, prompt)
        for where in () if args.search or args.scale else ("local", "Run Store"):
            half = math.ceil(args.group_size / 2)
            hosts = [WorkerHost("bench-0", half), WorkerHost("bench-1", half)] if where == "Run Store" else None
            placement = Placement(where, root / where.replace(" ", "-").lower(), root / "tasks",
                                  args.group_size, dict(os.environ), hosts=hosts)
            try:
                placement.start()
                console.print(f"{where}: a warm-up group of {args.group_size} at 0 s per call ...")
                with ScriptedModelServer(script(args.group_size, args.turns)) as model:
                    warmup = Row(where, 0.0, args.group_size)
                    placement.group(prompt, model.base_url.removesuffix("/v1"), args.group_size, args.turns,
                                    warmup)
                    problems += [f"{where} warm-up: {p}" for p in warmup.problems]
                for latency in (0.0, args.latency):
                    row = Row(where, latency, args.group_size)
                    console.print(f"{where}, {latency:g} s per call: a group of {args.group_size} ...")
                    with ScriptedModelServer(script(args.group_size, args.turns), delay_s=latency) as model:
                        try:
                            placement.group(prompt, model.base_url.removesuffix("/v1"), args.group_size,
                                            args.turns, row)
                        except Exception as e:  # noqa: BLE001 - reported with the table
                            row.problems.append(f"{type(e).__name__}: {e}")
                        if len(model.remaining):
                            row.problems.append(f"{len(model.remaining)} scripted steps unused")
                    rows.append(row)
                    problems += [f"{where}, {latency:g} s: {p}" for p in row.problems]
            finally:
                problems += [f"{where}: {p}" for p in placement.close()]
    finally:
        if args.keep:
            console.print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    if rows:
        title = (f"Sprout RL driver, a group of {args.group_size} samples x {args.turns} model calls "
                 f"(local: {args.group_size} slots; Run Store: 2 workers x {math.ceil(args.group_size / 2)} "
                 "slots)")
        table = Table("where", "latency", "samples", "wall s", "samples/min", "overhead ms/sample",
                      "sandbox s/sample", "slowest sample s", title=title)
        for row in rows:
            table.add_row(row.where, f"{row.latency:g} s", f"{row.actual}/{row.samples}", f"{row.wall_s:.1f}",
                          f"{row.per_min:.1f}", f"{row.overhead_ms:.0f}", f"{row.sandbox_s:.1f}",
                          f"{row.slowest_s:.1f}")
        console.print(table)
        by = {(r.where, r.latency): r for r in rows}
        ratios = [f"{latency:g} s: {by[('local', latency)].per_min / by[('Run Store', latency)].per_min:.2f}x"
                  for latency in (0.0, args.latency) if ('local', latency) in by and ('Run Store', latency) in by]
        console.print(f"samples/min, local / Run Store: {', '.join(ratios)}")
    deadline = time.monotonic() + 10
    while (left := [s for s in store.sandboxes() if s.id not in before]) and time.monotonic() < deadline:
        time.sleep(1)
    if left:
        names = [f"{s.id} ({s.label}, made {time.strftime('%H:%M:%S', time.localtime(s.created))})"
                 for s in left]
        problems.append(f"{len(left)} sandboxes left in the store (or made meanwhile by another process): "
                        f"{', '.join(names)}")
    kept = [c.id for c in store.checkpoints() if c.id not in checkpoints]
    if kept:
        problems.append(f"{len(kept)} checkpoints left in the store (or made meanwhile by another process)")
    for problem in problems:
        console.print(f"[red]problem:[/red] {problem}", markup=True, highlight=False)


if __name__ == "__main__":
    main()
