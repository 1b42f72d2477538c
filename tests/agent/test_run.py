"""End to end: the worker's `run` with the scripted model server, real podman + btrfs + mini-swe-agent."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sprout.agent.journal import read_journal
from sprout.sandbox import Store
from sprout.testing.scripted_model import ScriptedModelServer
from tests.conftest import REPO, RUNTIME_BIN

FIZZBUZZ = ("cat > fizzbuzz.py <<'PY'\nimport sys\nfor i in range(1, int(sys.argv[1]) + 1):\n"
            "    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)\nPY")
SCRIPT = [
    {"thought": "Look around first.", "command": "ls -la"},
    {"thought": "Write the program.", "command": FIZZBUZZ},
    {"thought": "Run it.", "command": "python3 fizzbuzz.py 15"},
    {"thought": "Check 15.", "command": "test \"$(python3 fizzbuzz.py 15 | tail -1)\" = FizzBuzz && echo OK"},
    {"thought": "Submit.", "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat fizzbuzz.py"},
]
TASK = "write fizzbuzz.py, run it, and check that 15 prints FizzBuzz"


def worker_run(server_url: str, journal: Path, *extra: str, task: str | None = TASK, env: dict | None = None,
               background: bool = False):
    cmd = [sys.executable, "-m", "sprout.worker", "run", "--model", "scripted", "--runtime-bin", str(RUNTIME_BIN),
           "--sandbox-image", "docker.io/library/python:3.11-slim", "--cwd", "/tmp", "--journal", str(journal),
           "--model-retries", "2", *extra, *([task] if task else [])]
    full_env = {**os.environ, "OPENAI_BASE_URL": server_url, "OPENAI_API_KEY": "sk-secret-do-not-leak", **(env or {})}
    if background:
        return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=300)


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ops.report", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def cleanup_journals():
    journals: list[Path] = []
    yield journals
    store = Store()
    for path in journals:
        if path.exists():
            for turn in read_journal(path).turns:
                if turn.checkpoint:
                    store.remove_checkpoint(turn.checkpoint, force=True)


def test_fizzbuzz_run_journal_checkpoints_and_reports(tmp_path, cleanup_journals):
    journal = tmp_path / "first.jsonl"
    cleanup_journals.append(journal)
    with ScriptedModelServer(SCRIPT) as server:
        result = worker_run(server.base_url, journal)
        requests = server.requests
    assert result.returncode == 0, result.stdout + result.stderr
    assert "submitted" in result.stdout and "final checkpoint ck-" in result.stdout
    j = read_journal(journal)
    assert j.problems == [] and j.outcome.status == "submitted" and j.outcome.turns == 5
    assert [t.turn for t in j.turns] == [1, 2, 3, 4, 5]
    assert j.header.endpoint_host == server.base_url.split("//")[1].split("/")[0]
    assert j.header.git_commit and j.header.task == TASK
    store = Store()
    has_file = [(Path(store.checkpoint(t.checkpoint).path) / "tmp/fizzbuzz.py").exists() for t in j.turns]
    assert has_file == [False, True, True, True, True]  # from turn 2 (where it was written) on, not before
    assert "FizzBuzz" in j.turns[2].observation and j.turns[2].exit_code == 0
    assert all(t.tokens_in > 0 and t.tokens_out > 0 and t.checkpoint_ms > 0 for t in j.turns)
    assert j.outcome.final_checkpoint == j.turns[-1].checkpoint
    # what each turn changed on disk, since the checkpoint before it (the first turn: since the image)
    assert [t.changes.since for t in j.turns] == [j.header.image_key] + [t.checkpoint for t in j.turns[:-1]]
    assert [t.changes.paths for t in j.turns] == [[], ["A /tmp/fizzbuzz.py"], [], [], []]
    # the host's environment (the API key) never reaches the sandbox
    assert all("sk-secret" not in json.dumps(r["body"]) for r in requests)

    snapshots = report("snapshots", str(journal))
    assert snapshots.returncode == 0
    for turn in j.turns:
        assert turn.checkpoint in snapshots.stdout
    assert "python3 fizzbuzz.py 15" in snapshots.stdout and "submitted" in snapshots.stdout
    out = tmp_path / "first.md"
    assert report("export", str(journal), "-o", str(out)).returncode == 0
    markdown = out.read_text()
    assert markdown.startswith("# Sprout rollout:") and "## Turn 5" in markdown
    assert "```bash\npython3 fizzbuzz.py 15\n```" in markdown and "<details><summary>observation" in markdown
    assert "**submitted**" in markdown
    assert f"changes on disk since `{j.turns[0].checkpoint}`: 1 added, 0 changed, 0 removed: A /tmp/fizzbuzz.py" \
        in markdown
    assert report("export", str(journal)).stdout == markdown


@pytest.mark.parametrize("backend", [pytest.param("container", marks=pytest.mark.rootless), "microvm"])
def test_resume_from_turn_1_restores_sandbox_and_messages(tmp_path, cleanup_journals, backend):
    journal, branch = tmp_path / "three.jsonl", tmp_path / "branch.jsonl"
    cleanup_journals += [journal, branch]
    three = [{"thought": "a", "command": "echo one > /tmp/one"}, {"thought": "b", "command": "echo two > /tmp/two"},
             {"thought": "c", "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; uname -r"}]
    with ScriptedModelServer(three) as server:
        first = worker_run(server.base_url, journal, "--backend", backend, task="make files")
        assert first.returncode == 0, first.stdout + first.stderr
    parent = read_journal(journal)
    assert Store().checkpoint(parent.turns[0].checkpoint).limits.get("backend", "container") == backend
    assert (os.uname().release in parent.turns[-1].observation) == (backend == "container")
    resumed = [{"thought": "look", "command": "ls /tmp"}, {"thought": "done", "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]
    with ScriptedModelServer(resumed) as server:
        result = worker_run(server.base_url, branch, "--from", str(journal), "--turn", "1", "--note", "skip two",
                            task=None)
        first_request = server.requests[0]["body"]["messages"]
    assert result.returncode == 0, result.stdout + result.stderr
    child = read_journal(branch)
    assert child.header.parent.turn == 1 and child.header.parent.checkpoint == parent.turns[0].checkpoint
    assert child.header.parent.journal == str(journal) and child.header.task == "make files"
    assert [t.turn for t in child.turns] == [2, 3]
    if backend == "container":  # a branch's first turn: since the checkpoint it branched from
        assert child.turns[0].changes.since == parent.turns[0].checkpoint and child.turns[0].changes.paths == []
        assert parent.turns[1].changes.paths == ["A /tmp/two"]
    else:  # a microVM's files are inside its disk
        assert all(t.changes is None for t in child.turns + parent.turns)
    listing = child.turns[0].observation.split()
    assert "one" in listing and "two" not in listing  # the branch's sandbox is turn 1's, not turn 2's
    history = parent.messages_up_to(1)
    sent = first_request[:-1]
    assert len(sent) == len(history)
    for got, want in zip(sent, history):
        assert got["role"] == want["role"] and (got.get("content") or "") == (want.get("content") or "")
    assert first_request[-1] == {"role": "user", "content": "skip two"}


def test_model_500_then_success_is_retried(tmp_path, cleanup_journals):
    journal = tmp_path / "retry.jsonl"
    cleanup_journals.append(journal)
    script = [{"status": 500, "body": "overloaded"}, {"thought": "ok", "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]
    with ScriptedModelServer(script) as server:
        result = worker_run(server.base_url, journal, task="anything")
        statuses = [r["status"] for r in server.requests]
    assert result.returncode == 0, result.stdout
    assert statuses == [500, 200]
    assert read_journal(journal).outcome.status == "submitted"


def test_bad_endpoint_gives_one_clear_error_and_an_error_outcome(tmp_path, cleanup_journals):
    journal = tmp_path / "bad.jsonl"
    cleanup_journals.append(journal)
    result = worker_run("http://127.0.0.1:9/v1", journal, "--model-retries", "1", task="anything")
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert "error" in result.stdout and ("Connection" in result.stdout or "connect" in result.stdout.lower())
    j = read_journal(journal)
    assert j.outcome.status == "error" and j.turns == [] and j.outcome.message


def test_crash_mid_run_leaves_a_readable_journal(tmp_path, cleanup_journals):
    journal = tmp_path / "crash.jsonl"
    cleanup_journals.append(journal)
    script = [{"thought": "1", "command": "echo a"}, {"thought": "2", "command": "echo b"},
              {"thought": "3", "command": "echo c", "delay_s": 60}]
    with ScriptedModelServer(script) as server:
        proc = worker_run(server.base_url, journal, task="slow", background=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if journal.exists() and journal.read_text().count('"kind":"turn"') >= 2:
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with journal.open("a") as f:
        f.write('{"kind":"turn","turn":3,"checkp')  # what a crash mid-write leaves
    snapshots = report("snapshots", str(journal))
    assert snapshots.returncode == 0
    j = read_journal(journal)
    assert [t.turn for t in j.turns] == [1, 2] and j.outcome is None
    assert any("truncated" in p for p in j.problems)
    assert j.turns[0].checkpoint in snapshots.stdout and "truncated" in snapshots.stderr
    # the killed worker's sandbox is left running; remove it
    Store().remove_sandbox(j.header.sandbox, force=True)


def test_text_model_class_and_sandbox_uname(tmp_path, cleanup_journals):
    journal = tmp_path / "text.jsonl"
    cleanup_journals.append(journal)
    with ScriptedModelServer([{"thought": "t", "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]) as server:
        result = worker_run(server.base_url, journal, "--model-class", "text", task="anything")
        body = server.requests[0]["body"]
    assert result.returncode == 0, result.stdout
    assert not body.get("tools")
    assert read_journal(journal).outcome.status == "submitted"


def test_environment_reports_the_sandbox_uname_and_kills_on_timeout():
    from sprout.agent.environment import SandboxEnvironment

    store = Store(runtime_bin=RUNTIME_BIN)
    sandbox = store.create_sandbox("docker.io/library/python:3.11-slim")
    try:
        env = SandboxEnvironment(sandbox, cwd="/tmp", timeout=1)
        assert env.get_template_vars()["node"] == "sandbox" and env.get_template_vars()["system"] == "Linux"
        out = env.execute({"command": "sleep 100 & sleep 100"})
        assert out["returncode"] == -1 and "timed out" in out["exception_info"]
        assert "sleep 100" not in sandbox.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").output
        assert env.execute({"command": "pwd"})["output"].strip() == "/tmp"
    finally:
        sandbox.destroy()
