"""The RL driver's wire models against the shared Miles fixtures and every rejection the contract names."""

import copy
import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from sprout.rl_driver.outcome import search_outcome
from sprout.rl_driver.protocol import (
    HINT_CLOSE,
    HINT_OPEN,
    TERMINAL_STATUSES,
    RolloutGroupAck,
    RolloutGroupRequest,
    RolloutGroupResult,
    SearchSpec,
    Trajectory,
    check_messages,
    strip_hints,
)

pytestmark = pytest.mark.python_only

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "miles-sprout"
PACKAGE = resources.files("sprout.rl_driver")
Body = dict[str, Any]
#: The search Miles's tests send: two roots, one point, two candidates, two continuations of each.
SEARCH = {
    "roots": 2,
    "points": 1,
    "candidates": 2,
    "student_continuations": 2,
    "candidate_continuations": 2,
    "tf_student_continuations": 2,
    "repair_rounds": 1,
    "review_seconds": 5.0,
    "wall_time_seconds": 7.0,
}
STUDENTS_ONLY = {**SEARCH, "candidates": 0, "candidate_continuations": 0}
LAUNCHER = {
    **SEARCH,
    "candidates": 1,
    "student_continuations": 1,
    "candidate_continuations": 1,
    "repair_rounds": 3,
}


def fixture(name: str) -> Body:
    return json.loads((FIXTURES / f"sprout_{name}.example.json").read_text())


def request_body() -> Body:
    return fixture("request")


def search_body(search: Body = SEARCH, slots: int = 14) -> Body:
    body = request_body()
    job = body["rollout_job_id"]
    body["sample_slots"] = [
        {"sample_slot_id": f"{job}:slot:{11 + k}", "sample_index": 11 + k} for k in range(slots)
    ]
    body.update(max_samples=slots, minimum_returned_samples=1, search=dict(search))
    return body


def trajectory_body() -> Body:
    return fixture("result")["trajectories"][0]


def changed(body: Body, change: Callable[[Body], Any]) -> Body:
    body = copy.deepcopy(body)
    change(body)
    return body


@pytest.mark.parametrize("name", ["request", "result"])
def test_package_examples_are_the_miles_fixtures_byte_for_byte(name):
    assert (PACKAGE / f"{name}.example.json").read_bytes() == (
        FIXTURES / f"sprout_{name}.example.json"
    ).read_bytes()


def test_request_fixture_round_trips_with_the_default_finalization():
    body = request_body()
    request = RolloutGroupRequest.model_validate(body)
    expected = {}
    for key, value in body.items():
        expected[key] = value
        if key == "max_turns":
            expected["finalization_timeout_seconds"] = 1800.0
    assert request.wire() == expected and list(request.wire()) == list(expected), "same keys, same order"
    assert "search" not in request.wire() and request.model_dump(mode="json")["search"] is None
    assert RolloutGroupRequest.model_validate_json(json.dumps(request.wire())) == request


def test_result_fixture_round_trips_exactly():
    body = fixture("result")
    result = RolloutGroupResult.model_validate(body)
    dumped = result.model_dump(mode="json")
    assert dumped == body and list(dumped) == list(body)
    assert list(dumped["trajectories"][0]) == list(body["trajectories"][0])
    assert RolloutGroupResult.model_validate_json(json.dumps(body)) == result


def test_search_request_round_trips_and_freezes():
    request = RolloutGroupRequest.model_validate(search_body())
    assert request.wire()["search"] == SEARCH and list(request.wire()["search"]) == list(SEARCH)
    assert RolloutGroupRequest.model_validate(request.wire()) == request
    with pytest.raises(ValidationError):
        request.max_turns = 3
    RolloutGroupRequest.model_validate(search_body(LAUNCHER, slots=10))


def test_body_digest_names_the_body_not_its_spelling():
    body = request_body()
    digest = RolloutGroupRequest.model_validate(body).body_digest()
    reordered = dict(reversed(list({**body, "finalization_timeout_seconds": 1800.0}.items())))
    assert RolloutGroupRequest.model_validate(reordered).body_digest() == digest and len(digest) == 64
    assert RolloutGroupRequest.model_validate({**body, "rollout_id": 2}).body_digest() != digest


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b.update(protocol_version=1),
        lambda b: b.update(max_model_calls=5),
        lambda b: b["budgets"].update(max_tool_calls=3),
        lambda b: b.pop("budgets"),
        lambda b: b.update(budgets={}),
        lambda b: b["budgets"].update(max_wall_time_seconds=0),
        lambda b: b.update(max_turns=None),
        lambda b: b.update(max_turns=0),
        lambda b: b.update(finalization_timeout_seconds=float("inf")),
        lambda b: b.update(finalization_timeout_seconds=0),
        lambda b: b["sample_slots"].append({**b["sample_slots"][0], "sample_index": 12}),
        lambda b: b["sample_slots"].append({"sample_slot_id": "other", "sample_index": 11}),
        lambda b: b["sample_slots"][0].update(sample_index=-1),
        lambda b: b.update(sample_slots=[]),
        lambda b: b.update(prompt=""),
        lambda b: b.update(prompt=[]),
        lambda b: b.update(prompt=[{"content": "no role"}]),
        lambda b: b.update(rollout_id=-1),
        lambda b: b.update(rollout_id=True),
        lambda b: b.update(rollout_id=2.0),
        lambda b: b.update(max_samples=2),
        lambda b: b.update(minimum_returned_samples=2),
        lambda b: b.update(minimum_returned_samples=0),
        lambda b: b.update(task_id=" "),
        lambda b: b.update(model=""),
        lambda b: b.pop("model"),
    ],
    ids=[
        "protocol_version",
        "max_model_calls",
        "budgets.max_tool_calls",
        "no-budgets",
        "empty-budgets",
        "zero-wall-time",
        "max_turns-null",
        "max_turns-0",
        "finalization-inf",
        "finalization-0",
        "duplicate-slot-id",
        "duplicate-slot-index",
        "negative-index",
        "no-slots",
        "prompt-empty-string",
        "prompt-empty-list",
        "prompt-without-role",
        "rollout_id-negative",
        "rollout_id-bool",
        "rollout_id-float",
        "max_samples-above-slots",
        "minimum-above-max",
        "minimum-0",
        "blank-task",
        "empty-model",
        "model-missing",
    ],
)
def test_request_rejections(change):
    with pytest.raises(ValidationError):
        RolloutGroupRequest.model_validate(changed(request_body(), change))


def test_request_accepts_a_null_model_and_a_text_prompt():
    RolloutGroupRequest.model_validate({**request_body(), "model": None, "prompt": "fix task"})


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b["search"].pop("tf_student_continuations"),
        lambda b: b["search"].update(tf_student_continuations=-1),
        lambda b: b["search"].update(tf_student_continuations=2.0),
        lambda b: b["search"].update(tf_student_continuations="2"),
        lambda b: b["search"].update(tf_student_continuations=True),
        lambda b: b.update(max_samples=13),
        lambda b: b.update(minimum_returned_samples=3),
        lambda b: b["search"].update(candidates=0),
        lambda b: b["search"].update(candidate_continuations=0),
        lambda b: b["search"].update(repair_rounds=2),
        lambda b: b["search"].update(student_continuations=0),
        lambda b: b["search"].update(review_seconds=0),
        lambda b: b["search"].update(wall_time_seconds=float("nan")),
        lambda b: b["search"].update(depth=1),
    ],
    ids=[
        "tf-missing",
        "tf-negative",
        "tf-float",
        "tf-string",
        "tf-bool",
        "max_samples-below-roots-plus-branches",
        "minimum-above-roots",
        "candidates-without-continuations",
        "continuations-without-candidates",
        "rounds-with-two-candidates",
        "no-students",
        "no-review-time",
        "wall-nan",
        "unknown-key",
    ],
)
def test_search_rejections(change):
    with pytest.raises(ValidationError):
        RolloutGroupRequest.model_validate(changed(search_body(), change))


@pytest.mark.parametrize(
    "spec, branches",
    [
        (SEARCH, 12),
        (LAUNCHER, 8),
        ({**STUDENTS_ONLY, "student_continuations": 1, "tf_student_continuations": 4}, 4),
        ({**SEARCH, "points": 3}, 36),
    ],
    ids=["fixture", "launcher", "split-task-students", "three-points"],
)
def test_branches(spec, branches):
    assert SearchSpec.model_validate(spec).branches() == branches


@pytest.mark.parametrize(
    "spec, finalization, seconds",
    [
        (SEARCH, 1.0, 12.0),  # Miles's wait: 10 + 1 + (5 + 7) = 23
        (SEARCH, 5.0, 12.0),  # one round grades nothing in between
        ({**LAUNCHER, "repair_rounds": 2, "review_seconds": 1.0, "wall_time_seconds": 3.0}, 5.0, 13.0),
        ({**LAUNCHER, "review_seconds": 1.0, "wall_time_seconds": 3.0}, 5.0, 22.0),
        (STUDENTS_ONLY, 5.0, 12.0),
    ],
    ids=["fixture", "fixture-long-grade", "two-rounds", "three-rounds", "students-only"],
)
def test_search_seconds(spec, finalization, seconds):
    assert SearchSpec.model_validate(spec).search_seconds(finalization) == seconds


def test_wait_for_the_fixture_search_is_23_seconds():
    body = search_body()
    body.update(budgets={"max_wall_time_seconds": 10.0}, finalization_timeout_seconds=1.0)
    request = RolloutGroupRequest.model_validate(body)
    assert request.search is not None
    wait = request.budgets.max_wall_time_seconds + request.finalization_timeout_seconds
    assert wait + request.search.search_seconds(request.finalization_timeout_seconds) == 23.0


def _call(identifier: str = "call", arguments: Any = '{"command":"pwd"}') -> Body:
    return {"id": identifier, "type": "function", "function": {"name": "shell", "arguments": arguments}}


def _messages(t: Body) -> list[Body]:
    return t["messages"]


def _insert(t: Body, index: int, *messages: Body) -> None:
    t["messages"][index:index] = copy.deepcopy(list(messages))


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.update(status="truncated", stop_reason="timeout"),
        lambda t: t.update(status="truncated", stop_reason="interrupted"),
        lambda t: _messages(t)[1]["tool_calls"][0]["function"].update(arguments={"command": "pwd"}),
        lambda t: _messages(t)[1].update(content=None, reasoning_content="look first"),
        lambda t: _messages(t)[3].update(content=f"{HINT_OPEN}assistants are not checked{HINT_CLOSE}"),
        lambda t: t["metadata"].update(provenance={"prefix_messages": 4, "inserted_messages": [1, 3]}),
        lambda t: t.update(parent_branch_id="job-root", group="student:p1", reward=0),
    ],
    ids=[
        "truncated",
        "interrupted",
        "object-arguments",
        "reasoning",
        "hint-in-assistant",
        "full-prefix",
        "branch",
    ],
)
def test_trajectory_accepts(change):
    Trajectory.model_validate(changed(trajectory_body(), change))


@pytest.mark.parametrize(
    "change",
    [
        lambda t: _messages(t).pop(2),
        lambda t: _insert(t, 3, {"role": "assistant", "tool_calls": [_call()]}, _messages(t)[2]),
        lambda t: _insert(t, 3, {"role": "tool", "tool_call_id": "other", "content": "x"}),
        lambda t: _insert(t, 3, _messages(t)[2]),
        lambda t: _messages(t)[0].update(content=[{"type": "text", "text": "fix task"}]),
        lambda t: _messages(t)[0].update(content=f"fix {HINT_OPEN}hint{HINT_CLOSE}"),
        lambda t: _insert(t, 0, {"role": "system", "content": f"stray {HINT_CLOSE}"}),
        lambda t: t.update(messages=[_messages(t)[0]]),
        lambda t: t.update(messages=[]),
        lambda t: _messages(t)[3].update(extra=1),
        lambda t: _messages(t)[0].update(role="developer"),
        lambda t: _messages(t)[3].update(reasoning_content=None),
        lambda t: _messages(t)[0].update(tool_calls=[]),
        lambda t: _messages(t)[3].update(tool_call_id="call"),
        lambda t: _messages(t)[1].update(tool_calls=[_call("")]),
        lambda t: _messages(t)[1].update(tool_calls=[{**_call(), "type": "custom"}]),
        lambda t: _messages(t)[1].update(tool_calls=[_call(arguments="[1]")]),
        lambda t: _messages(t)[1].update(tool_calls=[_call(arguments="not json")]),
        lambda t: _messages(t)[1].update(tool_calls=[_call(arguments=5)]),
        lambda t: t["metadata"].pop("provenance"),
        lambda t: t["metadata"].update(provenance={"prefix_messages": 5, "inserted_messages": []}),
        lambda t: t["metadata"].update(provenance={"prefix_messages": 0, "inserted_messages": [0]}),
        lambda t: t["metadata"].update(provenance={"prefix_messages": 0, "inserted_messages": [4]}),
        lambda t: t["metadata"].update(provenance={"prefix_messages": True, "inserted_messages": []}),
        lambda t: t["metadata"]["provenance"].update(extra=0),
        lambda t: t.update(stop_reason="timeout"),
        lambda t: t.update(status="truncated"),
        lambda t: t.update(status="truncated", stop_reason="crashed"),
        lambda t: t.update(hints_removed=False),
        lambda t: t.update(hints_removed=1),
        lambda t: t.update(reward=float("inf")),
        lambda t: t.update(token_ids=[1, 2]),
        lambda t: t.update(branch_id=""),
    ],
    ids=[
        "unanswered-call",
        "duplicate-call-id",
        "tool-without-pending-call",
        "tool-answering-twice",
        "list-content",
        "hint-in-user",
        "stray-close-in-system",
        "no-assistant",
        "no-messages",
        "unknown-message-key",
        "unknown-role",
        "null-reasoning",
        "tool-calls-on-user",
        "tool-call-id-on-assistant",
        "empty-call-id",
        "non-function-call",
        "array-arguments",
        "bad-json-arguments",
        "number-arguments",
        "provenance-missing",
        "prefix-beyond-length",
        "inserted-user-message",
        "inserted-out-of-range",
        "prefix-bool",
        "provenance-extra-key",
        "completed-with-stop-reason",
        "truncated-without-stop-reason",
        "unknown-stop-reason",
        "hints-not-removed",
        "hints-removed-1",
        "infinite-reward",
        "token_ids",
        "empty-branch-id",
    ],
)
def test_trajectory_rejections(change):
    with pytest.raises(ValidationError):
        Trajectory.model_validate(changed(trajectory_body(), change))


def test_check_messages_says_what_is_wrong():
    with pytest.raises(ValueError, match="never answered"):
        check_messages(trajectory_body()["messages"][:2])
    check_messages(trajectory_body()["messages"])


def _failed(slot: str) -> Body:
    return {"sample_slot_id": slot, "reason": "Actor did not complete"}


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r.update(actual_samples=0),
        lambda r: r.update(failed_samples=[_failed(r["trajectories"][0]["sample_slot_id"])]),
        lambda r: r.update(trajectories=r["trajectories"] * 2, actual_samples=2),
        lambda r: r.update(failed_samples=[_failed("s"), _failed("s")]),
        lambda r: r.update(progress={}),
        lambda r: r.update(status="done"),
        lambda r: r.update(search_branches=-1),
        lambda r: r.update(max_samples=0),
    ],
    ids=[
        "actual-mismatch",
        "slot-returned-and-failed",
        "slot-returned-twice",
        "slot-failed-twice",
        "progress",
        "unknown-status",
        "negative-branches",
        "no-samples",
    ],
)
def test_result_rejections(change):
    with pytest.raises(ValidationError):
        RolloutGroupResult.model_validate(changed(fixture("result"), change))


def test_result_while_running_and_after_a_failed_slot():
    running = {**fixture("result"), "trajectories": [], "actual_samples": 0, "status": "running"}
    RolloutGroupResult.model_validate(running)
    partial = {
        **fixture("result"),
        "max_samples": 2,
        "status": "early_stopped",
        "failed_samples": [_failed("s2")],
    }
    RolloutGroupResult.model_validate(partial)


def test_ack_is_exactly_id_and_status():
    ack = RolloutGroupAck.model_validate({"rollout_job_id": "job", "status": "queued"})
    assert ack.model_dump(mode="json") == {"rollout_job_id": "job", "status": "queued"}
    with pytest.raises(ValidationError):
        RolloutGroupAck.model_validate({"rollout_job_id": "job", "status": "queued", "protocol_version": 1})
    assert TERMINAL_STATUSES == {"completed", "early_stopped", "failed", "cancelled"}


@pytest.mark.parametrize(
    "counts, outcome",
    [
        ((2, 0, 0), "ungraded"),
        ((2, 2, 2), "TT"),
        ((2, 1, 1), "TT_partial"),
        ((2, 2, 1), "TF"),
        ((3, 2, 1), "TF"),
        ((2, 2, 0), "FF"),
        ((2, 1, 0), "FF_partial"),
    ],
)
def test_search_outcome(counts, outcome):
    assert search_outcome(*counts) == outcome


@pytest.mark.parametrize("counts", [(2, 3, 0), (2, 1, 2), (2, 0, -1), (2, True, 0), (2.0, 2, 0)])
def test_search_outcome_refuses_impossible_counts(counts):
    with pytest.raises(ValueError):
        search_outcome(*counts)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("plain", ("plain", False)),
        ("", ("", False)),
        (f"a{HINT_OPEN}hint{HINT_CLOSE}b", ("ab", True)),
        (f"a{HINT_OPEN}line\nline{HINT_CLOSE}b{HINT_OPEN}x{HINT_CLOSE}c", ("abc", True)),
        (f"a{HINT_OPEN}b", ("a", True)),  # an unclosed hint runs to the end
        (f"a{HINT_CLOSE}b", ("ab", True)),
    ],
    ids=["plain", "empty", "span", "two-spans-multiline", "unclosed", "stray-close"],
)
def test_strip_hints(text, expected):
    assert strip_hints(text) == expected
