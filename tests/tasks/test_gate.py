"""The gate over the fixture dataset, through its command line: each task's expected verdict."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from sprout.eval.gate import GateConfig, run_gate
from tests.conftest import REPO, RUNTIME_BIN
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
    assert (out / "reward-json" / "oracle" / "verifier" / "reward.json").exists()


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
