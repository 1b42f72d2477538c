"""The driver's group lifecycle with samples that only wait (no sandboxes): a DELETE while samples are
still stopping, the same id submitted again, a sample that outlives its group's time, requests refused."""

import copy
import json
import threading
import time
from pathlib import Path

import pytest

from sprout.rl_driver import groups
from sprout.rl_driver.config import DriverConfig
from sprout.rl_driver.groups import Driver, GroupConflict, GroupNotFound, RequestRefused
from sprout.rl_driver.ledger import Ledger
from sprout.rl_driver.protocol import RolloutGroupRequest
from sprout.rl_driver.samples import SampleResult
from tests.conftest import REPO

pytestmark = pytest.mark.python_only

EXAMPLES = REPO / "src" / "sprout" / "rl_driver"
TRAJECTORY = json.loads((EXAMPLES / "result.example.json").read_text())["trajectories"][0]


class Samples:
    """A sample is done after `seconds` (a trajectory), or keeps running `linger` seconds after its stop
    (None: until `release` is set, as `close` does)."""

    def __init__(self, seconds: float = 0.0, linger: float | None = 0.0):
        self.seconds, self.linger = seconds, linger
        self.started: list[str] = []
        self.finished: list[str] = []
        self.release = threading.Event()

    def run(self, plan, stop: threading.Event, on_job):
        self.started.append(plan.slot.sample_slot_id)
        stopped = stop.wait(self.seconds)
        if stopped:
            self.release.wait(self.linger)
            self.finished.append(plan.slot.sample_slot_id)
            raise RuntimeError("stopped")
        self.finished.append(plan.slot.sample_slot_id)
        return plan

    def close(self) -> None:
        self.release.set()


@pytest.fixture
def make_driver(tmp_path: Path, monkeypatch):
    (tmp_path / "tasks" / "task-1").mkdir(parents=True)
    (tmp_path / "tasks" / "task-1" / "task.toml").write_text("")
    config = DriverConfig(tasks_dir=tmp_path / "tasks", data_dir=tmp_path / "data")

    def fake_result(plan, done, job_id, store):
        trajectory = copy.deepcopy(TRAJECTORY) | {"sample_slot_id": plan.slot.sample_slot_id}
        return SampleResult(trajectory, None, {"model_calls": 1})

    monkeypatch.setattr(groups, "sample_result", fake_result)
    monkeypatch.setattr(groups, "STOP_GRACE_S", 0.5)
    made: list[Driver] = []

    def make(samples: Samples) -> Driver:
        made.append(Driver(config, Ledger(config.ledger_url), samples, slots=8))
        return made[-1]

    yield make
    for driver in made:
        driver.close()


def request(n: int = 2, **changes) -> RolloutGroupRequest:
    body = json.loads((EXAMPLES / "request.example.json").read_text())
    job = body["rollout_job_id"]
    body |= {"sample_slots": [{"sample_slot_id": f"{job}:slot:{i}", "sample_index": i} for i in range(n)],
             "max_samples": n, "minimum_returned_samples": n, **changes}
    return RolloutGroupRequest.model_validate(body)


def wait_for_status(driver: Driver, group_id: str, status: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while (result := driver.result(group_id).model_dump(mode="json"))["status"] != status:
        assert time.monotonic() < deadline, result
        time.sleep(0.05)
    return result


def test_a_deleted_id_is_free_again_only_once_its_samples_stopped(make_driver):
    samples = Samples(seconds=60, linger=None)  # a stopped sample ends when the test releases it (a turn in flight)
    driver = make_driver(samples)
    first = request()
    driver.submit(first)
    deadline = time.monotonic() + 10
    while len(samples.started) < 2:
        assert time.monotonic() < deadline, "the group's samples did not start"
        time.sleep(0.05)
    assert driver.delete(first.rollout_job_id).status == "cancelled"
    with pytest.raises(GroupNotFound):
        driver.result(first.rollout_job_id)
    with pytest.raises(GroupConflict, match="being deleted"):
        driver.submit(first)
    assert samples.finished == [], "the stopped samples are still in their turn"
    samples.release.set()
    deadline = time.monotonic() + 10
    while True:  # free once the old samples have ended
        try:
            driver.submit(first)
            break
        except GroupConflict:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert len(samples.finished) == 2  # the old ones; the new group's samples run on, untouched by them
    result = driver.result(first.rollout_job_id)
    assert result.status in ("queued", "running") and result.failed_samples == [] and result.trajectories == []
    driver.delete(first.rollout_job_id)


def test_a_sample_that_outlives_its_group_is_failed_and_its_late_result_ignored(make_driver):
    samples = Samples(seconds=0.2)
    driver = make_driver(samples)
    quick = request(1, rollout_job_id="quick", budgets={"max_wall_time_seconds": 5.0})
    driver.submit(quick)
    assert wait_for_status(driver, "quick", "completed")["actual_samples"] == 1
    slow = Samples(seconds=60, linger=60)  # ignores its stop: still running when the group is finished
    driver = make_driver(slow)
    group = request(2, rollout_job_id="slow", minimum_returned_samples=1, budgets={"max_wall_time_seconds": 1.0},
                    finalization_timeout_seconds=1.0)
    started = time.monotonic()
    driver.submit(group)
    result = wait_for_status(driver, "slow", "failed")
    assert time.monotonic() - started < 1.0 + 1.0 + 0.5 + 2  # finished inside wall + finalization + grace
    assert [f["reason"] for f in result["failed_samples"]] == [
        "did not finish within the group's wall time and finalization"] * 2
    slow.release.set()  # the stragglers end now; the group's result stays as it was
    time.sleep(0.5)
    assert driver.result("slow").model_dump(mode="json") == result


@pytest.mark.parametrize("changes, message", [
    ({"search": {"roots": 1, "points": 1, "candidates": 0, "student_continuations": 1, "candidate_continuations": 0,
                 "tf_student_continuations": 0, "repair_rounds": 1, "review_seconds": 1.0, "wall_time_seconds": 1.0},
      "minimum_returned_samples": 1}, "Configure Sprout miles.review for search rollouts"),
    ({"rollout_job_id": "a/b"}, "rollout_job_id must be"),
    ({"model_endpoint": "ftp://model"}, "model_endpoint must be an http"),
])
def test_requests_it_cannot_serve_are_refused_before_anything_is_recorded(make_driver, changes, message):
    driver = make_driver(Samples())
    bad = request(2, **changes)
    with pytest.raises(RequestRefused, match=message):
        driver.submit(bad)
    with pytest.raises(GroupNotFound):
        driver.result(bad.rollout_job_id)


def test_a_task_registry_entry_says_how_it_is_graded():
    with pytest.raises(ValueError, match='profile "grade" takes a spec'):
        DriverConfig.model_validate({"miles": {"tasks": {"t": {"grade": {"profile": "grade"}}}}})
    with pytest.raises(ValueError, match="needs task_dir"):
        DriverConfig.model_validate({"miles": {"tasks": {"t": {"grade": {"profile": "harbor"}}}}})
    with pytest.raises(ValueError, match="benchmark"):
        DriverConfig.model_validate({"miles": {"tasks": {"t": {"grade": {"profile": "grade", "spec": {
            "benchmark": "swe-bench", "instance_id": "i", "dataset_path": "d", "parser_path": "p"}}}}}})
