"""The one SPROUT reviewer against the scripted server: parsing, validation, retries, the fallback rule, the
refusal policy, repairs, deadlines; and the same request for the same failed trajectory from an evaluation
and from the RL search."""

import json
import os
from datetime import UTC, datetime

import pytest

from sprout.agent.journal import ParentRef, Turn
from sprout.agent.models import Endpoint
from sprout.method.records import BranchPoint, ReviewAnswer
from sprout.method.review import (
    FALLBACK_NOTE,
    Reviewer,
    ReviewerConfig,
    ReviewerRefused,
    ReviewInput,
    Step,
    check_points,
    fallback_points,
    first_json_object,
    request_messages,
)
from sprout.method.trajectory import history
from sprout.testing.scripted_model import ScriptedModelServer
from tests.rl_driver.test_search_parts import write_journal

pytestmark = pytest.mark.python_only  # needs no podman (pytest -m python_only)


def steps(n: int) -> list[Step]:
    return [Step(turn=Turn(turn=i, checkpoint=f"ck-{i}", thought=f"t{i}", commands=[f"cmd {i}"], observation="x" * 5000,
                            exit_code=0, tokens_in=1, tokens_out=1, model_latency_s=0, command_s=0, checkpoint_ms=1,
                                n_calls=i, new_messages=[])) for i in range(1, n + 1)]


def inp(n_turns: int = 6, n: int = 2, step_limit: int = 50, **more) -> ReviewInput:
    return ReviewInput(instruction="fix add()", steps=steps(n_turns), verifier_output="FAILED test_add\n",
                       reward=0.0, points=n, max_calls=step_limit, **more)


def point(turn: int, mistake: int) -> dict:
    return {"turn": turn, "mistake_turn": mistake, "mistake": "m", "reason": "r", "note": f"note {turn}"}


def reviewer(url: str, retries: int = 2, **settings) -> Reviewer:
    os.environ.setdefault("SPROUT_REVIEW_TEST_KEY", "k")
    return Reviewer(ReviewerConfig(model="reviewer", retries=retries, **settings), Endpoint(url, "SPROUT_REVIEW_TEST_KEY"))


def review(reviewer: Reviewer, inp: ReviewInput, **names):
    return reviewer.review(inp, **names)


def test_first_json_object_skips_thinking_and_prose():
    text = '<think>{"no": 1}</think> Sure! {"branch_points": []} and {"x": 2}'
    assert first_json_object(text) == {"branch_points": []}
    assert first_json_object('```json\n{"a": {"b": 1}}\n```') == {"a": {"b": 1}}
    with pytest.raises(ValueError, match="no JSON object"):
        first_json_object("turn 2, I think")


def test_points_are_validated_deduplicated_and_capped():
    answer = ReviewAnswer(branch_points=[BranchPoint(**point(3, 4)), BranchPoint(**point(3, 5)),
                                         BranchPoint(**point(5, 4)), BranchPoint(**point(2, 9)),
                                         BranchPoint(**point(1, 2)), BranchPoint(**point(0, 1))])
    points, problems = check_points(answer, inp(n=2))
    assert [p.turn for p in points] == [3, 1]
    assert len(problems) == 2 and "mistake_turn" in problems[0] and "<= 6" in problems[1]
    points, problems = check_points(ReviewAnswer(branch_points=[BranchPoint(**point(4, 5))]), inp(step_limit=4))
    assert points == [] and "leaves no step" in problems[0]


def test_fallback_rule_is_evenly_spaced_and_in_range():
    assert [p.turn for p in fallback_points(inp(n_turns=4, n=1))] == [2]
    assert [p.turn for p in fallback_points(inp(n_turns=12, n=3))] == [3, 6, 9]
    assert [p.turn for p in fallback_points(inp(n_turns=1, n=2))] == [0]
    assert all(p.note == FALLBACK_NOTE and "fallback" in p.reason for p in fallback_points(inp()))


def test_prompt_caps_observations_and_holds_the_verifier_output():
    system, user = request_messages(inp(), ReviewerConfig(model="m"))
    text = user["content"]
    assert system["role"] == "system" and "Answer with one JSON object" in system["content"]
    assert "# Task\n\nfix add()" in text and "## Turn 6 (exit code 0)" in text and "$ cmd 3" in text
    assert "chars left out" in text and "FAILED test_add" in text and "Valid K: 0 to 5" in text
    assert len(text) < 6 * 3_500 + 3_000  # each 5,000-character output cut to 3,000
    cut = request_messages(inp(), ReviewerConfig(model="m", prompt_chars=8_000))[1]["content"]
    assert len(cut) < 8_000 and "Valid K: 0 to 5" in cut  # the trajectory cut, the question whole


def test_a_good_answer_is_used():
    with ScriptedModelServer([{"content": json.dumps({"branch_points": [point(4, 5), point(2, 3)]})}]) as server:
        record = review(reviewer(server.base_url), inp(), review_id="r1", round_number=1, reviewed="a1")
        body = server.requests[0]["body"]
    assert [p.turn for p in record.branch_points] == [4, 2] and record.fallback is None
    assert len(record.tries) == 1 and record.tries[0].accepted and record.tokens_in > 0
    assert body["response_format"] == {"type": "json_object"} and body["model"] == "reviewer"
    assert body["messages"][0]["role"] == "system" and body["seed"] == 0


def test_an_invalid_answer_is_retried_with_the_problem():
    script = [{"content": json.dumps({"branch_points": [point(6, 7)]})},
              {"content": json.dumps({"branch_points": [point(2, 3)]})}]
    with ScriptedModelServer(script) as server:
        record = review(reviewer(server.base_url), inp(), review_id="r1", round_number=1, reviewed="a1")
        retry = server.requests[1]["body"]["messages"]
    assert [p.turn for p in record.branch_points] == [2] and record.fallback is None
    assert [t.accepted for t in record.tries] == [False, True]
    assert retry[-2]["role"] == "assistant" and "mistake_turn <= 6" in retry[-1]["content"]


def test_http_errors_and_garbage_fall_back_and_say_why():
    script = [{"status": 500, "body": "overloaded"}, {"content": "no idea"}]
    with ScriptedModelServer(script) as server:
        record = review(reviewer(server.base_url, retries=1), inp(n_turns=4, n=1), review_id="r2", round_number=2,
                        reviewed="r1b1")
    assert record.fallback and "2 call(s)" in record.fallback and "no JSON object" in record.fallback
    assert "HTTP 500" in record.tries[0].problems[0] and "overloaded" in record.tries[0].problems[0]
    assert [p.turn for p in record.branch_points] == [2] and record.round == 2 and record.reviewed == "r1b1"


def test_a_reviewer_endpoint_that_refuses_the_call_fails_the_review_at_once():
    good = {"content": json.dumps({"branch_points": [point(2, 3)]})}
    with ScriptedModelServer([good], api_key="not-the-test-key") as server:  # the config sends "k": 401
        with pytest.raises(ReviewerRefused, match=r"answered HTTP 401 for model 'reviewer' \(the key was refused\): "
                                                  r"scripted model: invalid or missing API key"):
            review(reviewer(server.base_url), inp(), review_id="r1", round_number=1, reviewed="a1")
        assert len(server.requests) == 1  # not retried, no fallback
    with ScriptedModelServer([{"status": 403, "body": "model not allowed"}, good]) as server:
        with pytest.raises(ReviewerRefused, match=r"HTTP 403 .*\(access is forbidden\): model not allowed"):
            review(reviewer(server.base_url), inp(), review_id="r1", round_number=1, reviewed="a1")
        assert len(server.remaining) == 1
    with ScriptedModelServer([good]) as server:
        wrong_url = server.base_url.removesuffix("/v1") + "/nope/v1"
        with pytest.raises(ReviewerRefused, match=rf"endpoint {wrong_url} answered HTTP 404 .*no route"):
            review(reviewer(wrong_url), inp(), review_id="r1", round_number=1, reviewed="a1")


def test_a_refusing_reviewer_ends_the_evaluation_with_one_error_line(capsys):
    from sprout.console import run_cli
    from sprout.method.search import run_method
    from tests.method.test_search import Fake
    from tests.method.test_search import config as method_config

    with ScriptedModelServer([{"status": 404, "body": "no model 'reviewer'"}]) as server:

        class Reviewed(Fake):
            def review(self, review_id, round_number, target, n, attempts):
                self.reviewed.append(target.id)
                return review(reviewer(server.base_url), inp(n=n), review_id=review_id, round_number=round_number,
                              reviewed=target.id)

        fake = Reviewed()
        with pytest.raises(SystemExit) as exited:
            run_cli(lambda argv: run_method(method_config(), fake) and 0, [])
    assert exited.value.code == 1 and fake.reviewed == ["a1"]
    assert [plan.id for plan in fake.plans] == ["a1"]  # no branch was started from fallback points
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the reviewer endpoint http://127.0.0.1:")
    assert "answered HTTP 404 for model 'reviewer' (no such URL or model): no model 'reviewer'" in lines[0]


# ---------------------------------------------------------------- what the RL search adds: repairs, deadlines


def test_the_review_asks_again_then_falls_back_and_repairs_only_the_chosen_turns(tmp_path):
    journal = write_journal(tmp_path / "root.jsonl", 5)
    script = [{"content": json.dumps({"branch_points": [point(5, 5)]})},  # the last turn cannot be a point
              {"content": "no json at all"},  # asked again once, still unusable: the fallback rule
              {"content": json.dumps({"repairs": [{"turn": 3, "candidates": [
                  {"reasoning": "Fix the sign.", "command": "sed -i s/-/+/ calc.py", "extra": "ignored"}]},
                  {"turn": 9, "candidates": [{"reasoning": "x", "command": "y"}]}]})}]
    task = ReviewInput(instruction="fix add()", steps=history(journal), verifier_output="1 failed", reward=0.0,
                       points=1, candidates=2, first_turn=1, max_calls=10)
    with ScriptedModelServer(script) as server:
        record = review(reviewer(server.base_url, retries=1, max_output_tokens=64, reasoning_effort="low"), task,
                        review_id="round-1-x", round_number=1, reviewed=str(journal))
        bodies = [r["body"] for r in server.requests if r["path"].endswith("/chat/completions")]
    assert [p.turn for p in record.branch_points] == [3] and record.fallback  # evenly spaced over valid turns 1-4
    assert record.tries[0].problems == ["branch_points[1]: needs turn < mistake_turn <= 5 (got turn 5, mistake_turn 5)",
                                        "no usable branch point"]
    assert [(r.reasoning, r.command) for r in record.branch_points[0].repairs] == [
        ("Fix the sign.", "sed -i s/-/+/ calc.py")]
    assert [t.purpose for t in record.tries] == ["points", "points", "repairs"]
    assert all(b["max_tokens"] == 64 and b["reasoning_effort"] == "low" for b in bodies)
    assert all(b["response_format"] == {"type": "json_object"} for b in bodies)
    assert "1 failed" in bodies[0]["messages"][1]["content"] and "Valid K: 1 to 4" in bodies[0]["messages"][1]["content"]
    assert len(bodies[-1]["messages"]) == 6  # one conversation: each question after the answers before it
    assert "For each turn K of 3, write 2" in bodies[-1]["messages"][-1]["content"]


def test_a_review_past_its_deadline_makes_no_call_and_uses_the_fallback(tmp_path):
    journal = write_journal(tmp_path / "root.jsonl", 4)
    task = ReviewInput(instruction="x", steps=history(journal), verifier_output="", reward=0.0, points=2,
                       candidates=1, first_turn=1, max_calls=10)
    with ScriptedModelServer([{"content": "never asked"}]) as server:
        record = reviewer(server.base_url).review(task, review_id="r", round_number=1, reviewed="j", deadline=0.0)
        assert [r for r in server.requests if r["path"].endswith("/chat/completions")] == []
    assert [p.turn for p in record.branch_points] == [2, 3] and all(p.repairs == [] for p in record.branch_points)
    assert record.tries[0].problems == ["no time left for the call"]


def test_a_reviewer_busy_past_the_deadline_is_not_called(tmp_path):
    import time

    journal = write_journal(tmp_path / "root.jsonl", 3)
    task = ReviewInput(instruction="x", steps=history(journal), verifier_output="", reward=0.0, points=1,
                       first_turn=1, max_calls=10)
    with ScriptedModelServer([{"content": "never asked"}]) as server:
        busy = reviewer(server.base_url, max_concurrent_requests=1)
        busy.calls.acquire()  # another group's call holds the only place
        started = time.monotonic()
        record = busy.review(task, review_id="r", round_number=1, reviewed="j", deadline=time.time() + 3)
        assert time.monotonic() - started < 4  # it gave up at the deadline (3 s), not after the call's timeout
        assert [r for r in server.requests if r["path"].endswith("/chat/completions")] == []
    assert record.tries[0].problems == ["no time left for the call"] and record.fallback


def test_odd_reviewer_answers_keep_what_is_usable():
    from sprout.method.review import _repairs

    task = inp(n_turns=4, n=1)
    points, problems = check_points(ReviewAnswer.model_validate(
        {"branch_points": [dict(point(2, 3), colour="extra keys are ignored")]}), task)
    assert [p.turn for p in points] == [2] and problems == []
    with pytest.raises(ValueError, match="not a boolean"):  # JSON's true is no turn number
        ReviewAnswer.model_validate({"branch_points": [dict(point(2, 3), turn=True)]})
    answer = {"repairs": [{"turn": 2, "candidates": [{"reasoning": "", "command": "ls"}, "not an object",
                                                     {"reasoning": "Fix the sign.", "command": "sed -i s/-/+/ c.py"}]}]}
    repairs = _repairs(json.dumps(answer), points, 2)
    assert [r.reasoning for r in repairs[2]] == ["Fix the sign."]  # one bad candidate spoils nothing else
    with pytest.raises(ValueError, match="no usable repairs"):
        _repairs(json.dumps({"repairs": [{"turn": 2, "candidates": [{"reasoning": " "}]}]}), points, 1)


# ---------------------------------------------------------------- one request, whichever path asks


def test_an_evaluation_and_the_rl_search_send_the_same_review_request(tmp_path):
    """A failed trajectory (a first attempt, then a branch of its turn 2 with a note) reviewed by an
    evaluation's executor and by the RL search: the same input, the same request, byte for byte."""
    from types import SimpleNamespace

    from sprout.eval.executor import TaskExecutor
    from sprout.jobs.local import LocalJobs
    from sprout.method.records import AttemptRecord
    from sprout.rl_driver.search import ReviewAsk, review_input
    from sprout.tasks import GradeResult

    root = write_journal(tmp_path / "attempts" / "a1.jsonl", 3)
    branch = write_journal(tmp_path / "attempts" / "r1b1.jsonl", 2, first=3,
                           parent=ParentRef(journal=str(root), turn=2, checkpoint="ck-2", note="Check the sign."))
    output = "FAILED test_add: assert add(1, 2) == 3\n"
    (tmp_path / "verifier" / "r1b1").mkdir(parents=True)
    (tmp_path / "verifier" / "r1b1" / "test-stdout.txt").write_text(output)
    (tmp_path / "attempts" / "grade.json").write_text(GradeResult(  # the RL sample's grade, beside its journal
        reward=0.0, rewards={"reward": 0.0}, verdict="fail", verifier_output=output, error=None,
        duration_s=1.0).model_dump_json())
    done = {"status": "submitted", "exit_status": "Submitted", "tokens_in": 1, "tokens_out": 1, "wall_s": 1.0,
            "reward": 0.0, "verdict": "fail", "step_limit": 10, "token_limit": 100}
    first = AttemptRecord(id="a1", kind="first", journal="attempts/a1.jsonl", first_turn=1, turns=3,
                          final_checkpoint="ck-3", started=datetime.now(UTC), **done)
    target = AttemptRecord(id="r1b1", kind="branch", round=1, parent="a1", from_turn=2, note="Check the sign.",
                           journal="attempts/r1b1.jsonl", first_turn=3, turns=2, final_checkpoint="ck-4",
                           verifier_output="verifier/r1b1/test-stdout.txt", started=first.started, **done)
    task = SimpleNamespace(instruction="fix add()", config=SimpleNamespace(environment=SimpleNamespace(workdir="/")))
    image = SimpleNamespace(reference="img", image=SimpleNamespace(config=SimpleNamespace(workdir="/")))
    answer = {"content": json.dumps({"branch_points": [point(2, 3)]})}
    with ScriptedModelServer([answer, answer]) as server:
        asks = reviewer(server.base_url)
        evaluation = TaskExecutor(store=None, jobs=LocalJobs(None, task, hold_slots=False), task=task, image=image,
                                  agent=None, reviewer=asks, out=tmp_path, log=lambda _text: None)
        evaluation.review("r1", 1, target, 2, [first, target])
        request = SimpleNamespace(prompt=[{"role": "user", "content": "fix add()"}], max_turns=10)
        search = review_input(request, ReviewAsk({"metadata": {"journal": str(branch)}}, points=2, candidates=0,
                                                 first_turn=0, deadline=float("inf")))
        assert search == evaluation.review_input(target, 2, [first, target])
        asks.review(search, review_id="round-1-x", round_number=1, reviewed=str(branch))
        bodies = [r["body"] for r in server.requests if r["path"].endswith("/chat/completions")]
    assert len(bodies) == 2 and json.dumps(bodies[0]) == json.dumps(bodies[1])
    assert "[before turn 3 the agent was told: Check the sign.]" in bodies[0]["messages"][1]["content"]
    # the search's own first round starts at turn 1 (it branches from checkpoints): only that line differs
    round_one = review_input(request, ReviewAsk({"metadata": {"journal": str(branch)}}, points=2, candidates=0,
                                                first_turn=1, deadline=float("inf")))
    lines = [request_messages(x, asks.config)[1]["content"].splitlines() for x in (search, round_one)]
    assert [(a, b) for a, b in zip(*lines, strict=True) if a != b] == [
        (next(x for x in lines[0] if "Valid K" in x), next(x for x in lines[1] if "Valid K" in x))]
