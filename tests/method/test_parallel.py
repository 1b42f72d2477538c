"""Concurrent attempts: TaskExecutor.attempt_many over a fake backend (records in plan order whatever
order attempts finish in, early stop cancels the running siblings, errors and resume); then end to end
with the scripted model at 1 s per call: a round of 4 branches running at once (their model calls
overlap) in-process, leased at once to both workers over a Run Store, and early stop leaving no sandbox
behind."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sprout.agent.journal import Outcome
from sprout.agent.runner import RolloutCancelled
from sprout.eval.executor import TaskExecutor
from sprout.eval.summary import read_summary
from sprout.jobs.local import RolloutDone, RolloutRequest
from sprout.method.records import AttemptPlan, AttemptRecord
from sprout.runstore import EventType
from sprout.runstore.client import RunStoreClient
from sprout.sandbox import Store
from sprout.sandbox.errors import SproutError
from sprout.tasks import GradeResult
from sprout.testing.scripted_model import ScriptedModelServer
from tests.conftest import REPO, RUNTIME_BIN
from tests.method.conftest import KEY_ENV, SUBMIT, evaluate_args, run_module
from tests.method.test_evaluate import FIRST
from tests.services.test_services import free_port, services


class FakeBackend:
    """A rollout of `seconds[attempt]` seconds (ending early once stopped, with RolloutCancelled);
    attempts in `solves` score 1, those in `fails` raise (at their end, or once stopped). `most`: the
    most attempts running at once; `stopped`: the attempts whose stop came before their end."""

    def __init__(self, seconds: dict[str, float], solves=(), fails=()):
        self.seconds, self.solves, self.fails = seconds, set(solves), set(fails)
        self.running, self.most = 0, 0
        self.stopped: set[str] = set()
        self.lock = threading.Lock()

    def rollout(self, request: RolloutRequest, on_turn, stop: threading.Event | None = None) -> RolloutDone:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            stopped = stop.wait(self.seconds.get(request.attempt, 0.0))
            if stopped:
                self.stopped.add(request.attempt)
            if stopped and request.attempt not in self.fails:
                raise RolloutCancelled("stopped")
            if request.attempt in self.fails:
                raise SproutError(f"{request.attempt} broke")
        finally:
            with self.lock:
                self.running -= 1
        outcome = Outcome(status="submitted", exit_status="Submitted", turns=2, tokens_in=10, tokens_out=1,
                          wall_s=0.1, final_checkpoint="cp")
        reward = 1.0 if request.attempt in self.solves else 0.0
        grade = GradeResult(reward=reward, rewards={"reward": reward}, verdict="pass" if reward else "fail",
                            verifier_output="", error=None, duration_s=0.0, mode="live")
        return RolloutDone(outcome, "host", grade)


def executor(tmp_path: Path, backend: FakeBackend, recorded=()) -> TaskExecutor:
    task = SimpleNamespace(instruction="do it", config=SimpleNamespace(environment=SimpleNamespace(workdir="/app")))
    image = SimpleNamespace(reference="img", image=SimpleNamespace(config=SimpleNamespace(workdir="/")))
    agent = SimpleNamespace(model="m", endpoint=None, model_class="tools", wall_time_s=60, command_timeout_s=10)
    return TaskExecutor(store=None, jobs=backend, task=task, image=image, agent=agent, reviewer=None, out=tmp_path,
                        recorded_attempts=recorded, log=lambda _text: None)


def plans(n: int) -> list[AttemptPlan]:
    return [AttemptPlan(id=f"a{i}", kind="first" if i == 1 else "restart", step_limit=5, token_limit=100)
            for i in range(1, n + 1)]


@pytest.mark.python_only
def test_attempts_run_together_and_are_recorded_in_plan_order(tmp_path):
    backend = FakeBackend({"a1": 0.9, "a2": 0.7, "a3": 0.5, "a4": 0.3})  # they finish last to first
    ex = executor(tmp_path, backend)
    finished: list[list[str]] = []
    ex.on_record = lambda: finished.append([a.id for a in ex.attempts])
    records = ex.attempt_many(plans(4), early_stop=True, parallel=4)
    assert backend.most == 4
    assert [a.id for a in records] == [a.id for a in ex.attempts] == ["a1", "a2", "a3", "a4"]
    assert finished == [["a4"], ["a3", "a4"], ["a2", "a3", "a4"], ["a1", "a2", "a3", "a4"]]
    backend = FakeBackend({})
    executor(tmp_path, backend).attempt_many(plans(4), early_stop=True, parallel=2)
    assert backend.most <= 2


@pytest.mark.python_only
def test_the_first_solve_cancels_its_running_siblings_and_resume_replays_them(tmp_path):
    backend = FakeBackend({"a1": 5.0, "a2": 0.1, "a3": 5.0}, solves={"a2"})
    ex = executor(tmp_path, backend)
    records = ex.attempt_many(plans(3), early_stop=True, parallel=3)
    assert backend.stopped == {"a1", "a3"}  # stopped by a2's solve, 5 s before their end
    assert [(a.id, a.status, a.verdict, a.reward, a.solved) for a in records] == [
        ("a1", "cancelled", "cancelled", None, False), ("a2", "submitted", "pass", 1.0, True),
        ("a3", "cancelled", "cancelled", None, False)]
    # resume: every record is replayed, nothing runs again
    again = executor(tmp_path, FakeBackend({}, fails={"a1", "a2", "a3"}), recorded=records)
    assert again.attempt_many(plans(3), early_stop=True, parallel=3) == records
    # not started yet when a2 solved (one at a time): no record
    queued = executor(tmp_path, FakeBackend({}, solves={"a2"})).attempt_many(plans(4), early_stop=True, parallel=1)
    assert [a.id for a in queued] == ["a1", "a2"]


@pytest.mark.python_only
def test_without_early_stop_all_finish(tmp_path):
    records = executor(tmp_path, FakeBackend({"a1": 0.3}, solves={"a2"})).attempt_many(
        plans(3), early_stop=False, parallel=3)
    assert [a.verdict for a in records] == ["fail", "pass", "fail"]


@pytest.mark.python_only
def test_an_error_stops_the_siblings_unrecorded_and_is_raised(tmp_path):
    backend = FakeBackend({"a1": 0.1, "a2": 5.0, "a3": 0.0}, fails={"a1"})
    ex = executor(tmp_path, backend)
    with pytest.raises(SproutError, match="a1 broke"):
        ex.attempt_many(plans(3), early_stop=True, parallel=3)
    assert backend.stopped == {"a2"}  # stopped by a1's error, 5 s before its end
    assert [a.id for a in ex.attempts] == ["a3"]  # a2 was stopped: resume reruns it


@pytest.mark.python_only
def test_a_sibling_that_fails_after_a_solve_is_recorded_cancelled(tmp_path):
    """Once a sibling scored 1 the round's answer is known: a sibling failing then (e.g. its sandbox start
    broken off) is cancelled like the others, not an error that ends the run."""
    records = executor(tmp_path, FakeBackend({"a1": 5.0, "a2": 0.1}, solves={"a2"}, fails={"a1"})).attempt_many(
        plans(2), early_stop=True, parallel=2)
    assert [(a.id, a.status) for a in records] == [("a1", "cancelled"), ("a2", "submitted")]


@pytest.mark.python_only
def test_a_recorded_attempt_that_is_not_planned_is_refused(tmp_path):
    record = executor(tmp_path, FakeBackend({})).attempt_many(plans(1), early_stop=True, parallel=1)[0]
    other = AttemptRecord.model_validate(record.model_dump() | {"step_limit": 3})
    with pytest.raises(SproutError, match="not the one this run plans"):
        executor(tmp_path, FakeBackend({}), recorded=[other]).attempt_many(plans(1), early_stop=True, parallel=1)


LATENCY_S = 1.0  # per model call
NOTES = [f"Branch note {i}: look again before submitting." for i in range(1, 5)]
REVIEW4 = {"branch_points": [{"turn": turn, "mistake_turn": 4, "mistake": "submitted a wrong fix",
                              "reason": f"reason {turn}", "note": note} for turn, note in enumerate(NOTES)]}
FIX = "sed -i 's/return a - b/return a + b/' /app/calc.py"


def branch_steps(note: str, commands: list[str]) -> list[dict]:
    """A branch's replies, given only to the conversation that holds its review note."""
    return [{"thought": f"step {i}", "command": c, "conversation": note} for i, c in enumerate(commands)]


def evaluate_round(dataset, out: Path, branches: list[list[str]], *extra: str, env: dict | None = None,
                   remote: bool = False) -> tuple[subprocess.CompletedProcess, dict[str, list[float]]]:
    """A SPROUT evaluation whose a1 fails and whose round 1 runs 4 branches (branches[i]: branch i+1's
    commands) with the scripted model answering each call after LATENCY_S; with the times the agent's
    model calls arrived, for each branch (r1b1..r1b4)."""
    script = FIRST + [step for note, commands in zip(NOTES, branches) for step in branch_steps(note, commands)]
    with ScriptedModelServer([{"content": json.dumps(REVIEW4)}]) as reviewer, \
            ScriptedModelServer(script, delay_s=LATENCY_S) as agent:
        args = evaluate_args(dataset, out, agent.base_url, "--review-endpoint", reviewer.base_url, "--branches", "4",
                             *extra)
        if remote:
            at = args.index("--model-key-env")
            del args[at:at + 2]
        result = run_module("sprout.eval.evaluate", *args, env=env)
        calls = agent.requests
    return result, {f"r1b{i}": [c["time"] for c in calls if note in json.dumps(c["body"])]
                    for i, note in enumerate(NOTES, start=1)}


def ran_at_once(calls: dict[str, list[float]]) -> bool:
    """Every branch called the model before any branch made its last call: the four overlapped."""
    return max(times[0] for times in calls.values()) < min(times[-1] for times in calls.values())


def round_leases(stdout: str, url: str, config: Path) -> set[str]:
    """The workers the round's four rollouts were leased to, from the Run Store's events of the run's group;
    fails unless all four were leased before any of them ended."""
    match = re.search(r"\(group (\S+)\)", stdout)
    assert match, stdout
    events = RunStoreClient(url, (config / "secrets" / "submitter.token").read_text().strip()).events(match[1])
    rollouts = [e.job_id for e in events if e.type == EventType.SUBMITTED and e.data["kind"] == "rollout"][1:]
    round_events = [e for e in events if e.job_id in rollouts]
    first_end = next(i for i, e in enumerate(round_events) if e.type == EventType.SUCCEEDED)
    leased = [e for e in round_events[:first_end] if e.type == EventType.LEASED]
    assert len(rollouts) == len(leased) == 4, events
    return {e.data["worker_id"] for e in leased}


def sandbox_ids() -> set[str]:
    return {s.id for s in Store().sandboxes()}


def test_a_round_of_four_branches_runs_at_once(dataset, outputs, tmp_path):
    out = tmp_path / "parallel"
    outputs.append(out)
    result, calls = evaluate_round(dataset, out, [["ls /app", "cat /app/calc.py", SUBMIT]] * 4, "--no-early-stop")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_summary(out)
    assert [a.id for a in summary.attempts] == ["a1", "r1b1", "r1b2", "r1b3", "r1b4"]
    assert [a.from_turn for a in summary.attempts[1:]] == [0, 1, 2, 3]
    assert all(a.status == "submitted" and a.turns == 3 and a.verdict == "fail" for a in summary.attempts[1:])
    assert [len(times) for times in calls.values()] == [3, 3, 3, 3] and ran_at_once(calls), calls


def test_early_stop_cancels_the_running_siblings(dataset, outputs, tmp_path):
    out = tmp_path / "early"
    outputs.append(out)
    before = sandbox_ids()
    slow = ["ls /app"] * 20  # 20 s and more if not cancelled
    result, calls = evaluate_round(dataset, out, [slow, [FIX, SUBMIT], slow, slow], "--step-limit", "24")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_summary(out)
    assert summary.status == "solved" and summary.solved_by == "r1b2"
    assert [(a.id, a.status, a.verdict) for a in summary.attempts[1:]] == [
        ("r1b1", "cancelled", "cancelled"), ("r1b2", "submitted", "pass"), ("r1b3", "cancelled", "cancelled"),
        ("r1b4", "cancelled", "cancelled")]
    assert {p.name for p in (out / "attempts").iterdir()} == {"a1.jsonl", "r1b2.jsonl"}  # theirs are discarded
    solved_at = summary.attempts[2].finished.timestamp()
    late = {branch: sum(t > solved_at for t in times) for branch, times in calls.items() if branch != "r1b2"}
    assert all(n <= 1 for n in late.values()), late  # the slow ones stopped within a turn of r1b2's solve
    assert sandbox_ids() <= before
    # the same run again: finished, the cancelled records stay as they are
    again, _ = evaluate_round(dataset, out, [slow, [FIX, SUBMIT], slow, slow], "--step-limit", "24")
    assert again.returncode == 0 and "already finished" in again.stdout


def test_over_a_run_store_the_branches_run_on_free_workers(dataset, outputs, tmp_path):
    """2 workers x 2 slots, as `services` starts them (a 120 s lease; a heartbeat every 2 s, which stops a
    cancelled job's rollout)."""
    config = tmp_path / "cfg"
    assert services(config, "init", "--port", str(free_port()), "--slots", "2").returncode == 0
    up = services(config, "up", "runstore-api")
    workers: list[subprocess.Popen] = []
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        exports = dict(item.split("=", 1) for item in services(config, "env").stdout.split()[1:])
        for _ in range(2):
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "sprout.worker", "serve", "--url", exports["SPROUT_RUNSTORE_URL"],
                 "--token-file", str(config / "secrets" / "worker.token"), "--slots", "2"],
                cwd=REPO, env={**os.environ, "SPROUT_RUNTIME_BIN": str(RUNTIME_BIN)},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        env = {**exports, KEY_ENV: None}
        out, early = tmp_path / "remote", tmp_path / "remote-early"
        outputs.extend([out, early])
        result, calls = evaluate_round(dataset, out, [["ls /app", "cat /app/calc.py", SUBMIT]] * 4,
                                       "--no-early-stop", env=env, remote=True)
        assert result.returncode == 0, result.stdout + result.stderr
        assert [len(times) for times in calls.values()] == [3, 3, 3, 3], calls
        # the round's four rollouts were all leased, to both workers, before any of them ended (a fresh
        # worker's first rollout starts its model calls late, so the calls need not overlap here)
        assert len(round_leases(result.stdout, exports["SPROUT_RUNSTORE_URL"], config)) == 2
        before = sandbox_ids()
        slow = ["ls /app"] * 8
        result, _ = evaluate_round(dataset, early, [slow, [FIX, SUBMIT], slow, slow], env=env, remote=True)
        assert result.returncode == 0, result.stdout + result.stderr
        assert [a.status for a in read_summary(early).attempts[1:]] == ["cancelled", "submitted", "cancelled",
                                                                           "cancelled"]
        deadline = time.monotonic() + 30  # the workers' heartbeats stop the cancelled jobs, which discard theirs
        while (sandbox_ids() - before or list((early / "attempts").glob("r1b[134].jsonl"))) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not sandbox_ids() - before and {p.name for p in (early / "attempts").iterdir()} == {
            "a1.jsonl", "r1b2.jsonl"}
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(timeout=60)
        services(config, "down")
