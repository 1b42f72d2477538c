"""The gate over the fixture dataset, through its command line: each task's expected verdict."""

import json
import os
import random
import shutil
import subprocess
import sys
import time

import pytest

from sprout.eval.gate import FlakyTask, GateConfig, GateSummary, flaky_exclusion, run_gate, summary_line
from sprout.eval.prepare import prepare
from sprout.eval.provenance import read_manifest
from sprout.sandbox import SproutError
from sprout.sandbox.images import stand_in
from tests.coin import CoinServer, coin_task
from tests.conftest import DEBIAN_IMAGE, PYTHON_IMAGE, REPO, RUNTIME_BIN
from tests.tasks.conftest import FIXTURES, SLOW_FIXTURES

EXPECTED = {  # task: (verdict, oracle reward, nop reward)
    "broken-oracle": ("fail", 0.0, 0.0),
    "malformed-toml": ("error", None, None),
    "nop-passes": ("fail", 1.0, 1.0),
    "py-bugfix": ("pass", 1.0, 0.0),
    "reward-json": ("pass", 1.0, 0.0),
    "shell-count": ("pass", 1.0, 0.0),
}


def gate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sprout.eval.gate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})


def reward(attempt: dict | None) -> float | None:
    return attempt["grade"]["reward"] if attempt and attempt["grade"] else None


def test_gate_over_the_fixtures(tmp_path):
    out = tmp_path / "gate"
    proc = gate("--tasks-dir", str(FIXTURES), "--output", str(out), "--workers", "4",
                "--runtime-bin", str(RUNTIME_BIN))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # two tasks fail the gate, one is malformed
    summary = json.loads((out / "summary.json").read_text())
    got = {r["task"]: (r["verdict"], reward(r["oracle"]), reward(r["nop"])) for r in summary["results"]}
    assert got == EXPECTED
    assert (summary["passed"], summary["failed"], summary["errors"]) == (3, 2, 1)
    reasons = {r["task"]: r["reason"] for r in summary["results"]}
    assert reasons["broken-oracle"] == "oracle scored 0, must be 1"
    assert reasons["nop-passes"] == "nop scored 1, must be 0"
    assert reasons["malformed-toml"].startswith("task malformed-toml: task.toml is not valid TOML")
    assert "gate: 3/6 passed, 2 failed, 1 error(s)" in proc.stdout
    for task in ("py-bugfix", "broken-oracle"):
        assert f"│ {task}" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    logs = out / "py-bugfix"
    assert (logs / "oracle" / "verifier" / "reward.txt").read_text().strip() == "1"
    assert "2 passed" in (logs / "oracle" / "verifier" / "test-stdout.txt").read_text()
    assert (logs / "nop" / "verifier" / "reward.txt").read_text().strip() == "0"
    assert json.loads((logs / "result.json").read_text())["verdict"] == "pass"
    on_python = ["broken-oracle", "nop-passes", "py-bugfix", "reward-json"]  # FROM python:3.11-slim
    on_debian = ["shell-count"]  # docker_image debian:bookworm
    assert summary["stand_in_tasks"] == sorted(on_python * stand_in(PYTHON_IMAGE) + on_debian * stand_in(DEBIAN_IMAGE))
    assert (out / "reward-json" / "oracle" / "verifier" / "reward.json").exists()
    assert_harbor_reads_the_gate(out)


def assert_harbor_reads_the_gate(out):
    """The gate is a Harbor job too: Harbor's own scanner lists it, a trial per task and attempt with its
    reward (or the task's error), and the verifier's files beside each trial."""
    from harbor.viewer.scanner import JobScanner

    scanner = JobScanner(out / "harbor")
    assert scanner.list_jobs() == ["gate"]
    assert {a.name for a in scanner.get_job_config("gate").agents} == {"oracle", "nop"}
    assert scanner.get_job_result("gate").n_total_trials == 2 * len(EXPECTED)
    assert scanner.list_trials("gate") == sorted(f"{task}__{agent}" for task in EXPECTED for agent in ("oracle", "nop"))
    for task, (_, oracle, nop) in EXPECTED.items():
        for agent, expected in (("oracle", oracle), ("nop", nop)):
            trial = scanner.get_trial_result("gate", f"{task}__{agent}")
            assert trial.agent_info.name == agent and trial.task_name == task
            assert (trial.verifier_result.rewards["reward"] if trial.verifier_result else None) == expected, trial
    malformed = scanner.get_trial_result("gate", "malformed-toml__oracle").exception_info
    assert malformed.exception_message.startswith("task malformed-toml: task.toml is not valid TOML")
    assert "2 passed" in (out / "harbor" / "gate" / "py-bugfix__oracle" / "verifier" / "test-stdout.txt").read_text()


@pytest.mark.parametrize("args, message, code", [
    (["--tasks-dir", "/no/such/dir"], "error: no tasks directory /no/such/dir", 1),
    (["--tasks-dir", str(FIXTURES), "--tasks", "py-bugfix,nosuch"], "error: no task named nosuch in", 1),
    (["--tasks-dir", str(FIXTURES), "--workers", "0"], "error: --workers must be at least 1", 2),  # usage
])
def test_user_errors_are_one_line(args, message, code, tmp_path):
    proc = gate(*args, "--output", str(tmp_path / "gate"))
    assert proc.returncode == code
    assert proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_hanging_and_unhealthy_tasks_are_cut_off_and_reported(copy_task, tmp_path):
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    hangs = copy_task("verifier-hangs", source=SLOW_FIXTURES)
    hangs.rename(dataset / "verifier-hangs")
    oracle_hangs = copy_task("shell-count", **{"solution/solve.sh": "#!/bin/bash\n(sleep 300 &)\nsleep 301\n"})
    toml = oracle_hangs / "task.toml"
    toml.write_text(toml.read_text().replace("timeout_sec = 120.0", "timeout_sec = 2.0"))
    oracle_hangs.rename(dataset / "oracle-hangs")
    unhealthy = copy_task("py-bugfix")
    (unhealthy / "task.toml").write_text((unhealthy / "task.toml").read_text() + (
        "\n[environment.healthcheck]\ncommand = \"test -f /app/ready\"\ninterval_sec = 0.1\nretries = 2\n"))
    unhealthy.rename(dataset / "unhealthy")

    started = time.monotonic()
    summary = run_gate(GateConfig(tasks_dir=dataset, output=tmp_path / "gate", workers=3, runtime_bin=RUNTIME_BIN))
    assert time.monotonic() - started < 60
    reasons = {r.task: (r.verdict, r.reason) for r in summary.results}
    assert reasons == {
        "oracle-hangs": ("fail", "oracle scored 0, must be 1 (solve.sh timed out after 2s ([agent].timeout_sec))"),
        "unhealthy": ("error", "oracle: Healthcheck failed after 2 consecutive retries: test -f /app/ready"),
        "verifier-hangs": ("error", "oracle: the verifier timed out after 3s ([verifier].timeout_sec); "
                                    "its processes were killed"),
    }


def test_the_gate_runs_its_attempts_in_microvms(tmp_path):
    """--backend microvm: the oracle and nop run, and are graded by Harbor's verifier, in VMs (the
    oracle here fails unless the guest agent is PID 1), their files moved through the guest agent."""
    task = tmp_path / "tasks" / "shell-count"
    shutil.copytree(FIXTURES / "shell-count", task)
    (task / "solution" / "solve.sh").write_text(
        '#!/bin/bash\nset -euo pipefail\n[ "$(cat /proc/1/comm)" = sprout-agent ]\n'
        'grep -c "$PATTERN" app.log > count.txt\n')
    out = tmp_path / "gate"
    proc = gate("--tasks-dir", str(task.parent), "--output", str(out), "--backend", "microvm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "summary.json").read_text())["results"][0]
    assert (result["verdict"], reward(result["oracle"]), reward(result["nop"])) == ("pass", 1.0, 0.0)
    assert (out / "shell-count" / "oracle" / "verifier" / "reward.txt").read_text().strip() == "1"


def test_trials_find_the_flaky_task_and_give_its_rates(tmp_path):
    """--trials 4 over a steady task and a coin whose oracle passes at random about half the time (a fixed
    seed's schedule, so this test is not flaky): the coin is flaky with the schedule's pass rate, the
    steady task passes in every trial, and the trials ran concurrently."""
    draws = random.Random(1)
    schedule = [int(draws.random() < 0.5) for _ in range(4)]
    assert schedule == [1, 0, 0, 1]
    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURES / "py-bugfix", tasks / "py-bugfix")
    with CoinServer(schedule) as coin:
        coin_task(tasks / "coin", coin)
        summary = run_gate(GateConfig(tasks_dir=tasks, output=tmp_path / "gate", workers=4, trials=4,
                                      runtime_bin=RUNTIME_BIN))
    results = {r.task: r for r in summary.results}
    flaky, steady = results["coin"], results["py-bugfix"]
    assert flaky.verdict == "flaky" and flaky.trials == 4, flaky.reason
    assert sorted(flaky.oracle_rewards) == [0.0, 0.0, 1.0, 1.0] and flaky.nop_rewards == [0.0] * 4
    assert (flaky.oracle_pass_rate, flaky.nop_zero_rate) == (0.5, 1.0)
    assert flaky.reason == "over 4 trials the oracle scored 1 in 50% and the nop 0 in 100%"
    assert steady.verdict == "pass" and (steady.oracle_pass_rate, steady.nop_zero_rate) == (1.0, 1.0)
    assert (summary.passed, summary.failed, summary.flaky, summary.errors, summary.trials) == (1, 0, 1, 0, 4)
    assert summary.flaky_tasks == [FlakyTask(task="coin", oracle_pass_rate=0.5, nop_zero_rate=1.0)]
    assert "1 flaky" in summary_line(summary) and "4 trials each" in summary_line(summary)
    saved = json.loads((tmp_path / "gate" / "coin" / "result.json").read_text())
    assert saved["verdict"] == "flaky" and saved["oracle_pass_rate"] == 0.5
    trials = [json.loads((tmp_path / "gate" / task / f"trial-{k}" / "result.json").read_text())
              for task in ("coin", "py-bugfix") for k in range(1, 5)]
    assert [t["verdict"] for t in trials[:4]].count("pass") == 2 and all(t["verdict"] == "pass" for t in trials[4:])
    assert sum(t["duration_s"] for t in trials) > 1.5 * summary.wall_s  # the trials ran at once
    harbor = tmp_path / "gate" / "harbor" / "gate"
    oracle = [json.loads((harbor / f"coin__oracle-{k}" / "result.json").read_text()) for k in range(1, 5)]
    assert sorted(t["verifier_result"]["rewards"]["reward"] for t in oracle) == [0.0, 0.0, 1.0, 1.0]
    assert len([d for d in harbor.iterdir() if d.is_dir()]) == 16  # 2 tasks x 4 trials x oracle and nop


def flaky_summary(path, *flaky: str, trials: int = 4) -> None:
    path.write_text(GateSummary(tasks_dir="tasks", workers=1, started_at="now", wall_s=1.0, passed=0, failed=0,
                                errors=0, results=[], trials=trials, flaky=len(flaky), flaky_tasks=[
                                    FlakyTask(task=t, oracle_pass_rate=0.5, nop_zero_rate=1.0) for t in flaky]
                                ).model_dump_json())


@pytest.mark.python_only
def test_a_gate_summary_names_the_flaky_tasks_to_leave_out(tmp_path):
    flaky_summary(tmp_path / "gate.json", "coin")
    exclusion = flaky_exclusion(tmp_path / "gate.json")
    assert (exclusion.tasks, exclusion.trials) == (["coin"], 4) and len(exclusion.sha256) == 64
    manifest = prepare(FIXTURES, tmp_path / "prep.json", exclude_flaky=flaky_exclusion(tmp_path / "gate.json"))
    names = [t.name for t in manifest.tasks]
    assert "py-bugfix" in names and "coin" not in names
    flaky_summary(tmp_path / "gate.json", "py-bugfix")
    manifest = prepare(FIXTURES, tmp_path / "prep.json", exclude_flaky=flaky_exclusion(tmp_path / "gate.json"))
    assert "py-bugfix" not in [t.name for t in manifest.tasks]
    assert read_manifest(tmp_path / "prep.json").excluded_flaky.tasks == ["py-bugfix"]
    flaky_summary(tmp_path / "once.json", trials=1)
    with pytest.raises(SproutError, match="ran each task once, which cannot tell a flaky task"):
        flaky_exclusion(tmp_path / "once.json")
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SproutError, match="is not a gate summary"):
        flaky_exclusion(tmp_path / "other.json")


def test_the_rl_prompt_file_leaves_out_the_flaky_tasks(tmp_path):
    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURES / "py-bugfix", tasks / "py-bugfix")
    shutil.copytree(FIXTURES / "shell-count", tasks / "shell-count")
    flaky_summary(tmp_path / "gate.json", "shell-count")
    ran = subprocess.run([sys.executable, "-m", "sprout", "rl-driver", "prepare", "--tasks-dir", tasks, "-o",
                          tmp_path / "miles.jsonl", "--exclude-flaky", tmp_path / "gate.json"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    prompts = [json.loads(line) for line in (tmp_path / "miles.jsonl").read_text().splitlines()]
    assert [p["metadata"]["task_id"] for p in prompts] == ["py-bugfix"]
    assert "left out as flaky by" in ran.stdout and "shell-count" in ran.stdout
    manifest = read_manifest(tmp_path / "miles.prep.json")
    assert manifest.excluded_flaky.tasks == ["shell-count"] and [t.name for t in manifest.tasks] == ["py-bugfix"]
