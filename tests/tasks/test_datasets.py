"""`sprout datasets get`, offline and for real: Harbor's own registry client over a legacy registry.json
whose entries point at a git repository the test makes, and SWE-bench Pro's git path over a local bare
repository with a tag."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sprout.eval.datasets import read_record
from sprout.eval.prepare import prepare
from tests.tasks.conftest import FIXTURES

pytestmark = pytest.mark.python_only  # git and Harbor's client, no podman


def git(*args: str, cwd: Path) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def repository(root: Path, files: dict[str, Path | str]) -> tuple[Path, str]:
    """A git repository at `root` holding `files` (a fixture directory or a text each), committed; its commit."""
    root.mkdir(parents=True)
    git("init", "-q", "-b", "main", cwd=root)
    for rel, content in files.items():
        target = root / rel
        if isinstance(content, Path):
            shutil.copytree(content, target)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
    git("add", "-A", cwd=root)
    git("commit", "-qm", "dataset", cwd=root)
    return root, git("rev-parse", "HEAD", cwd=root)


def get(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sprout", "datasets", "get", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_a_registry_dataset_comes_through_harbors_client_pinned_and_named(tmp_path):
    repo, commit = repository(tmp_path / "src", {"tasks/alpha": FIXTURES / "py-bugfix",
                                                 "tasks/beta": FIXTURES / "reward-json"})
    entries = [{"name": n, "git_url": f"file://{repo}", "git_commit_id": commit, "path": f"tasks/{n}"}
               for n in ("alpha", "beta")]
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps([{"name": "sprout-test/two", "version": "1.0", "description": "two tasks",
                                     "tasks": entries}]))
    out = tmp_path / "datasets" / "two"
    done = get("sprout-test/two@1.0", "--registry-path", registry, "-o", out, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["alpha", "beta"]
    assert (out / "alpha" / "task.toml").read_bytes() == (FIXTURES / "py-bugfix" / "task.toml").read_bytes()
    record = read_record(out)
    assert (record.name, record.ref, record.source, record.tasks) == ("sprout-test/two", "1.0", str(registry), 2)
    assert f"sprout-test/two@1.0: 2 tasks in {out}, digest {record.digest}" in " ".join(done.stdout.split())
    manifest = prepare(out, tmp_path / "prep.json")  # no store: digests only
    assert manifest.dataset.name == "sprout-test/two" and manifest.dataset.digest == record.digest
    assert manifest.dataset.ref == "1.0" and manifest.dataset.origin == str(registry)
    again = get("sprout-test/two@1.0", "--registry-path", registry, "-o", out, cwd=tmp_path)
    assert again.returncode == 1 and "is not empty (--overwrite replaces what it holds)" in again.stderr
    missing = get("sprout-test/two@9.9", "--registry-path", registry, "-o", tmp_path / "other", cwd=tmp_path)
    assert missing.returncode == 1 and "Version 9.9 of dataset sprout-test/two not found" in missing.stderr
    unpinned = get("sprout-test/two", "--registry-path", registry, "-o", tmp_path / "other", cwd=tmp_path)
    assert unpinned.returncode == 2 and "NAME@REF" in unpinned.stderr and "Traceback" not in unpinned.stderr


def test_a_task_repository_that_cannot_be_cloned_is_one_clear_error(tmp_path):
    gone = tmp_path / "no-such-repo"
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps([{"name": "sprout-test/gone", "version": "1.0", "description": "moved away",
                                     "tasks": [{"name": "alpha", "git_url": f"file://{gone}",
                                                "git_commit_id": "0" * 40, "path": "tasks/alpha"}]}]))
    failed = get("sprout-test/gone@1.0", "--registry-path", registry, "-o", tmp_path / "out", cwd=tmp_path)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert failed.stderr.strip().splitlines() == [
        f"error: dataset sprout-test/gone@1.0: git clone of file://{gone} failed: "
        f"fatal: '{gone}' does not appear to be a git repository"]


def sums(files: dict[str, str]) -> str:
    return "".join(f"{hashlib.sha256(text.encode()).hexdigest()}  {rel}\n" for rel, text in files.items())


def test_swe_bench_pro_is_a_git_tag_checked_against_its_sums(tmp_path):
    ids = "alpha\n"
    task_toml = (FIXTURES / "py-bugfix" / "task.toml").read_text()
    listed = {"hard51_ids.txt": ids, "tasks/alpha/task.toml": task_toml}
    repo, _ = repository(tmp_path / "src", {"v2/tasks/alpha": FIXTURES / "py-bugfix", "v2/hard51_ids.txt": ids,
                                            "v2/SHA256SUMS": sums(listed)})
    git("tag", "v2.0.0", cwd=repo)
    (repo / "v2" / "hard51_ids.txt").write_text("alpha\nbeta\n")  # edited after the release: its sum no longer holds
    git("commit", "-qam", "edited", cwd=repo)
    git("tag", "v2.0.1", cwd=repo)
    bare = tmp_path / "sbp.git"
    git("clone", "-q", "--bare", str(repo), str(bare), cwd=tmp_path)
    out = tmp_path / "sbp"
    done = get("scaleapi/swe-bench-pro@v2.0.0", "--git-url", f"file://{bare}", "-o", out, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    record = read_record(out / "tasks")
    assert record.checked == ["hard51_ids.txt", "tasks/alpha/task.toml"] and record.tasks == 1
    assert record.revision == git("rev-parse", "v2.0.0", cwd=repo) and record.origin().endswith(record.revision)
    assert (out / "hard51_ids.txt").read_text() == ids and (out / "tasks" / "alpha" / "task.toml").is_file()
    assert "2 files checked against SHA256SUMS" in done.stdout
    tampered = get("scaleapi/swe-bench-pro@v2.0.1", "--git-url", f"file://{bare}", "-o", tmp_path / "bad", cwd=tmp_path)
    assert tampered.returncode == 1 and "hard51_ids.txt does not match its SHA256SUMS line" in tampered.stderr
    no_tag = get("scaleapi/swe-bench-pro@v9", "--git-url", f"file://{bare}", "-o", tmp_path / "none", cwd=tmp_path)
    assert no_tag.returncode == 1 and no_tag.stderr.startswith("error: git clone failed:"), no_tag.stderr
