"""SWE-rebench V2: loading instances, the user's parsers file, the official verdict rules, and grading
in a fresh sandbox of a local image holding a small git repository (/calc) with a failing pytest test."""

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from sprout.eval.gate import GateConfig, run_gate
from sprout.sandbox import Store
from sprout.tasks.swe_rebench import (
    Instance,
    SweGradeError,
    SweRebenchError,
    SweRebenchRef,
    agent_diff,
    grade_instance,
    load_instances,
    load_parsers,
    official_log,
    read_patches,
    repo_dir,
    strip_timing,
    touched_test_paths,
    verdict,
)
from sprout.tasks.swe_rebench.harbor import write_task
from tests.conftest import REPO, RUNTIME_BIN

python_only = pytest.mark.python_only
BASE_IMAGE = "docker.io/library/python:3.11"  # has git and pytest here (bootstrapped Debian python3)
IMAGE = "localhost/sprout-test/swe-rebench-calc:1"

PARSERS = r'''
import re

from lib.agent.swe_constants import TestStatus


def parse_log_pytest(log: str) -> dict[str, str]:
    """`-rA` summary lines: STATUS name [- message]."""
    statuses = {}
    for line in log.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] in TestStatus.__members__:
            statuses[words[1]] = TestStatus[words[0]].value
    return statuses


def parse_log_two_args(log, test_spec):
    return {"t": "PASSED"} if test_spec is None else {}


def parse_log_gotest(log: str) -> dict[str, str]:
    """`go test -v` lines: `--- PASS: TestName (0.01s)`; the timing is left for the harness to strip."""
    statuses = {}
    for match in re.finditer(r"^--- (PASS|FAIL|SKIP): (\S+ \(\d+\.\d+s\))$", log, re.MULTILINE):
        statuses[match[2]] = {"PASS": "PASSED", "FAIL": "FAILED", "SKIP": "SKIPPED"}[match[1]]
    return statuses


NAME_TO_PARSER = {"parse_log_pytest": parse_log_pytest, "parse_log_pytest_v2": parse_log_pytest,
                  "parse_log_gotest": parse_log_gotest}
'''

ROW = {"instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": "abc123", "patch": "",
       "test_patch": "diff --git a/tests/test_mul.py b/tests/test_mul.py\n", "problem_statement": "mul is wrong",
       "FAIL_TO_PASS": ["tests/test_mul.py::test_mul"], "PASS_TO_PASS": ["tests/test_ops.py::test_add"],
       "image_name": IMAGE, "language": "python", "meta": {"x": 1},
       "install_config": {"test_cmd": "python -m pytest -rA tests", "log_parser": "parse_log_pytest",
                          "install": ["pip install -e ."], "base_image_name": "python:3.11", "docker_specs": None}}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Replaces the task layer's leak check (it needs a store even for python-only tests): the podman
    tests below clean up what they make themselves."""
    yield


# ---------------------------------------------------------------- loading


@python_only
def test_loads_jsonl_with_sha_and_keeps_config(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROW, {**ROW, "instance_id": "acme__calc-2",
                                                     "FAIL_TO_PASS": json.dumps(["a", "b"]),
                                                     "PASS_TO_PASS": "[]"}])
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = load_instances(path, digest)
    assert loaded.sha256 == digest and not loaded.problems
    first, second = loaded.instances
    assert first.install_config.test_cmd == ["python -m pytest -rA tests"]
    assert first.install_config.log_parser == "parse_log_pytest"
    assert first.install_config.model_extra["base_image_name"] == "python:3.11"
    assert not hasattr(first, "language")
    assert second.FAIL_TO_PASS == ["a", "b"] and second.PASS_TO_PASS == []
    assert repo_dir(first) == "/calc"
    assert load_instances(path, f"sha256:{digest}").get("acme__calc-2").FAIL_TO_PASS == ["a", "b"]


@python_only
def test_a_reference_can_name_a_stand_in_image(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROW])
    ref = SweRebenchRef(instance_id=ROW["instance_id"], dataset_path=path, parser_path=tmp_path / "p.py")
    assert ref.instance(load_instances(path)).image_name == IMAGE
    stand_in = ref.model_copy(update={"image": "localhost/calc:offline"}).instance(load_instances(path))
    assert stand_in.image_name == "localhost/calc:offline" and stand_in.base_commit == ROW["base_commit"]


@python_only
def test_sha_mismatch_is_one_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROW])
    with pytest.raises(SweRebenchError, match="not the pinned 0000"):
        load_instances(path, "0000")


@python_only
def test_bad_rows_are_reported_by_id_and_line(tmp_path):
    no_parser = {**ROW, "instance_id": "bad-parser", "install_config": {"test_cmd": ["x"]}}
    no_cmd = {**ROW, "instance_id": "bad-cmd", "install_config": {"test_cmd": [" "], "log_parser": "p"}}
    bad_f2p = {**ROW, "instance_id": "bad-f2p", "FAIL_TO_PASS": "not json"}
    path = write_jsonl(tmp_path / "d.jsonl", [ROW, "{not json", no_parser, no_cmd, bad_f2p, ROW, [1]])
    loaded = load_instances(path)
    assert [i.instance_id for i in loaded.instances] == ["acme__calc-1"]
    found = {(p.row, p.instance_id): p.problem for p in loaded.problems}
    assert set(found) == {(2, None), (3, "bad-parser"), (4, "bad-cmd"), (5, "bad-f2p"), (6, "acme__calc-1"),
                          (7, None)}
    assert "log_parser" in found[(3, "bad-parser")] and "test_cmd" in found[(4, "bad-cmd")]
    assert "duplicate" in found[(6, "acme__calc-1")]
    with pytest.raises(SweRebenchError, match="its row was rejected"):
        loaded.get("bad-f2p")


@python_only
def test_check_lists_bad_rows_and_prints_the_sha(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROW, {**ROW, "instance_id": "bad-f2p", "FAIL_TO_PASS": "x"}])
    run = [sys.executable, "-m", "sprout.tasks.swe_rebench", "check", str(path)]
    checked = subprocess.run(run, capture_output=True, text=True, cwd=REPO)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert checked.returncode == 1 and f"1 instances, 1 bad rows; sha256 {digest}" in checked.stdout
    assert "row 2 (bad-f2p)" in checked.stderr
    wrong = subprocess.run([*run, "--sha256", "0" * 64], capture_output=True, text=True, cwd=REPO)
    assert wrong.returncode == 1 and "sha256" in wrong.stderr and "Traceback" not in wrong.stderr
    out = tmp_path / "miles.jsonl"
    run[3] = "prepare"
    prepared = subprocess.run([*run, "-o", str(out)], capture_output=True, text=True, cwd=REPO)
    assert prepared.returncode == 0 and "skipped row 2 (bad-f2p)" in prepared.stderr
    (line,) = map(json.loads, out.read_text().splitlines())
    assert line == {"prompt": [{"role": "user", "content": f"Work in /calc and fix this issue:\n\n{ROW['problem_statement']}"}],
                    "metadata": {"task_id": "acme__calc-1", "image": ROW["image_name"]}}


@python_only
def test_loads_a_json_list(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps([ROW, "x"]))
    loaded = load_instances(tmp_path / "d.json")
    assert [i.instance_id for i in loaded.instances] == ["acme__calc-1"]
    assert [(p.row, p.problem) for p in loaded.problems] == [(1, "not a JSON object")]


@python_only
def test_loads_parquet(tmp_path):
    import pyarrow as pa  # installed with the harbor extra (datasets)
    import pyarrow.parquet as pq

    row = {**ROW, "install_config": json.dumps(ROW["install_config"]), "meta": "m"}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "d.parquet")
    assert load_instances(tmp_path / "d.parquet").instances[0].install_config.test_cmd == [
        "python -m pytest -rA tests"]


# ---------------------------------------------------------------- parsers and verdicts


@python_only
def test_parsers_load_by_path_pinned_by_sha(tmp_path):
    path = tmp_path / "log_parsers.py"
    path.write_text(PARSERS)
    digest = hashlib.sha256(PARSERS.encode()).hexdigest()
    parsers = load_parsers(path, digest)
    assert parsers.grader_revision == f"sha256:{digest}"
    parse = parsers.get("parse_log_pytest")
    assert parse("PASSED tests/a.py::t\nFAILED tests/b.py::u - assert 1\nnoise") == {
        "tests/a.py::t": "PASSED", "tests/b.py::u": "FAILED"}
    assert parsers.get("parse_log_two_args")("") == {"t": "PASSED"}  # a swebench-style (log, test_spec) one
    with pytest.raises(SweGradeError, match="not the pinned"):
        load_parsers(path, "sha256:" + "0" * 64)


@python_only
def test_missing_parser_name_lists_close_names(tmp_path):
    path = tmp_path / "log_parsers.py"
    path.write_text(PARSERS)
    with pytest.raises(SweGradeError, match="no log parser 'parse_log_pytst'.*close names: parse_log_pytest"):
        load_parsers(path).get("parse_log_pytst")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    with pytest.raises(SweGradeError, match="failed to import: ModuleNotFoundError"):
        load_parsers(broken)


@python_only
@pytest.mark.parametrize("name, stripped", [
    ("test_x [1.34 ms]", "test_x"), ("test_x [123 ms]", "test_x"), ("Suite::t [2 S]", "Suite::t"),
    ("botan test in 29.08 msec", "botan test"), ("x in 1 sec and more", "x and more"),
    ("TestA (1.234s)", "TestA"), ("TestA (123ms)", "TestA"), ("TestA ( 5 ms )", "TestA"),
    ("test[param] ", "test[param]"), ("test (slow)", "test (slow)"), ("in 3 runs", "in 3 runs"),
    ("test [1.3 ms] tail", "test [1.3 ms] tail"),
])
def test_strip_timing(name, stripped):
    assert strip_timing(name) == stripped


@python_only
def test_verdict_exact_and_lenient():
    f2p, p2p = ["a (1.2s)", "b"], ["c"]
    exact = verdict({"a": "PASSED", "b [3 ms]": "PASSED", "c": "PASSED", "d": "FAILED"}, f2p, p2p)
    assert exact.exact and exact.lenient and exact.resolved and exact.passed == ["a", "b", "c"]
    extra = verdict({"a": "PASSED", "b": "PASSED", "c": "PASSED", "e": "PASSED"}, f2p, p2p)
    assert not extra.exact and extra.lenient and not extra.resolved and extra.unexpected_passed == ["e"]
    assert verdict({"a": "PASSED", "b": "PASSED", "c": "PASSED", "e": "PASSED"}, f2p, p2p, "lenient").resolved
    broken = verdict({"a": "PASSED", "b": "FAILED", "c": "SKIPPED"}, f2p, p2p, "lenient")
    assert not broken.exact and not broken.lenient and not broken.resolved
    assert broken.fail_to_pass_missing == ["b"] and broken.pass_to_pass_failed == ["c"]


@python_only
def test_touched_test_paths():
    test_patch = ("diff --git a/tests/test_mul.py b/tests/test_mul.py\nnew file mode 100644\n"
                  "diff --git a/tests/data dir/x.txt b/tests/data dir/x.txt\n")
    agent = ("diff --git a/calc/ops.py b/calc/ops.py\n--- a/calc/ops.py\n"
             "diff --git a/tests/test_mul.py b/tests/test_mul.py\n"
             "diff --git a/tests/data dir/x.txt b/tests/data dir/x.txt\n")
    assert touched_test_paths(agent, test_patch) == ["tests/data dir/x.txt", "tests/test_mul.py"]
    assert touched_test_paths("diff --git a/calc/ops.py b/calc/ops.py\n", test_patch) == []


@python_only
def test_grade_without_the_parser_has_no_verdict(tmp_path):
    path = tmp_path / "log_parsers.py"
    path.write_text(PARSERS)
    instance = Instance.model_validate({**ROW, "install_config": {"test_cmd": "x", "log_parser": "parse_log_go"}})
    grade = grade_instance(None, instance, "", load_parsers(path), timeout_s=5)  # type: ignore[arg-type]
    assert grade.reward is None and grade.zero_reason == "grade_failed" and "parse_log_go" in grade.error


# ---------------------------------------------------------------- grading in sandboxes

BUGGY = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a + b\n"
TEST_ADD = "from calc.ops import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
TEST_PATCH = """diff --git a/tests/test_mul.py b/tests/test_mul.py
new file mode 100644
--- /dev/null
+++ b/tests/test_mul.py
@@ -0,0 +1,5 @@
+from calc.ops import mul
+
+
+def test_mul():
+    assert mul(2, 3) == 6
"""
TEST_CMD = "python3 -m pytest -rA -p no:cacheprovider tests"
FIX = ("diff --git a/calc/ops.py b/calc/ops.py\n--- a/calc/ops.py\n+++ b/calc/ops.py\n@@ -5,2 +5,2 @@\n"
       " def mul(a, b):\n-    return a + b\n+    return a * b\n")
DOCKERFILE = f"""FROM {BASE_IMAGE}
COPY calc /calc
RUN cd /calc && git init -q && git add -A && \\
    git -c user.name=t -c user.email=t@t commit -qm base && git rev-parse HEAD > /base_commit
WORKDIR /calc
"""


def build_repo_image(context: Path, tag: str, files: dict[str, str], repo: str = "calc") -> str:
    """An image of BASE_IMAGE holding `files` as a git repository in /<repo>, built offline; its base commit."""
    for name, text in files.items():
        (context / repo / name).parent.mkdir(parents=True, exist_ok=True)
        (context / repo / name).write_text(text)
    (context / "Dockerfile").write_text(DOCKERFILE.replace("calc", repo))
    subprocess.run(["podman", "build", "--pull=never", "--network", "none", "-q", "-t", tag, str(context)],
                   check=True, capture_output=True)
    return subprocess.run(["podman", "run", "--rm", "--network", "none", tag, "cat", "/base_commit"],
                          check=True, capture_output=True, text=True).stdout.strip()


def remove_image(store: Store, tag: str) -> None:
    for image in store.images():
        if tag in image.names:
            store.remove_image(image.key)
    subprocess.run(["podman", "rmi", "-f", tag], capture_output=True)


@pytest.fixture(scope="module", params=["runtime", "podman-exec"])
def calc(request, tmp_path_factory, base_store: Store):
    """(store, base instance, parsers): the image built from BASE_IMAGE offline, removed afterwards; once
    with commands through sprout-runtime and once through `podman exec`."""
    check = subprocess.run(["podman", "run", "--rm", "--network", "none", BASE_IMAGE, "sh", "-c",
                            "git --version && python3 -m pytest --version"], capture_output=True, text=True)
    assert check.returncode == 0, f"{BASE_IMAGE} (ops/setup_podman.sh bootstraps it) lacks git or pytest: " \
        f"{check.stdout}{check.stderr}"
    context = tmp_path_factory.mktemp("calc-image")
    base = build_repo_image(context, IMAGE, {"calc/__init__.py": "", "calc/ops.py": BUGGY, "tests/test_ops.py": TEST_ADD})
    assert request.param != "runtime" or RUNTIME_BIN.exists(), "run ops/setup_podman.sh first (runtime/sprout-runtime)"
    store = Store(base_store.root, runtime_bin=RUNTIME_BIN if request.param == "runtime" else None,
                  backend="microvm" if request.param == "microvm" else "container")
    parsers_path = context / "log_parsers.py"
    parsers_path.write_text(PARSERS)
    instance = Instance.model_validate({**ROW, "base_commit": base, "test_patch": TEST_PATCH,
                                        "install_config": {"test_cmd": [TEST_CMD], "log_parser": "parse_log_pytest"}})
    before = {s.id for s in store.sandboxes()}
    yield store, instance, load_parsers(parsers_path)
    leaked = [s for s in store.sandboxes() if s.id not in before]
    for sandbox in leaked:
        sandbox.destroy()
    remove_image(store, IMAGE)
    assert not leaked, f"left behind: {[s.id for s in leaked]}"


def diff_after(store: Store, instance: Instance, command: str) -> str:
    """The agent's diff after `command` ran in a sandbox of the image, taken live and from a checkpoint
    (both must agree); the sandbox and checkpoint are removed."""
    sandbox = store.create_sandbox(IMAGE, label="swe-test agent")
    try:
        assert sandbox.exec(command, cwd="/calc").exit_code == 0
        status = sandbox.exec("git status --porcelain", cwd="/calc").output
        live = agent_diff(sandbox, instance)
        assert sandbox.exec("git status --porcelain", cwd="/calc").output == status  # its index is untouched
        checkpoint = sandbox.checkpoint(label="swe-test agent")
        try:
            assert agent_diff(checkpoint, instance) == live
        finally:
            store.remove_checkpoint(checkpoint.id, force=True)
        return live
    finally:
        sandbox.destroy()


@pytest.mark.parametrize("calc", ["runtime", "podman-exec", "microvm"], indirect=True)  # files through the agent too
def test_fix_is_resolved_and_the_diff_has_untracked_files(calc):
    store, instance, parsers = calc
    diff = diff_after(store, instance, "sed -i '$ s/a + b/a * b/' calc/ops.py && printf 'X = 1\\n' > calc/new.py"
                      " && printf '\\x00\\x01' > calc/blob.bin")
    assert "calc/new.py" in diff and "GIT binary patch" in diff and "a * b" in diff
    grade = grade_instance(store, instance, diff, parsers, timeout_s=120)
    assert grade.reward == 1.0 and grade.resolved_exact and grade.resolved_lenient, grade
    assert grade.zero_reason is None and grade.touched_test_paths == [] and grade.differences == []
    assert grade.statuses == {"tests/test_mul.py::test_mul": "PASSED", "tests/test_ops.py::test_add": "PASSED"}
    assert grade.grader_revision == parsers.grader_revision


def test_no_change_and_wrong_change_are_not_resolved(calc):
    store, instance, parsers = calc
    nothing = grade_instance(store, instance, "", parsers, timeout_s=120)
    assert nothing.reward == 0.0 and nothing.zero_reason == "not_resolved" and not nothing.resolved_lenient
    assert nothing.fail_to_pass_missing == ["tests/test_mul.py::test_mul"]
    assert nothing.differences == ["empty_patch_ran_tests"]  # the official harness refuses an empty patch
    assert nothing.statuses == {"tests/test_mul.py::test_mul": "FAILED", "tests/test_ops.py::test_add": "PASSED"}
    wrong = diff_after(store, instance, "sed -i '$ s/a + b/a * b + 1/' calc/ops.py")
    grade = grade_instance(store, instance, wrong, parsers, timeout_s=120)
    assert grade.reward == 0.0 and grade.zero_reason == "not_resolved" and grade.resolved_exact is False, grade
    assert grade.statuses["tests/test_mul.py::test_mul"] == "FAILED" and grade.touched_test_paths == []


def test_agent_writing_the_test_file_is_recorded(calc):
    """The agent's own tests/test_mul.py collides with test_patch's new file: it does not apply (as the
    official harness, whose `set -e` stops there), and the touched test path is recorded."""
    store, instance, parsers = calc
    diff = diff_after(store, instance, "sed -i '$ s/a + b/a * b/' calc/ops.py && "
                      "printf 'def test_mul():\\n    pass\\n' > tests/test_mul.py")
    grade = grade_instance(store, instance, diff, parsers, timeout_s=120)
    assert grade.reward == 0.0 and grade.touched_test_paths == ["tests/test_mul.py"], grade
    assert grade.zero_reason == "patch_failed" and "test_patch did not apply" in grade.error


def test_patch_that_does_not_apply_is_zero(calc):
    store, instance, parsers = calc
    bad = ("diff --git a/calc/ops.py b/calc/ops.py\n--- a/calc/ops.py\n+++ b/calc/ops.py\n"
           "@@ -1,2 +1,2 @@\n-def nothing_like_this():\n+def other():\n     pass\n")
    grade = grade_instance(store, instance, bad, parsers, timeout_s=120)
    assert grade.reward == 0.0 and grade.zero_reason == "patch_failed" and not grade.resolved_exact, grade
    assert "agent's diff did not apply" in grade.error and grade.statuses == {}
    assert grade.differences == ["patch_failed_ran_nothing"]


def test_hanging_tests_are_cut_off(calc):
    store, instance, parsers = calc
    hanging = instance.model_copy(update={"install_config": instance.install_config.model_copy(
        update={"test_cmd": [f"{TEST_CMD} || true", "sleep 600"]})})
    grade = grade_instance(store, hanging, FIX, parsers, timeout_s=8)
    assert grade.reward == 0.0 and grade.zero_reason == "timeout" and grade.duration_s < 60, grade
    assert grade.statuses["tests/test_mul.py::test_mul"] == "PASSED"  # parsed from what ran before the cut
    assert grade.differences == ["tests_timed_out"]


def _with(instance: Instance, **install_config) -> Instance:
    return instance.model_copy(update={"install_config": instance.install_config.model_copy(update=install_config)})


def _new_file(path: str, text: str) -> str:
    lines = text.splitlines()
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}\n" for line in lines))


@pytest.mark.parametrize("calc", ["runtime"], indirect=True)  # about the log, not the exec path
def test_a_log_that_is_not_utf8_resolves_nothing_and_crlf_lines_are_lines(calc, tmp_path):
    """As the official harness reads the log: the gold fix with a conftest.py that writes a byte that is not
    UTF-8 to fd 1 after the tests passed is an error, not resolved; output with \\r\\n line ends is read
    as lines by every parser (here a go-style one, whose `$` would not match before a \\r)."""
    store, instance, parsers = calc
    conftest = "import os\n\n\ndef pytest_unconfigure(config):\n    os.write(1, b'done \\xff\\n')\n"
    log = tmp_path / "log.txt"
    grade = grade_instance(store, instance, FIX + _new_file("conftest.py", conftest), parsers, timeout_s=120,
                           log_path=log)
    assert grade.statuses == {"tests/test_mul.py::test_mul": "PASSED", "tests/test_ops.py::test_add": "PASSED"}
    assert grade.reward == 0.0 and grade.zero_reason == "log_not_utf8" and not grade.resolved_lenient, grade
    assert "(stdout) is not UTF-8" in grade.error and "passed in" in log.read_text() and "done \ufffd\n" in log.read_text()
    lines = "".join(f"--- PASS: {name} (0.01s)\\r\\n" for name in ROW["FAIL_TO_PASS"] + ROW["PASS_TO_PASS"])
    crlf = _with(instance, test_cmd=[f"printf -- '{lines}'"], log_parser="parse_log_gotest")
    grade = grade_instance(store, crlf, FIX, parsers, timeout_s=120)
    assert grade.reward == 1.0 and grade.zero_reason is None, grade


@pytest.mark.parametrize("calc", ["runtime"], indirect=True)
def test_the_grade_command_grades_patches_files_and_golden_patches(calc, tmp_path):
    store, instance, _ = calc
    data = write_jsonl(tmp_path / "d.jsonl", [{**ROW, "base_commit": instance.base_commit, "patch": FIX,
                                               "test_patch": TEST_PATCH, "install_config": {
                                                   "test_cmd": [TEST_CMD], "log_parser": "parse_log_pytest"}}])
    (tmp_path / "log_parsers.py").write_text(PARSERS)
    common = [data, "--parsers", tmp_path / "log_parsers.py", "--store", store.root]
    (tmp_path / "gold.json").write_text(json.dumps([{"instance_id": ROW["instance_id"], "patch": FIX}]))
    ran = run_grade(*common, "--patches", tmp_path / "gold.json", "--log-dir", tmp_path / "logs",
                    "-o", tmp_path / "grades.json", "--verbose")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    first, *tests, summary = ran.stdout.splitlines()
    assert first.startswith("acme__calc-1: resolved in ") and "differs" not in first
    assert sorted(tests) == ["    PASSED  tests/test_mul.py::test_mul", "    PASSED  tests/test_ops.py::test_add"]
    assert summary == "1 graded (rule exact): 1 resolved, 0 not resolved, 0 without a verdict"
    assert "2 passed" in (tmp_path / "logs" / "acme__calc-1_log.txt").read_text()  # the whole log
    [grade] = json.loads((tmp_path / "grades.json").read_text())
    assert grade["resolved"] is True and grade["statuses"]["tests/test_mul.py::test_mul"] == "PASSED"
    (tmp_path / "empty.json").write_text(json.dumps([{"instance_id": ROW["instance_id"], "patch": ""}]))
    ran = run_grade(*common, "--patches", tmp_path / "empty.json")
    assert ran.returncode == 0, ran.stdout + ran.stderr  # grading completed: the verdict is no failure
    assert ran.stdout.splitlines()[0].startswith("acme__calc-1: not resolved (not_resolved: 1 FAIL_TO_PASS missing")
    assert ran.stdout.splitlines()[0].endswith("[differs from the official harness: empty_patch_ran_tests]")
    assert run_grade(*common, "--patches", tmp_path / "empty.json", "--fail-unresolved").returncode == 1
    golden = run_grade(*common, "--golden-eval", "--instance-id", ROW["instance_id"])
    assert golden.returncode == 0 and "1 resolved" in golden.stdout, golden.stdout + golden.stderr


def test_missing_image_has_no_verdict(calc):
    store, instance, parsers = calc
    gone = instance.model_copy(update={"image_name": "localhost/sprout-test/no-such-image:0"})
    grade = grade_instance(store, gone, "", parsers, timeout_s=10, pull="never")
    assert grade.reward is None and grade.zero_reason == "grade_failed" and "no-such-image" in grade.error



@pytest.mark.parametrize("calc", ["runtime"], indirect=True)  # the gate's grading is not about exec paths
def test_to_harbor_tasks_pass_the_gate_with_the_official_verdict(calc, tmp_path):
    """The converted task: the oracle applies the reference patch and its separate verifier (a fresh
    container of the instance's image) gives reward 1 by the official rule; doing nothing gives 0."""
    store, instance, parsers = calc
    dataset = write_jsonl(tmp_path / "d.jsonl", [instance.model_dump() | {"patch": FIX}])
    converted = subprocess.run([sys.executable, "-m", "sprout.tasks.swe_rebench", "to-harbor", str(dataset),
                                "-o", str(tmp_path / "tasks"), "--parsers", str(parsers.path), "--timeout", "120"],
                               capture_output=True, text=True, cwd=REPO)
    assert converted.returncode == 0, converted.stderr
    assert "wrote 1 Harbor tasks" in converted.stdout
    summary = run_gate(GateConfig(tasks_dir=tmp_path / "tasks", output=tmp_path / "gate", workers=1, store=store.root,
                                  runtime_bin=RUNTIME_BIN))
    (result,) = summary.results
    assert result.task == "acme__calc-1" and result.verdict == "pass", result
    oracle, nop = result.oracle.grade, result.nop.grade
    assert oracle.verifier_environment == "separate" and oracle.decided_by == "reward"
    assert oracle.rewards == {"reward": 1.0, "resolved_exact": 1.0, "resolved_lenient": 1.0}
    assert nop.rewards == {"reward": 0.0, "resolved_exact": 0.0, "resolved_lenient": 0.0}
    details = json.loads((tmp_path / "gate" / "acme__calc-1" / "oracle" / "verifier" /
                          "swe_rebench_verdict.json").read_text())
    assert details["passed"] == ["tests/test_mul.py::test_mul", "tests/test_ops.py::test_add"]


@python_only
def test_lenient_verdicts_agree_with_swebench_where_the_rules_coincide():
    """swebench's FULL resolution and our lenient rule on the same status maps: they coincide on PASSED,
    FAILED, ERROR, absent, and SKIPPED FAIL_TO_PASS tests; they differ (documented in grade.py) on a
    SKIPPED PASS_TO_PASS test and on XFAIL, which swebench counts as kept and as passed."""
    from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS, ResolvedStatus
    from swebench.harness.grading import get_eval_tests_report, get_resolution_status

    def swebench_full(statuses: dict, f2p: list, p2p: list) -> bool:
        report = get_eval_tests_report(statuses, {FAIL_TO_PASS: f2p, PASS_TO_PASS: p2p})
        return get_resolution_status(report) == ResolvedStatus.FULL.value

    rng = random.Random(7)
    names = [f"tests/test_{i}.py::test_{i}" for i in range(6)]
    checked = 0
    for _ in range(2000):
        f2p, p2p = names[:rng.randint(1, 3)], names[3:3 + rng.randint(0, 3)]
        statuses = {n: rng.choice(["PASSED", "PASSED", "FAILED", "ERROR", "absent"]) for n in names}
        statuses |= {n: "SKIPPED" for n in f2p if rng.random() < 0.1}
        statuses = {n: s for n, s in statuses.items() if s != "absent"}
        ours = verdict(statuses, f2p, p2p, "lenient")
        assert ours.lenient == swebench_full(statuses, f2p, p2p), (statuses, f2p, p2p)
        checked += ours.lenient
    assert 50 < checked < 1950  # both verdicts were seen often
    f2p, p2p = ["a"], ["b"]
    assert swebench_full({"a": "PASSED", "b": "SKIPPED"}, f2p, p2p)
    assert not verdict({"a": "PASSED", "b": "SKIPPED"}, f2p, p2p).lenient
    assert swebench_full({"a": "XFAIL", "b": "PASSED"}, f2p, p2p)
    assert not verdict({"a": "XFAIL", "b": "PASSED"}, f2p, p2p).lenient


@python_only
def test_to_harbor_writes_a_separate_verifier_task_whose_scripts_parse(tmp_path):
    from harbor.models.task.config import TaskConfig

    (tmp_path / "log_parsers.py").write_text(PARSERS)
    instance = Instance.model_validate({**ROW, "patch": FIX, "install_config": {"test_cmd": [TEST_CMD, "echo 'done'"],
                                                                               "log_parser": "parse_log_pytest"}})
    task = write_task(instance, load_parsers(tmp_path / "log_parsers.py"), tmp_path / "tasks", dataset_sha256="ab",
                      timeout_s=90.5)
    assert task == tmp_path / "tasks" / "acme__calc-1"
    config = TaskConfig.model_validate_toml((task / "task.toml").read_text())
    assert config.verifier.environment_mode.value == "separate" and config.verifier.environment.docker_image is None
    assert config.environment.docker_image == IMAGE and config.metadata["instance_id"] == "acme__calc-1"
    (collect,) = config.verifier.collect
    assert collect.command.endswith("mv /logs/artifacts/model.patch.partial /logs/artifacts/model.patch")
    assert (task / "instruction.md").read_text().startswith("Work in /calc and fix this issue:")
    assert (task / "tests" / "Dockerfile").read_text() == f"FROM {IMAGE}\nCOPY . /tests\n"
    assert (task / "tests" / "tests.sh").read_text() == f"set -e\n{TEST_CMD}\necho 'done'\n"
    assert (task / "solution" / "patch.diff").read_text() == FIX
    test_sh = (task / "tests" / "test.sh").read_text()
    assert "timeout -k 30 90 bash /tests/tests.sh" in test_sh and "sys.version_info < (3, 8)" in test_sh
    for script in (task / "tests" / "test.sh", task / "tests" / "setup.sh", task / "solution" / "solve.sh"):
        checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert checked.returncode == 0, (script, checked.stderr)
    assert subprocess.run(["bash", "-n", "-c", collect.command], capture_output=True).returncode == 0


@python_only
def test_the_verdict_script_runs_alone_as_in_a_verifier_container(tmp_path):
    """verdict.py copied out of Sprout (as to-harbor copies it) judges a log with the parsers file."""
    script = tmp_path / "verdict.py"
    script.write_bytes((REPO / "src" / "sprout" / "tasks" / "swe_rebench" / "verdict.py").read_bytes())
    (tmp_path / "log_parsers.py").write_text(PARSERS)
    (tmp_path / "stdout").write_text("PASSED tests/test_ops.py::test_add\nFAILED tests/test_mul.py::test_mul\n")
    (tmp_path / "stderr").write_text("PASSED tests/test_extra.py::test_x [3 ms]\n")
    spec = {"log_parser": "parse_log_pytest", "FAIL_TO_PASS": ["tests/test_mul.py::test_mul"],
            "PASS_TO_PASS": ["tests/test_ops.py::test_add"], "rule": "lenient"}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = [sys.executable, "-I", str(script), "--spec", "spec.json", "--parsers", "log_parsers.py", "--log", "stdout",
           "--log", "stderr", "--reward", "reward.json", "--details", "details.json"]
    judged = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path)
    assert judged.returncode == 0, judged.stderr
    assert json.loads((tmp_path / "reward.json").read_text()) == {
        "reward": 0.0, "resolved_exact": 0.0, "resolved_lenient": 0.0}
    details = json.loads((tmp_path / "details.json").read_text())
    assert details["fail_to_pass_missing"] == ["tests/test_mul.py::test_mul"]
    assert details["unexpected_passed"] == ["tests/test_extra.py::test_x"]
    (tmp_path / "stdout").write_text("PASSED tests/test_ops.py::test_add\nPASSED tests/test_mul.py::test_mul\n")
    assert subprocess.run(run, capture_output=True, cwd=tmp_path).returncode == 0
    assert json.loads((tmp_path / "reward.json").read_text())["reward"] == 1.0  # lenient: the extra pass is fine
    spec["log_parser"] = "parse_log_go"
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "reward.json").unlink()
    missing = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path)
    assert missing.returncode == 2 and "no log parser 'parse_log_go'" in missing.stderr
    assert not (tmp_path / "reward.json").exists()


# ---------------------------------------------------------------- a second log format

SH_LIB = "add() { echo $(( $1 + $2 )); }\nmul() { echo $(( $1 + $2 )); }\n"
SH_RUNNER = """#!/bin/bash
# Runs every test_* function of tests/*.sh, reporting as `go test -v` does.
. ./lib.sh
for file in tests/*.sh; do . "$file"; done
for t in $(declare -F | awk '{print $3}' | grep '^Test'); do
  echo "=== RUN   $t"
  if $t; then echo "--- PASS: $t (0.00s)"; else echo "--- FAIL: $t (0.01s)"; fi
done
"""
SH_TEST_ADD = "TestAdd() { [ \"$(add 2 3)\" = 5 ]; }\n"
SH_TEST_PATCH = """diff --git a/tests/mul.sh b/tests/mul.sh
new file mode 100644
--- /dev/null
+++ b/tests/mul.sh
@@ -0,0 +1 @@
+TestMul() { [ "$(mul 2 3)" = 6 ]; }
"""
SH_FIX = ("diff --git a/lib.sh b/lib.sh\n--- a/lib.sh\n+++ b/lib.sh\n@@ -2 +2 @@\n"
          "-mul() { echo $(( $1 + $2 )); }\n+mul() { echo $(( $1 * $2 )); }\n")


def test_a_go_style_log_is_parsed_and_its_timings_stripped(base_store, tmp_path):
    """Another language's log format: a shell project whose runner reports as `go test -v`, parsed by the
    parsers file's parse_log_gotest (names with their timing, stripped by the harness)."""
    tag = "localhost/sprout-test/swe-rebench-shcalc:1"
    base = build_repo_image(tmp_path, tag, {"lib.sh": SH_LIB, "run_tests.sh": SH_RUNNER,
                                            "tests/add.sh": SH_TEST_ADD}, repo="shcalc")
    store = Store(base_store.root, runtime_bin=RUNTIME_BIN)
    (tmp_path / "log_parsers.py").write_text(PARSERS)
    instance = Instance.model_validate({**ROW, "instance_id": "acme__shcalc-1", "repo": "acme/shcalc",
                                        "base_commit": base, "image_name": tag, "test_patch": SH_TEST_PATCH,
                                        "FAIL_TO_PASS": ["TestMul"], "PASS_TO_PASS": ["TestAdd"],
                                        "install_config": {"test_cmd": ["bash run_tests.sh"],
                                                           "log_parser": "parse_log_gotest"}})
    try:
        fixed = grade_instance(store, instance, SH_FIX, load_parsers(tmp_path / "log_parsers.py"), timeout_s=60)
        assert fixed.statuses == {"TestAdd (0.00s)": "PASSED", "TestMul (0.00s)": "PASSED"}, fixed
        assert fixed.reward == 1.0 and fixed.resolved_exact and fixed.zero_reason is None
        unfixed = grade_instance(store, instance, "", load_parsers(tmp_path / "log_parsers.py"), timeout_s=60)
        assert unfixed.statuses == {"TestAdd (0.00s)": "PASSED", "TestMul (0.01s)": "FAILED"}, unfixed
        assert unfixed.reward == 0.0 and unfixed.fail_to_pass_missing == ["TestMul"]
    finally:
        remove_image(store, tag)


# ---------------------------------------------------------------- the log as the official harness reads it


@python_only
def test_the_log_is_decoded_as_the_official_harness_decodes_it():
    log, problem = official_log([("stdout", b"a\r\nb\rc\n"), ("stderr", b"d\r\n")])
    assert log == "a\nb\nc\nd\n" and problem is None  # universal newlines, stdout then stderr
    log, problem = official_log([("stdout", b"PASSED t\n"), ("stderr", b"done \xff\r\n")])
    assert log == "PASSED t\ndone \ufffd\n"
    assert problem == ("the test output (stderr) is not UTF-8 (byte 5: b'\\xff'): the official harness cannot "
                       "decode it")


@python_only
def test_every_parser_reads_a_crlf_log_as_its_lf_twin(tmp_path):
    (tmp_path / "log_parsers.py").write_text(PARSERS)
    parsers = load_parsers(tmp_path / "log_parsers.py")
    lf = "PASSED tests/a.py::t\nFAILED tests/b.py::u - boom\n--- PASS: TestX (0.01s)\n--- FAIL: TestY (1.20s)\n"
    crlf = lf.replace("\n", "\r\n").encode()
    for name in parsers.names():
        assert parsers.get(name)(official_log([("stdout", crlf)])[0]) == parsers.get(name)(lf), name
    gotest = parsers.get("parse_log_gotest")
    assert gotest(crlf.decode()) != gotest(lf)  # what a parser given the raw log would have seen


@python_only
@pytest.mark.parametrize("stdout, reward, reason", [
    (b"--- PASS: tests/test_mul.py::test_mul (0.01s)\r\n--- PASS: tests/test_ops.py::test_add (0.02s)\r\n", 1.0,
     None),
    (b"--- PASS: tests/test_mul.py::test_mul (0.01s)\n--- PASS: tests/test_ops.py::test_add (0.02s)\ndone \xff\n", 0.0,
     "log_not_utf8")])
def test_the_harbor_verifier_reads_the_log_as_the_official_harness(tmp_path, stdout, reward, reason):
    (tmp_path / "log_parsers.py").write_text(PARSERS)
    spec = {"log_parser": "parse_log_gotest", "FAIL_TO_PASS": ROW["FAIL_TO_PASS"], "PASS_TO_PASS": ROW["PASS_TO_PASS"],
            "rule": "exact"}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "stdout").write_bytes(stdout)
    script = REPO / "src" / "sprout" / "tasks" / "swe_rebench" / "verdict.py"
    ran = subprocess.run([sys.executable, script, "--spec", tmp_path / "spec.json", "--parsers", tmp_path / "log_parsers.py",
                          "--log", tmp_path / "stdout", "--log", tmp_path / "stderr", "--reward", tmp_path / "reward.json",
                          "--details", tmp_path / "details.json"], capture_output=True, text=True, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert json.loads((tmp_path / "reward.json").read_text()) == {"reward": reward, "resolved_exact": reward,
                                                                   "resolved_lenient": reward}
    details = json.loads((tmp_path / "details.json").read_text())
    assert details.get("zero_reason") == reason and details["exact"]  # the tests passed either way
    assert ("not UTF-8" in ran.stdout) == (reason is not None)


# ---------------------------------------------------------------- the grade command


def run_grade(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sprout", "swe-rebench", "grade", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)


@python_only
@pytest.mark.parametrize("patches, flags, code, message", [
    ([{"instance_id": ROW["instance_id"]}], [], 1, "acme__calc-1 has no patch"),
    ([{"patch": ""}], [], 1, "entry 1 has no instance_id"),
    ({"acme__calc-1": ""}, [], 1, "the official format is a JSON list"),
    ([{"instance_id": ROW["instance_id"], "patch": ""}], ["--instance-id", "other"], 1, "has no patch for other"),
    ([{"instance_id": "other", "patch": ""}], [], 1, "no instance 'other'"),
    (None, ["--golden-eval"], 1, "no reference patch in the dataset for acme__calc-1"),
    (None, ["--diff", "-"], 2, "--diff grades one instance: name it with --instance-id"),
])
def test_grade_refuses_what_it_cannot_grade_in_one_line(tmp_path, patches, flags, code, message):
    data = write_jsonl(tmp_path / "d.jsonl", [ROW])
    (tmp_path / "log_parsers.py").write_text(PARSERS)
    source = ["--patches", tmp_path / "p.json"] if patches is not None else []
    if patches is not None:
        (tmp_path / "p.json").write_text(json.dumps(patches))
    ran = run_grade(data, "--parsers", tmp_path / "log_parsers.py", *source, *flags)
    assert ran.returncode == code and message in ran.stderr, ran.stderr
    assert "Traceback" not in ran.stderr and len(ran.stderr.strip().splitlines()) == 1, ran.stderr


@python_only
def test_patches_in_the_official_format_are_read_as_given(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"instance_id": "a", "patch": FIX, "model": "m"}, {"instance_id": "b", "patch": ""}]))
    assert read_patches(path) == {"a": FIX, "b": ""}
    path.write_text(json.dumps([{"instance_id": "a", "patch": ""}, {"instance_id": "a", "patch": FIX}]))
    with pytest.raises(SweRebenchError, match="a has two patches"):
        read_patches(path)
    path.write_text("[{")
    with pytest.raises(SweRebenchError, match="patches file .*p.json"):
        read_patches(path)
