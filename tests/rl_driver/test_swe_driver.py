"""The RL driver on a SWE-rebench V2 instance: a group whose samples work in the instance's image and are
graded as the official harness grades them (the agent's diff and the test patch applied in a fresh
sandbox, the test command run, the log parsed by the pinned parsers file)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sprout.jobs.payloads import SweGradePayload
from sprout.jobs.remote import run_job
from sprout.runstore.client import RunStoreClient
from sprout.runstore.errors import RunStoreError
from sprout.sandbox import Store
from sprout.tasks.swe_rebench import Instance, SweRebenchRef, task_prompt
from sprout.testing.scripted_model import ScriptedModelServer
from tests.conftest import REPO, RUNTIME_BIN, free_port
from tests.rl_driver.test_driver import (
    INSTRUCTION,
    POLICY_KEY,
    SUBMIT,
    DriverProcess,
    MilesShapedClient,
    endpoint_of,
    group_request,
    sandbox_ids,
    then,
)
from tests.services.test_services import services
from tests.tasks.test_swe_rebench import BUGGY, DOCKERFILE, FIX, PARSERS, ROW, TEST_ADD, TEST_CMD, TEST_PATCH

IMAGE = "localhost/sprout-test/swe-rebench-calc-driver:1"
FIX_MUL = "sed -i '$ s/a + b/a \\* b/' calc/ops.py"  # mul is the last line of calc/ops.py


@pytest.fixture(scope="module")
def swe_driver(tmp_path_factory):
    """A driver serving one SWE-rebench instance (its image built here offline), and that instance."""
    root = tmp_path_factory.mktemp("swe-driver")
    context = root / "image"
    (context / "calc" / "calc").mkdir(parents=True)
    (context / "calc" / "tests").mkdir()
    (context / "calc" / "calc" / "__init__.py").write_text("")
    (context / "calc" / "calc" / "ops.py").write_text(BUGGY)
    (context / "calc" / "tests" / "test_ops.py").write_text(TEST_ADD)
    (context / "Dockerfile").write_text(DOCKERFILE)
    subprocess.run(["podman", "build", "--pull=never", "--network", "none", "-q", "-t", IMAGE, str(context)],
                   check=True, capture_output=True)
    base = subprocess.run(["podman", "run", "--rm", "--network", "none", IMAGE, "cat", "/base_commit"],
                          check=True, capture_output=True, text=True).stdout.strip()
    row = {**ROW, "base_commit": base, "image_name": IMAGE, "test_patch": TEST_PATCH,
           "install_config": {"test_cmd": [TEST_CMD], "log_parser": "parse_log_pytest"}}
    dataset = root / "data.jsonl"
    dataset.write_text(json.dumps(row) + "\n")
    parsers = root / "log_parsers.py"
    parsers.write_text(PARSERS)
    spec = {"benchmark": "swe-rebench-v2", "instance_id": row["instance_id"], "dataset_path": str(dataset),
            "dataset_sha256": hashlib.sha256(dataset.read_bytes()).hexdigest(), "parser_path": str(parsers),
            "grader_revision": "sha256:" + hashlib.sha256(parsers.read_bytes()).hexdigest()}
    config = root / "driver.json"
    config.write_text(json.dumps({"data_dir": str(root / "data"), "runtime_bin": str(RUNTIME_BIN),
                                  "miles": {"api_key_env": "SPROUT_MODEL_API_KEY", "grade_wall_seconds": 240,
                                            "tasks": {row["instance_id"]: {"grade": {"profile": "grade",
                                                                                      "spec": spec}}}}}))
    driver = DriverProcess(config, free_port()).start()
    yield driver, Instance.model_validate(row), dataset, config
    driver.stop()
    store = Store()
    for image in store.images():
        if IMAGE in image.names:
            store.remove_image(image.key)
    subprocess.run(["podman", "rmi", "-f", IMAGE], capture_output=True)


def test_a_group_on_a_swe_rebench_instance_is_graded_as_the_official_harness(swe_driver, tmp_path):
    driver, instance, dataset, _ = swe_driver
    out = tmp_path / "miles.jsonl"
    prepared = subprocess.run([sys.executable, "-m", "sprout.tasks.swe_rebench", "prepare", str(dataset), "-o",
                               str(out)], cwd=REPO, capture_output=True, text=True)
    assert prepared.returncode == 0, prepared.stderr
    (prompt,) = map(json.loads, out.read_text().splitlines())
    assert prompt["prompt"][0]["content"] == task_prompt(instance) and prompt["metadata"]["image"] == IMAGE
    before = sandbox_ids()
    instruction = "fix this issue"
    script = [{"thought": "fix", "command": FIX_MUL, "match": instruction},
              {"thought": "look", "command": "git status --short", "match": instruction}] + then(SUBMIT, 2)
    assert INSTRUCTION not in instruction  # routed by this task's own words
    with ScriptedModelServer(script, api_key=POLICY_KEY) as model:
        result = MilesShapedClient(driver.url).run_group(group_request(prompt, endpoint_of(model), 2))
    check_graded(result)
    assert sandbox_ids() <= before  # the agents' and the graders' sandboxes are gone


def check_graded(result: dict) -> None:
    """One sample fixed mul (reward 1), the other changed nothing (0), both graded in a fresh sandbox."""
    assert result["status"] == "completed"
    by_reward = sorted(result["trajectories"], key=lambda t: t["reward"])
    assert [t["reward"] for t in by_reward] == [0.0, 1.0]
    for trajectory in by_reward:
        meta = trajectory["metadata"]
        assert meta["zero_reason"] is None and meta["touched_test_paths"] == []
        assert meta["grade"]["mode"] == "fresh" and meta["source_image"] == IMAGE


def test_over_a_run_store_the_workers_run_and_grade_the_samples(swe_driver, tmp_path):
    _, instance, _, config = swe_driver
    cfg = tmp_path / "cfg"
    assert services(cfg, "init", "--port", str(free_port()), "--slots", "2").returncode == 0
    up = services(cfg, "up", "runstore-api")
    worker, driver = None, None
    before = sandbox_ids()
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        exports = dict(item.split("=", 1) for item in services(cfg, "env").stdout.split()[1:])
        worker = subprocess.Popen([sys.executable, "-m", "sprout.worker", "serve", "--url", exports["SPROUT_RUNSTORE_URL"],
                                   "--token-file", str(cfg / "secrets" / "worker.token"), "--slots", "2"],
                                  cwd=REPO, env={**os.environ, "SPROUT_RUNTIME_BIN": str(RUNTIME_BIN),
                                                 "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1"},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        driver = DriverProcess(config, free_port(), env=exports).start()
        prompt = {"prompt": [{"role": "user", "content": task_prompt(instance)}],
                  "metadata": {"task_id": instance.instance_id, "image": IMAGE}}
        script = [{"thought": "fix", "command": FIX_MUL, "match": "fix this issue"},
                  {"thought": "look", "command": "git status --short", "match": "fix this issue"}] + then(SUBMIT, 2)
        with ScriptedModelServer(script) as model:  # workers call a URL a job names with no key
            result = MilesShapedClient(driver.url).run_group(group_request(prompt, endpoint_of(model), 2))
        check_graded(result)
        assert all(t["metadata"]["job_id"] for t in result["trajectories"])
        swe_grade_jobs(RunStoreClient(exports["SPROUT_RUNSTORE_URL"], exports["SPROUT_RUNSTORE_TOKEN"]), config,
                       tmp_path)
        assert sandbox_ids() <= before
    finally:
        if driver is not None:
            driver.stop()
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
        services(cfg, "down")


def swe_grade_jobs(client: RunStoreClient, config, tmp_path) -> None:
    """swe-grade jobs on the worker: a diff graded by the official rule (in a stand-in for an image no
    registry here has), and a payload with a typo refused at submit with the field named."""
    spec = json.loads(config.read_text())["miles"]["tasks"][ROW["instance_id"]]["grade"]["spec"]
    row = json.loads(Path(spec["dataset_path"]).read_text().splitlines()[0])
    row["image_name"] = "docker.io/swerebenchv2/calc:absent"
    (tmp_path / "remote.jsonl").write_text(json.dumps(row) + "\n")
    ref = SweRebenchRef.model_validate(spec | {"dataset_path": str(tmp_path / "remote.jsonl"),
                                               "dataset_sha256": None, "image": IMAGE})
    fixed = run_job(client, SweGradePayload(swe=ref, diff=FIX), group_id="swe-grades", timeout_s=300)
    assert fixed["resolved"] is True and fixed["resolved_exact"] and fixed["zero_reason"] is None, fixed
    assert fixed["statuses"] == {"tests/test_mul.py::test_mul": "PASSED", "tests/test_ops.py::test_add": "PASSED"}
    nothing = run_job(client, SweGradePayload(swe=ref, diff="", rule="lenient"), group_id="swe-grades",
                      timeout_s=300)
    assert nothing["resolved"] is False and nothing["rule"] == "lenient"
    assert nothing["fail_to_pass_missing"] == ["tests/test_mul.py::test_mul"]
    with pytest.raises(RunStoreError, match="rulez"):
        client.submit("swe-grade", {"swe": spec, "diff": FIX, "rulez": "exact"})
    with pytest.raises(RunStoreError, match="exactly one of checkpoint_id and diff"):
        client.submit("swe-grade", {"swe": spec})


def test_a_search_on_a_swe_rebench_instance_branches_and_gates_leaks(swe_driver, tmp_path):
    """FF on a SWE-rebench instance: the branches start from the root's checkpoint in the instance's image
    and are graded as the official harness; a repair naming the hidden test file is gated."""
    config = swe_driver[3]
    prompt = {"prompt": [{"role": "user", "content": "Work in /calc and fix this issue:\n\nmul is wrong"}],
              "metadata": {"task_id": ROW["instance_id"], "image": IMAGE}}
    look = {"thought": "look", "command": "git status --short", "match": "fix this issue"}
    policy = [look, *then(SUBMIT, 2), {"thought": "submit", "command": SUBMIT, "match": "Carry on"}]
    reasoning = "Make tests/test_mul.py pass: mul adds instead of multiplying."
    point = {"turn": 1, "mistake_turn": 2, "mistake": "It never changed calc/ops.py.", "reason": "before it submitted",
             "note": "change calc/ops.py"}
    review = [{"content": json.dumps({"branch_points": [point]}), "match": "Choose up to"},
              {"content": json.dumps({"repairs": [{"turn": 1, "candidates": [
                  {"reasoning": reasoning, "command": FIX_MUL}]}]}), "match": "next turn"}]
    search = {"roots": 1, "points": 1, "candidates": 1, "student_continuations": 1, "candidate_continuations": 1,
              "tf_student_continuations": 0, "repair_rounds": 1, "review_seconds": 60.0, "wall_time_seconds": 120.0}
    before = sandbox_ids()
    with ScriptedModelServer(policy, api_key=POLICY_KEY) as model, ScriptedModelServer(review) as reviewer:
        settings = json.loads(config.read_text())
        settings["miles"]["review"] = {"endpoint": reviewer.base_url, "model": "reviewer",
                                       "continuation_prompt": "Carry on."}
        searching = tmp_path / "search.json"
        searching.write_text(json.dumps(settings))
        driver = DriverProcess(searching, free_port()).start()
        try:
            request = group_request(prompt, endpoint_of(model), 3, minimum_returned_samples=1, search=search)
            result = MilesShapedClient(driver.url).run_group(request)
        finally:
            driver.stop()
    assert result["status"] == "completed" and result["search_branches"] == 2
    root, student, repair = sorted(result["trajectories"], key=lambda t: t["sample_slot_id"])
    assert (root["group"], root["reward"], root["metadata"]["search"]["outcome"]) == ("root", 0.0, "FF")
    assert (student["group"].split(":")[0], student["reward"]) == ("student", 0.0)
    assert (repair["group"].split(":")[0], repair["reward"]) == ("repair", 1.0)  # graded as the official harness
    assert repair["metadata"]["grade"]["mode"] == "fresh" and repair["metadata"]["touched_test_paths"] == []
    assert repair["metadata"]["search"]["leak_terms"] == ["test_mul", "test_mul.py", "tests/test_mul.py"]
    assert repair["metadata"]["provenance"]["inserted_messages"] == [repair["metadata"]["provenance"]["prefix_messages"]]
    assert sandbox_ids() <= before
