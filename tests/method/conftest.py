"""Fixtures for the method and evaluation tests: a one-task dataset copied from the fixture tasks,
its preparation manifest, the evaluate CLI as a subprocess, and a leak check over every journal."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from sprout.agent.journal import read_journal
from sprout.jobs.journals import release
from sprout.sandbox import Store
from sprout.sandbox.errors import SproutError
from tests.conftest import REPO, RUNTIME_BIN

FIXTURES = REPO / "tests" / "fixtures" / "tasks"
KEY_ENV = "SPROUT_METHOD_TEST_KEY"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@dataclass
class Dataset:
    tasks_dir: Path
    task_dir: Path
    manifest: Path
    digest: str


def run_module(module: str, *args, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m module args` in the repo; `env` adds variables (None removes one)."""
    full = {k: v for k, v in {**os.environ, KEY_ENV: "sk-do-not-record", **(env or {})}.items() if v is not None}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=full)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Dataset:
    """tasks/py-bugfix (a copy of the fixture) and its manifest, prepared once (images built)."""
    return prepared_dataset(tmp_path_factory.mktemp("dataset"))


def prepared_dataset(root: Path, network_mode: str | None = None) -> Dataset:
    """A copy of py-bugfix (its environment under `network_mode`, when given) and its manifest."""
    tasks_dir = root / "tasks"
    shutil.copytree(FIXTURES / "py-bugfix", tasks_dir / "py-bugfix")
    if network_mode:
        toml = tasks_dir / "py-bugfix" / "task.toml"
        toml.write_text(toml.read_text().replace("[environment]", f'[environment]\nnetwork_mode = "{network_mode}"'))
    manifest = root / "prep.json"
    result = run_module("sprout.eval.prepare", "--tasks-dir", tasks_dir, "-o", manifest)
    assert result.returncode == 0, result.stdout + result.stderr
    digest = json.loads(manifest.read_text())["dataset"]["digest"]
    return Dataset(tasks_dir, tasks_dir / "py-bugfix", manifest, digest)


def evaluate_args(ds: Dataset, out: Path, agent_url: str, *extra: str, method: str = "sprout") -> list[str]:
    return ["--task-dir", str(ds.task_dir), "--dataset-digest", ds.digest, "--preparation-manifest", str(ds.manifest),
            "--output", str(out), "--method", method, "--model", "scripted", "--model-endpoint", agent_url,
            "--model-key-env", KEY_ENV, "--runtime-bin", str(RUNTIME_BIN), "--allow-dirty", "--model-retries", "1",
            "--step-limit", "10", "--rounds", "1", "--branches", "1", *extra]


@pytest.fixture
def outputs(tmp_path: Path):
    """Output directories a test evaluates into; afterwards no sandbox or checkpoint of theirs is left."""
    made: list[Path] = []
    yield made
    store = Store()
    journals = [j for out in made for j in sorted(out.glob("**/attempts/*.jsonl"))]
    leaked = []
    for path in journals:
        try:
            journal = read_journal(path)
        except SproutError:
            continue
        ids = [journal.header.sandbox] + [t.checkpoint for t in journal.turns if t.checkpoint]
        for item in ids:
            try:
                (store.sandbox if item.startswith("sb-") else store.checkpoint)(item)
                leaked.append(item)
            except SproutError:
                pass
    release(store, journals)
    assert not leaked, f"left behind: {leaked}"
