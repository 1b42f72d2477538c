"""Grading with Harbor's own Verifier, live in the attempt's sandbox or in a branch of a checkpoint:
rewards, errors, timeouts, and a final checkpoint that stays byte-identical either way."""

import hashlib
import os
import time
from pathlib import Path

from sprout.tasks import load_task, start_task_sandbox
from sprout.tasks.grade import grade
from tests.tasks.conftest import FIXTURES, SLOW_FIXTURES


def solve(task_dir: Path) -> str:
    return (task_dir / "solution" / "solve.sh").read_text()


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under root: type, mode, owner, size, mtime and content (or link target)."""
    entries = {}
    for current, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(current) / name
            st = path.lstat()
            meta = f"{st.st_mode:o} {st.st_uid}:{st.st_gid} {st.st_size} {st.st_mtime_ns}"
            if path.is_symlink():
                meta += " -> " + os.readlink(path)
            elif path.is_file():
                meta += " " + hashlib.sha256(path.read_bytes()).hexdigest()
            entries[str(path.relative_to(root))] = meta
    return entries


def test_grading_leaves_the_checkpoint_byte_identical(fast_store, checkpoint_of):
    task_dir = FIXTURES / "py-bugfix"
    checkpoint = checkpoint_of(task_dir, solve(task_dir))
    before = tree_digest(checkpoint.path)
    result = grade(fast_store, checkpoint, load_task(task_dir))
    assert result.verdict == "pass" and result.reward == 1.0 and result.error is None and result.mode == "branch"
    assert "2 passed" in result.verifier_output
    assert tree_digest(checkpoint.path) == before
    assert not (checkpoint.path / "tests").exists() and not fast_store.branches_of(checkpoint.id)


SERVER_TEST = """#!/bin/bash
python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8765/')" && r=1 || r=0
echo $r > /logs/verifier/reward.txt
"""


def test_live_grading_sees_what_the_attempt_left_running_and_keeps_its_checkpoint(fast_store, copy_task, tmp_path):
    task = load_task(copy_task("py-bugfix", **{"tests/test.sh": SERVER_TEST}))
    sandbox = start_task_sandbox(fast_store, task, "tasks-test")
    checkpoint = None
    try:
        sandbox.exec("setsid python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 < /dev/null & "
                     "sleep 1", cwd="/tmp")
        checkpoint = sandbox.checkpoint(label="tasks-test")
        before = tree_digest(checkpoint.path)
        live = grade(fast_store, sandbox, task, trial_dir=tmp_path / "live")
        branch = grade(fast_store, checkpoint, task, trial_dir=tmp_path / "branch")
        assert (live.mode, live.reward) == ("live", 1.0) and sandbox.running  # the sandbox stays the caller's
        assert (branch.mode, branch.reward) == ("branch", 0.0)  # no process survives into a branch
        assert tree_digest(checkpoint.path) == before
    finally:
        sandbox.destroy()
        if checkpoint is not None:
            fast_store.remove_checkpoint(checkpoint.id, force=True)


def test_reward_txt_and_reward_json_are_read(fast_store, checkpoint_of):
    bugfix = load_task(FIXTURES / "py-bugfix")
    assert grade(fast_store, checkpoint_of(bugfix.task_dir), bugfix).rewards == {"reward": 0.0}  # reward.txt
    reward_json = load_task(FIXTURES / "reward-json")  # writes reward.txt = 0.5 as well: JSON must win
    solved = grade(fast_store, checkpoint_of(reward_json.task_dir, solve(reward_json.task_dir)), reward_json)
    assert solved.rewards == {"reward": 1.0, "checks_passed": 2} and solved.verdict == "pass"
    unsolved = grade(fast_store, checkpoint_of(reward_json.task_dir), reward_json)
    assert unsolved.reward == 0.0 and unsolved.verdict == "fail"
    assert "'mean_of_three': False" in unsolved.verifier_output


def test_no_reward_file_is_an_error_not_zero_and_the_exit_code_does_not_count(fast_store, checkpoint_of,
                                                                              copy_task, tmp_path):
    silent = copy_task("shell-count", **{"tests/test.sh": "#!/bin/bash\necho tests ran\n"})
    checkpoint = checkpoint_of(silent)
    result = grade(fast_store, checkpoint, load_task(silent))
    assert result.verdict == "error" and result.reward is None
    assert "no reward" in result.error and result.verifier_output == "tests ran\n"
    failing = copy_task("py-bugfix", **{"tests/test.sh": "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\nexit 3\n"})
    assert grade(fast_store, checkpoint_of(failing), load_task(failing)).verdict == "pass"
    # a reward the attempt itself left in /logs/verifier never counts, nor one from an earlier grade
    planted = copy_task("reward-json", **{"tests/test.sh": "#!/bin/bash\ntrue\n"})
    checkpoint = checkpoint_of(planted, "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt")
    (tmp_path / "trial" / "verifier").mkdir(parents=True)
    (tmp_path / "trial" / "verifier" / "reward.txt").write_text("1")
    result = grade(fast_store, checkpoint, load_task(planted), trial_dir=tmp_path / "trial")
    assert result.verdict == "error" and "no reward" in result.error


def test_verifier_timeout_is_reported_and_stops_the_tests(fast_store, checkpoint_of):
    task = load_task(SLOW_FIXTURES / "verifier-hangs")
    assert task.config.verifier.timeout_sec == 3
    checkpoint = checkpoint_of(task.task_dir)
    started = time.monotonic()
    result = grade(fast_store, checkpoint, task)
    assert time.monotonic() - started < 15
    assert result.verdict == "error" and result.reward is None
    assert "timed out after 3s" in result.error and result.verifier_output == "started; hanging now\n"
    assert not fast_store.branches_of(checkpoint.id)
