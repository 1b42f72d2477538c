"""Fixtures shared by the RL driver's tests that run real sandboxes."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.method.conftest import FIXTURES


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> tuple[Path, dict, dict]:
    """tasks/py-bugfix and tasks/no-reward (the same, with a test.sh that writes no reward), prepared with
    `python -m sprout.rl_driver prepare` (their image built); their Miles prompt lines."""
    root = tmp_path_factory.mktemp("rl-tasks")
    shutil.copytree(FIXTURES / "py-bugfix", root / "tasks" / "py-bugfix")
    shutil.copytree(FIXTURES / "py-bugfix", root / "tasks" / "no-reward")
    (root / "tasks/no-reward/tests/test.sh").write_text("#!/bin/bash\necho 'no reward written'\n")
    out = root / "miles.jsonl"
    prepared = subprocess.run([sys.executable, "-m", "sprout.rl_driver", "prepare", "--tasks-dir", root / "tasks",
                               "-o", out], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    prompts = {p["metadata"]["task_id"]: p for p in map(json.loads, out.read_text().splitlines())}
    assert sorted(prompts) == ["no-reward", "py-bugfix"]
    prompt = prompts["py-bugfix"]
    assert prompt["metadata"]["image"].startswith("localhost/")
    assert prompt["prompt"] == [{"role": "user", "content": (root / "tasks/py-bugfix/instruction.md").read_text()}]
    return root / "tasks", prompt, prompts["no-reward"]
