"""The RL driver's wire models against the shared Miles fixtures and every rejection the contract names."""

import copy
import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

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


def assert_refused(model: type[BaseModel], body: Body, refusal: str) -> None:
    """`body` is refused for the reason `refusal` begins ("field: message"; "<body>: ..." for a rule
    over several fields), not merely refused."""
    with pytest.raises(ValidationError) as error:
        model.model_validate(body)
    reasons = [f"{'.'.join(map(str, e['loc'])) or '<body>'}: {e['msg'].removeprefix('Value error, ')}"
               for e in error.value.errors()]
    assert any(reason.startswith(refusal) for reason in reasons), reasons


@pytest.mark.parametrize("name", ["request", "result"])
def test_package_examples_are_the_miles_fixtures_byte_for_byte(name):
    assert (PACKAGE / f"{name}.example.json").read_bytes() == (
        FIXTURES / f"sprout_{name}.example.json"
    ).read_bytes()


def test_the_search_example_is_a_valid_ff_group_of_the_fixture_shape():
    """search_result.example.json (written from a real search run by test_search's FF test, which checks it
    still matches one) is a result the wire model accepts: 14 slots, 2 roots, 12 branches from their points."""
    example = json.loads((PACKAGE / "search_result.example.json").read_text())
    result = RolloutGroupResult.model_validate(example)
    assert result.status == "completed" and result.actual_samples == len(result.trajectories) == 14
    groups = [(t.group or "").split(":")[0] for t in result.trajectories]
    assert groups.count("root") == 2 and groups.count("student") == 4 and groups.count("repair") == 8
    assert all(t.metadata["search"]["point_id"].endswith("-step2") for t in result.trajectories if t.group != "root")


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
    launcher = RolloutGroupRequest.model_validate(search_body(LAUNCHER, slots=10))
    assert launcher.search is not None and launcher.search.repair_rounds == 3 and launcher.max_samples == 10


def test_body_digest_names_the_body_not_its_spelling():
    body = request_body()
    digest = RolloutGroupRequest.model_validate(body).body_digest()
    reordered = dict(reversed(list({**body, "finalization_timeout_seconds": 1800.0}.items())))
    assert RolloutGroupRequest.model_validate(reordered).body_digest() == digest and len(digest) == 64
    assert RolloutGroupRequest.model_validate({**body, "rollout_id": 2}).body_digest() != digest


REQUEST_REFUSALS = [
    pytest.param(lambda b: b.update(protocol_version=1),
                 "protocol_version: Extra inputs are not permitted", id="protocol_version"),
    pytest.param(lambda b: b.update(max_model_calls=5),
                 "max_model_calls: Extra inputs are not permitted", id="max_model_calls"),
    pytest.param(lambda b: b["budgets"].update(max_tool_calls=3),
                 "budgets.max_tool_calls: Extra inputs are not permitted", id="budgets.max_tool_calls"),
    pytest.param(lambda b: b.pop("budgets"), "budgets: Field required", id="no-budgets"),
    pytest.param(lambda b: b.update(budgets={}), "budgets.max_wall_time_seconds: Field required", id="empty-budgets"),
    pytest.param(lambda b: b["budgets"].update(max_wall_time_seconds=0),
                 "budgets.max_wall_time_seconds: Input should be greater than 0", id="zero-wall-time"),
    pytest.param(lambda b: b.update(max_turns=None), "max_turns: Input should be a valid integer", id="max_turns-null"),
    pytest.param(lambda b: b.update(max_turns=0), "max_turns: Input should be greater than 0", id="max_turns-0"),
    pytest.param(lambda b: b.update(finalization_timeout_seconds=float("inf")),
                 "finalization_timeout_seconds: Input should be a finite number", id="finalization-inf"),
    pytest.param(lambda b: b.update(finalization_timeout_seconds=0),
                 "finalization_timeout_seconds: Input should be greater than 0", id="finalization-0"),
    pytest.param(lambda b: b["sample_slots"].append({**b["sample_slots"][0], "sample_index": 12}),
                 "<body>: sample_slot_id values must be unique", id="duplicate-slot-id"),
    pytest.param(lambda b: b["sample_slots"].append({"sample_slot_id": "other", "sample_index": 11}),
                 "<body>: sample_index values must be unique", id="duplicate-slot-index"),
    pytest.param(lambda b: b["sample_slots"][0].update(sample_index=-1),
                 "sample_slots.0.sample_index: Input should be greater than or equal to", id="negative-index"),
    pytest.param(lambda b: b.update(sample_slots=[]),
                 "sample_slots: List should have at least 1 item after validation, not 0", id="no-slots"),
    pytest.param(lambda b: b.update(prompt=""),
                 "prompt.constrained-str: String should have at least 1 character", id="prompt-empty-string"),
    pytest.param(lambda b: b.update(prompt=[]),
                 "prompt.list[dict[str,any]]: List should have at least 1 item", id="prompt-empty-list"),
    pytest.param(lambda b: b.update(prompt=[{"content": "no role"}]),
                 "prompt: every prompt message needs a role", id="prompt-without-role"),
    pytest.param(lambda b: b.update(prompt=[{"role": "system", "content": "You are terse."},
                                            {"role": "user", "content": "fix it"}]),
                 "prompt: message 0 is a 'system' message: the prompt is the task, as user messages",
                 id="prompt-system-message"),
    pytest.param(lambda b: b.update(prompt=[{"role": "user", "content": "fix it"},
                                            {"role": "assistant", "content": "ok"}]),
                 "prompt: message 1 is a 'assistant' message", id="prompt-assistant-message"),
    pytest.param(lambda b: b.update(prompt=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
                 "prompt: message 0: its content must be text", id="prompt-image"),
    pytest.param(lambda b: b.update(prompt=[{"role": "user", "content": " "}]),
                 "prompt: message 0 has no text", id="prompt-blank-message"),
    pytest.param(lambda b: b.update(rollout_id=-1),
                 "rollout_id: Input should be greater than or equal to 0", id="rollout_id-negative"),
    pytest.param(lambda b: b.update(rollout_id=True),
                 "rollout_id: Input should be a valid integer", id="rollout_id-bool"),
    pytest.param(lambda b: b.update(rollout_id=2.0),
                 "rollout_id: Input should be a valid integer", id="rollout_id-float"),
    pytest.param(lambda b: b.update(max_samples=2),
                 "<body>: expected minimum_returned_samples <= max_samples <=", id="max_samples-above-slots"),
    pytest.param(lambda b: b.update(minimum_returned_samples=2),
                 "<body>: expected minimum_returned_samples <= max_samples <=", id="minimum-above-max"),
    pytest.param(lambda b: b.update(minimum_returned_samples=0),
                 "minimum_returned_samples: Input should be greater than 0", id="minimum-0"),
    pytest.param(lambda b: b.update(task_id=" "), "task_id: String should match pattern '\\S'", id="blank-task"),
    pytest.param(lambda b: b.update(model=""), "model: String should match pattern '\\S'", id="empty-model"),
    pytest.param(lambda b: b.pop("model"), "model: Field required", id="model-missing"),
]


@pytest.mark.parametrize("change, refusal", REQUEST_REFUSALS)
def test_request_rejections(change, refusal):
    assert_refused(RolloutGroupRequest, changed(request_body(), change), refusal)


def test_the_prompts_user_messages_are_the_agents_task():
    """What the agent is given: the string, or every user message's text (parts joined), one paragraph each."""
    from sprout.rl_driver.samples import prompt_text

    request = RolloutGroupRequest.model_validate({**request_body(), "prompt": [
        {"role": "user", "content": "Work in /repo and fix this issue:"},
        {"role": "user", "content": [{"type": "text", "text": "add() "}, {"type": "text", "text": "subtracts"}]}]})
    assert prompt_text(request.prompt) == "Work in /repo and fix this issue:\n\nadd() subtracts"
    assert prompt_text("fix task") == "fix task"


def test_request_accepts_a_null_model_and_a_text_prompt():
    request = RolloutGroupRequest.model_validate({**request_body(), "model": None, "prompt": "fix task"})
    assert (request.model, request.prompt) == (None, "fix task")
    assert (request.wire()["model"], request.wire()["prompt"]) == (None, "fix task")


SEARCH_REFUSALS = [
    pytest.param(lambda b: b["search"].pop("tf_student_continuations"),
                 "search.tf_student_continuations: Field required", id="tf-missing"),
    pytest.param(lambda b: b["search"].update(tf_student_continuations=-1),
                 "search.tf_student_continuations: Input should be greater than or", id="tf-negative"),
    pytest.param(lambda b: b["search"].update(tf_student_continuations=2.0),
                 "search.tf_student_continuations: Input should be a valid integer", id="tf-float"),
    pytest.param(lambda b: b["search"].update(tf_student_continuations="2"),
                 "search.tf_student_continuations: Input should be a valid integer", id="tf-string"),
    pytest.param(lambda b: b["search"].update(tf_student_continuations=True),
                 "search.tf_student_continuations: Input should be a valid integer", id="tf-bool"),
    pytest.param(lambda b: b.update(max_samples=13),
                 "<body>: max_samples 13 is below search.roots + search.branches() = 14",
                 id="max_samples-below-roots-plus-branches"),
    pytest.param(lambda b: b.update(minimum_returned_samples=3),
                 "<body>: with a search, minimum_returned_samples must not exceed", id="minimum-above-roots"),
    pytest.param(lambda b: b["search"].update(candidates=0),
                 "search: candidates and candidate_continuations must both be zero or",
                 id="candidates-without-continuations"),
    pytest.param(lambda b: b["search"].update(candidate_continuations=0),
                 "search: candidates and candidate_continuations must both be zero or",
                 id="continuations-without-candidates"),
    pytest.param(lambda b: b["search"].update(repair_rounds=2),
                 "search: repair_rounds > 1 requires candidates == 1 and", id="rounds-with-two-candidates"),
    pytest.param(lambda b: b["search"].update(student_continuations=0),
                 "search.student_continuations: Input should be greater than 0", id="no-students"),
    pytest.param(lambda b: b["search"].update(review_seconds=0),
                 "search.review_seconds: Input should be greater than 0", id="no-review-time"),
    pytest.param(lambda b: b["search"].update(wall_time_seconds=float("nan")),
                 "search.wall_time_seconds: Input should be a finite number", id="wall-nan"),
    pytest.param(lambda b: b["search"].update(depth=1),
                 "search.depth: Extra inputs are not permitted", id="unknown-key"),
]


@pytest.mark.parametrize("change, refusal", SEARCH_REFUSALS)
def test_search_rejections(change, refusal):
    assert_refused(RolloutGroupRequest, changed(search_body(), change), refusal)


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
    body = changed(trajectory_body(), change)
    assert Trajectory.model_validate(body).model_dump(mode="json") == body, "accepted and kept as sent"


TRAJECTORY_REFUSALS = [
    pytest.param(lambda t: _messages(t).pop(2), "<body>: tool calls ['call'] are never answered", id="unanswered-call"),
    pytest.param(lambda t: _insert(t, 3, {"role": "assistant", "tool_calls": [_call()]}, _messages(t)[2]),
                 "<body>: tool call id 'call' is used twice", id="duplicate-call-id"),
    pytest.param(lambda t: _insert(t, 3, {"role": "tool", "tool_call_id": "other", "content": "x"}),
                 "<body>: message 3 answers 'other', which is no pending tool call", id="tool-without-pending-call"),
    pytest.param(lambda t: _insert(t, 3, _messages(t)[2]),
                 "<body>: message 3 answers 'call', which is no pending tool call", id="tool-answering-twice"),
    pytest.param(lambda t: _messages(t)[0].update(content=[{"type": "text", "text": "fix task"}]),
                 "<body>: message 0: content must be a string or null, not list", id="list-content"),
    pytest.param(lambda t: _messages(t)[0].update(content=f"fix {HINT_OPEN}hint{HINT_CLOSE}"),
                 "<body>: message 0 (user) still carries a training hint marker", id="hint-in-user"),
    pytest.param(lambda t: _insert(t, 0, {"role": "system", "content": f"stray {HINT_CLOSE}"}),
                 "<body>: message 0 (system) still carries a training hint marker", id="stray-close-in-system"),
    pytest.param(lambda t: t.update(messages=[_messages(t)[0]]),
                 "<body>: a trajectory needs at least one assistant message", id="no-assistant"),
    pytest.param(lambda t: t.update(messages=[]), "<body>: a trajectory needs at least one message", id="no-messages"),
    pytest.param(lambda t: _messages(t)[3].update(extra=1),
                 "<body>: message 3 has unknown keys ['extra']", id="unknown-message-key"),
    pytest.param(lambda t: _messages(t)[0].update(role="developer"),
                 "<body>: message 0 has role 'developer'; expected one of ['assistant',", id="unknown-role"),
    pytest.param(lambda t: _messages(t)[3].update(reasoning_content=None),
                 "<body>: message 3: reasoning_content must be a string (omit it rather", id="null-reasoning"),
    pytest.param(lambda t: _messages(t)[0].update(tool_calls=[]),
                 "<body>: message 0: only assistant messages carry tool_calls", id="tool-calls-on-user"),
    pytest.param(lambda t: _messages(t)[3].update(tool_call_id="call"),
                 "<body>: message 3: only tool messages carry tool_call_id", id="tool-call-id-on-assistant"),
    pytest.param(lambda t: _messages(t)[1].update(tool_calls=[_call("")]),
                 "<body>: a tool call needs a non-empty id", id="empty-call-id"),
    pytest.param(lambda t: _messages(t)[1].update(tool_calls=[{**_call(), "type": "custom"}]),
                 "<body>: tool call 'call' has type 'custom', not 'function'", id="non-function-call"),
    pytest.param(lambda t: _messages(t)[1].update(tool_calls=[_call(arguments="[1]")]),
                 "<body>: tool call 'call': arguments must decode to a JSON object", id="array-arguments"),
    pytest.param(lambda t: _messages(t)[1].update(tool_calls=[_call(arguments="not json")]),
                 "<body>: tool call 'call': arguments are not JSON", id="bad-json-arguments"),
    pytest.param(lambda t: _messages(t)[1].update(tool_calls=[_call(arguments=5)]),
                 "<body>: tool call 'call': arguments must decode to a JSON object", id="number-arguments"),
    pytest.param(lambda t: t["metadata"].pop("provenance"),
                 "<body>: metadata.provenance is required", id="provenance-missing"),
    pytest.param(lambda t: t["metadata"].update(provenance={"prefix_messages": 5, "inserted_messages": []}),
                 "<body>: provenance prefix_messages 5 > 4 messages", id="prefix-beyond-length"),
    pytest.param(lambda t: t["metadata"].update(provenance={"prefix_messages": 0, "inserted_messages": [0]}),
                 "<body>: provenance inserted_messages: message 0 is not an assistant", id="inserted-user-message"),
    pytest.param(lambda t: t["metadata"].update(provenance={"prefix_messages": 0, "inserted_messages": [4]}),
                 "<body>: provenance inserted_messages: message 4 is not an assistant", id="inserted-out-of-range"),
    pytest.param(lambda t: t["metadata"].update(provenance={"prefix_messages": True, "inserted_messages": []}),
                 "<body>: metadata.provenance is invalid: prefix_messages: Input should", id="prefix-bool"),
    pytest.param(lambda t: t["metadata"]["provenance"].update(extra=0),
                 "<body>: metadata.provenance is invalid: extra: Extra inputs are not", id="provenance-extra-key"),
    pytest.param(lambda t: t.update(stop_reason="timeout"),
                 "<body>: stop_reason is null exactly when status is 'completed'", id="completed-with-stop-reason"),
    pytest.param(lambda t: t.update(status="truncated"),
                 "<body>: stop_reason is null exactly when status is 'completed'", id="truncated-without-stop-reason"),
    pytest.param(lambda t: t.update(status="truncated", stop_reason="crashed"),
                 "stop_reason: Input should be 'max_turns_reached', 'timeout' or", id="unknown-stop-reason"),
    pytest.param(lambda t: t.update(hints_removed=False),
                 "hints_removed: hints_removed must be literally true", id="hints-not-removed"),
    pytest.param(lambda t: t.update(hints_removed=1),
                 "hints_removed: hints_removed must be literally true", id="hints-removed-1"),
    pytest.param(lambda t: t.update(reward=float("inf")),
                 "reward: Input should be a finite number", id="infinite-reward"),
    pytest.param(lambda t: t.update(token_ids=[1, 2]), "token_ids: Extra inputs are not permitted", id="token_ids"),
    pytest.param(lambda t: t.update(branch_id=""),
                 "branch_id: String should match pattern '\\S'", id="empty-branch-id"),
]


@pytest.mark.parametrize("change, refusal", TRAJECTORY_REFUSALS)
def test_trajectory_rejections(change, refusal):
    assert_refused(Trajectory, changed(trajectory_body(), change), refusal)


def test_check_messages_says_what_is_wrong():
    with pytest.raises(ValueError, match="never answered"):
        check_messages(trajectory_body()["messages"][:2])
    check_messages(trajectory_body()["messages"])


def _failed(slot: str) -> Body:
    return {"sample_slot_id": slot, "reason": "Actor did not complete"}


RESULT_REFUSALS = [
    pytest.param(lambda r: r.update(actual_samples=0),
                 "<body>: actual_samples 0 != 1 trajectories", id="actual-mismatch"),
    pytest.param(lambda r: r.update(failed_samples=[_failed(r["trajectories"][0]["sample_slot_id"])]),
                 "<body>: each sample slot is filled or failed at most once", id="slot-returned-and-failed"),
    pytest.param(lambda r: r.update(trajectories=r["trajectories"] * 2, actual_samples=2),
                 "<body>: each sample slot is filled or failed at most once", id="slot-returned-twice"),
    pytest.param(lambda r: r.update(failed_samples=[_failed("s"), _failed("s")]),
                 "<body>: each sample slot is filled or failed at most once", id="slot-failed-twice"),
    pytest.param(lambda r: r.update(progress={}), "progress: Extra inputs are not permitted", id="progress"),
    pytest.param(lambda r: r.update(status="done"),
                 "status: Input should be 'queued', 'running', 'completed',", id="unknown-status"),
    pytest.param(lambda r: r.update(search_branches=-1),
                 "search_branches: Input should be greater than or equal to 0", id="negative-branches"),
    pytest.param(lambda r: r.update(max_samples=0), "max_samples: Input should be greater than 0", id="no-samples"),
]


@pytest.mark.parametrize("change, refusal", RESULT_REFUSALS)
def test_result_rejections(change, refusal):
    assert_refused(RolloutGroupResult, changed(fixture("result"), change), refusal)


def test_result_while_running_and_after_a_failed_slot():
    running = {**fixture("result"), "trajectories": [], "actual_samples": 0, "status": "running"}
    assert RolloutGroupResult.model_validate(running).model_dump(mode="json") == running
    partial = {
        **fixture("result"),
        "max_samples": 2,
        "status": "early_stopped",
        "failed_samples": [_failed("s2")],
    }
    result = RolloutGroupResult.model_validate(partial)
    assert result.model_dump(mode="json") == partial
    assert [f.sample_slot_id for f in result.failed_samples] == ["s2"] and result.status == "early_stopped"


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
