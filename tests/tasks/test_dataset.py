"""Dataset directories as Harbor reads them, and task-ids files (SWE-bench Pro's HARD-51), on real files."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from sprout.eval.gate import GateConfig, run_gate
from sprout.eval.prepare import prepare
from sprout.eval.provenance import check_pinning, dataset_digest
from sprout.tasks import TaskError, load_tasks
from sprout.tasks.dataset import TaskIdsFile, load_task_ids, parse_task_ids, task_dirs
from tests.conftest import REPO, RUNTIME_BIN
from tests.tasks.conftest import FIXTURES

PRO_IDS = ["instance_future-architect__vuls-457a3a9627fb9a0800d0aecf1d4713fb634a9011",
           "instance_NodeBB__NodeBB-00c70ce7b0541cfc94afe567921d7668cdc8f4ac-vnan",
           "instance_qutebrowser__qutebrowser-1af602b258b97aaba69d2585ed499d95e2303ac2"]


def deep_swe_like(root: Path) -> Path:
    """tasks/ as DeepSWE ships it (dataset.toml, manifest.json, a README symlink) plus what else a dataset
    directory may hold: a symlinked task, hidden and underscore directories, a helper directory, a broken
    task, a dangling symlink."""
    tasks = root / "tasks"
    for name in ("alpha", "beta"):
        shutil.copytree(FIXTURES / "shell-count", tasks / name)
    shutil.copytree(FIXTURES / "shell-count", root / "elsewhere" / "linked")
    (tasks / "linked").symlink_to(root / "elsewhere" / "linked", target_is_directory=True)
    (tasks / "dataset.toml").write_text('[dataset]\nname = "datacurve/deep-swe-1-1"\n')
    (tasks / "manifest.json").write_text(json.dumps({"tasks": ["alpha", "beta", "linked"]}))
    (root / "README.md").write_text("# DeepSWE\n")
    (tasks / "README.md").symlink_to("../README.md")
    for hidden in (".cache", "_drafts"):
        shutil.copytree(FIXTURES / "shell-count", tasks / hidden)
    (tasks / "tooling").mkdir()
    (tasks / "tooling" / "make_subset.py").write_text("print('not a task')\n")
    (tasks / "half").mkdir()
    (tasks / "half" / "instruction.md").write_text("a task without task.toml\n")
    (tasks / "dangling").symlink_to(root / "nowhere")
    return tasks


def test_a_dataset_directory_lists_its_tasks_as_harbor_does(tmp_path):
    tasks = deep_swe_like(tmp_path)
    assert [d.name for d in task_dirs(tasks)] == ["alpha", "beta", "half", "linked"]
    assert task_dirs(tasks)[-1] == tasks / "linked"  # the link's path, not its target's
    assert task_dirs(tasks / "alpha") == [tasks / "alpha"]  # a task directory is a dataset of one
    loaded = load_tasks(tasks)
    assert sorted(t.task_dir.name for t in loaded.tasks) == ["alpha", "beta", "linked"]
    assert [(p.name, p.problem) for p in loaded.problems] == [("half", "task half: no task.toml")]


def test_a_symlinked_task_is_pinned_as_the_datasets_own(tmp_path):
    tasks = deep_swe_like(tmp_path)
    manifest = prepare(tasks, tmp_path / "prep.json")  # digests only
    assert [t.name for t in manifest.tasks] == ["alpha", "beta", "half", "linked"]
    assert manifest.dataset.name == "datacurve/deep-swe-1-1" and manifest.task_ids is None
    pinning = check_pinning(tasks / "linked", dataset_digest(tasks), tmp_path / "prep.json")
    assert pinning.task == "linked" and pinning.dataset_digest == manifest.dataset.digest


def test_ids_files_skip_blank_lines_comments_and_repeats():
    text = "# HARD-51\n\n  alpha  \nbeta # the second\n#gamma\nalpha\nname#with-hash\n"
    assert parse_task_ids(text) == ["alpha", "beta", "name#with-hash"]


def swe_bench_pro_like(root: Path, listed: str | None = "hard51_ids.txt") -> tuple[Path, Path]:
    """v2/tasks/<instance_id>/, v2/hard51_ids.txt and v2/SHA256SUMS written by sha256sum itself."""
    v2 = root / "v2"
    for instance in PRO_IDS:
        shutil.copytree(FIXTURES / "shell-count", v2 / "tasks" / instance)
    ids = v2 / "hard51_ids.txt"
    ids.write_text("\n".join(PRO_IDS[:2]) + "\n")
    files = [f for f in (listed, "tasks/" + PRO_IDS[0] + "/task.toml") if f]
    sums = subprocess.run(["sha256sum", *files], cwd=v2, check=True, capture_output=True, text=True).stdout
    (v2 / "SHA256SUMS").write_text(sums)
    return v2 / "tasks", ids


def test_an_ids_file_listed_in_sha256sums_is_checked(tmp_path):
    tasks, ids = swe_bench_pro_like(tmp_path)
    selected = load_task_ids(ids, tasks)
    assert selected.ids == PRO_IDS[:2]
    record = selected.record
    assert record.checked and record.sums_file == str(tasks.parent / "SHA256SUMS") and record.count == 2
    assert record.path == str(ids) and record.sha256.startswith("sha256:") and len(record.sha256) == 71
    with pytest.raises(ValidationError):
        TaskIdsFile.model_validate({**record.model_dump(), "ids": PRO_IDS})  # extra="forbid"


def test_an_ids_file_that_differs_from_its_sha256sums_line_is_refused(tmp_path):
    tasks, ids = swe_bench_pro_like(tmp_path)
    listed = (tasks.parent / "SHA256SUMS").read_text().split()[0]
    ids.write_text(PRO_IDS[2] + "\n")
    with pytest.raises(TaskError) as refused:
        load_task_ids(ids, tasks)
    now = hashlib.sha256(ids.read_bytes()).hexdigest()
    assert str(refused.value) == (f"the task-ids file {ids} does not match {tasks.parent / 'SHA256SUMS'}: "
                                  f"its sha256 is {now}, SHA256SUMS says {listed}")


def test_an_ids_file_no_sha256sums_lists_is_recorded_unchecked(tmp_path):
    tasks, ids = swe_bench_pro_like(tmp_path, listed=None)  # SHA256SUMS lists a task file only
    assert load_task_ids(ids, tasks).record.checked is False
    mine = tmp_path / "mine.txt"  # outside the directory SHA256SUMS covers
    mine.write_text(PRO_IDS[2] + "\n")
    record = load_task_ids(mine, tasks).record
    assert (record.checked, record.sums_file, record.count) == (False, None, 1)


def test_binary_mode_and_dot_slash_lines_are_read(tmp_path):
    tasks, ids = swe_bench_pro_like(tmp_path, listed=None)
    digest = hashlib.sha256(ids.read_bytes()).hexdigest()
    (tasks / "SHA256SUMS").write_text(f"{digest} *../hard51_ids.txt\n")  # not under tasks/: not its line
    (tasks.parent / "SHA256SUMS").write_text(f"{digest.upper()} *./hard51_ids.txt\n")
    assert load_task_ids(ids, tasks).record.sums_file == str(tasks.parent / "SHA256SUMS")


def test_unknown_and_missing_ids_are_one_line_errors(tmp_path):
    tasks, _ = swe_bench_pro_like(tmp_path)
    many = tmp_path / "many.txt"
    many.write_text("\n".join([PRO_IDS[0]] + [f"instance_nosuch-{i}" for i in range(7)]) + "\n")
    with pytest.raises(TaskError) as refused:
        load_task_ids(many, tasks)
    shown = ", ".join(f"instance_nosuch-{i}" for i in range(5))
    assert str(refused.value) == f"7 of the 8 ids in {many} are not tasks of {tasks}: {shown}, ..."
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(TaskError, match=f"the task-ids file {empty} lists no task ids"):
        load_task_ids(empty, tasks)
    with pytest.raises(TaskError, match="no task-ids file"):
        load_task_ids(tmp_path / "missing.txt", tasks)
    with pytest.raises(TaskError, match="no tasks directory"):
        load_task_ids(many, tmp_path / "no-tasks")


def test_prepare_records_the_ids_file_and_prepares_only_its_tasks(tmp_path):
    tasks, ids = swe_bench_pro_like(tmp_path)
    out = tmp_path / "prep.json"
    args = ["--tasks-dir", tasks, "-o", out, "--task-ids-file", ids, "--no-images"]
    done = subprocess.run([sys.executable, "-m", "sprout.eval.prepare", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tasks: 2 task ids from" in done.stdout and "checked against" in done.stdout
    manifest = json.loads(out.read_text())
    assert [t["name"] for t in manifest["tasks"]] == sorted(PRO_IDS[:2])
    assert manifest["task_ids"]["count"] == 2 and manifest["task_ids"]["checked"] is True
    assert manifest["dataset"]["digest"] == dataset_digest(tasks)  # the whole dataset's digest


def test_the_benchmark_refuses_ids_its_manifest_did_not_prepare(tmp_path):
    tasks, ids = swe_bench_pro_like(tmp_path)
    manifest = prepare(tasks, tmp_path / "prep.json", task_ids=load_task_ids(ids, tasks))
    other = tmp_path / "other.txt"
    other.write_text(PRO_IDS[2] + "\n")
    args = ["--tasks-dir", tasks, "--output", tmp_path / "bench", "--dataset-digest", manifest.dataset.digest,
            "--preparation-manifest", tmp_path / "prep.json", "--model", "m", "--allow-dirty",
            "--task-ids-file", other]
    done = subprocess.run([sys.executable, "-m", "sprout.eval.benchmark", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    expected = (f"error: the manifest {tmp_path / 'prep.json'} does not list 1 of the chosen tasks: "
                f"{PRO_IDS[2]} (prepare them: sprout prepare)")
    assert done.stderr.strip() == expected


def test_the_gate_runs_and_records_the_chosen_tasks(tmp_path):
    tasks = tmp_path / "tasks"
    for name in ("shell-count", "malformed-toml"):
        shutil.copytree(FIXTURES / name, tasks / name)
    ids = tmp_path / "ids.txt"
    ids.write_text("# the one that passes\nshell-count\n")
    summary = run_gate(GateConfig(tasks_dir=tasks, output=tmp_path / "gate", workers=1, task_ids_file=ids,
                                  runtime_bin=RUNTIME_BIN))
    assert [(r.task, r.verdict) for r in summary.results] == [("shell-count", "pass")]
    written = json.loads((tmp_path / "gate" / "summary.json").read_text())
    assert written["task_ids"] == summary.task_ids.model_dump() and written["task_ids"]["count"] == 1
    assert written["task_ids"]["checked"] is False and written["task_ids"]["path"] == str(ids)
