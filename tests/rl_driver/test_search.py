"""The search (GSML) end to end: a real driver, the scripted model as the policy and as the reviewer, real
sandboxes branched from checkpoints and graded by the task's verifier. Each group is checked by a recount
written here from the contract, as Miles recounts before it credits anything."""

import json
import os
import signal
import subprocess
import sys

import pytest

from sprout.report.view import Runs
from sprout.report.viewer import write_static
from sprout.sandbox import Store
from sprout.testing.browser import Browser
from sprout.testing.scripted_model import ScriptedModelServer
from tests.conftest import REPO, RUNTIME_BIN, free_port
from tests.rl_driver.test_driver import (
    HINTS,
    POLICY_KEY,
    SUBMIT,
    DriverProcess,
    MilesShapedClient,
    endpoint_of,
    group_request,
    wait_for,
    write_config,
)
from tests.services.test_services import services

FIX = "sed -i 's/return a - b/return a + b/' /app/calc.py && echo repair-ran"
LOOK = "echo repair-ran"
CONTINUE = "Carry on from here."  # the continuation prompt (a training hint)
LEAKY = "The hidden tests/test_calc.py decides; make add() pass it."


def root_script(name: str, n: int = 1) -> list[dict]:
    """A root that runs `echo <name>-one`, `echo <name>-two`, then submits without fixing anything."""
    return ([{"thought": "start", "command": f"echo {name}-one", "match": "Fix it so that"}] * n
            + [{"thought": "next", "command": f"echo {name}-two", "match": f"{name}-one"}] * n
            + [{"thought": "done", "command": SUBMIT, "match": f"{name}-two"}] * n)


def branch_submits(n: int) -> list[dict]:
    """Branches submit at once: after the continuation prompt (students) or the repair's output (repairs)."""
    return [{"thought": "submit", "command": SUBMIT, "match": f"{CONTINUE}|repair-ran"}] * n


def reviewer_script(name: str, turn: int, repairs: list[tuple[str, str]] | None, round_two: bool = False) -> list:
    """The review of the rollout whose history shows `<name>-one`: the point `turn`, then the repairs."""
    point = {"turn": turn, "mistake_turn": turn + 1, "mistake": f"{name}: the agent never changed calc.py.",
             "reason": "before it gave up", "note": "look at calc.py"}
    steps = [{"content": json.dumps({"branch_points": [point]}), "match": "Choose up to",
              "conversation": f"(?s){name}-one.*repair-ran" if round_two else f"{name}-one"}]
    if repairs is not None:
        candidates = [{"reasoning": reasoning, "command": command} for reasoning, command in repairs]
        steps.append({"content": json.dumps({"repairs": [{"turn": turn, "candidates": candidates}]}),
                      "match": "next turn", "conversation": f"(?s){name}-one.*repair-ran" if round_two else f"{name}-one"})
    return steps


def search(**values) -> dict:
    spec = {"roots": 2, "points": 1, "candidates": 0, "student_continuations": 1, "candidate_continuations": 0,
            "tf_student_continuations": 0, "repair_rounds": 1, "review_seconds": 60.0, "wall_time_seconds": 120.0}
    return spec | values


def branches(spec: dict) -> int:
    """The contract's formula, written out again."""
    every_root_failed = spec["roots"] * (spec["student_continuations"] + spec["candidates"]
                                         * spec["candidate_continuations"] * spec["repair_rounds"])
    return spec["points"] * max(every_root_failed, (spec["roots"] - 1) * spec["tf_student_continuations"])


def outcome_of(planned: int, graded: int, resolved: int) -> str:
    """The contract's table, written out again."""
    if graded == 0:
        return "ungraded"
    if resolved == graded:
        return "TT" if graded == planned else "TT_partial"
    if resolved >= 1:
        return "TF"
    return "FF" if graded == planned else "FF_partial"


def recount(result: dict, request: dict) -> str:
    """What Miles checks of a search group before crediting it; returns the outcome."""
    spec = request["search"]
    slots = [s["sample_slot_id"] for s in request["sample_slots"]]
    roots = [t for t in result["trajectories"] if t["metadata"]["search"]["kind"] == "root"]
    returned = {t["sample_slot_id"] for t in result["trajectories"]}
    failed = {f["sample_slot_id"] for f in result["failed_samples"]}
    assert not returned & failed
    assert all(slot in returned | failed for slot in slots[:spec["roots"]])  # every root returned or failed
    assert {t["sample_slot_id"] for t in roots} == returned & set(slots[:spec["roots"]])  # roots on root slots
    graded = [t for t in roots if t["metadata"]["zero_reason"] is None]
    counts = {"planned": spec["roots"], "graded": len(graded), "resolved": sum(t["reward"] == 1 for t in graded)}
    outcome = outcome_of(**counts)
    root_ids = {t["branch_id"] for t in roots}
    for t in result["trajectories"]:
        meta, labels = t["metadata"], t["metadata"]["search"]
        assert (labels["outcome"], labels["root_counts"]) == (outcome, counts)
        kind = labels["kind"]
        expected = {"root": "root", "student": f"student:{labels.get('point_id')}",
                    "repair": f"repair:{labels.get('point_id')}:{labels.get('candidate')}"}[kind]
        assert t["group"] == expected
        assert (t["parent_branch_id"] is None) == (kind == "root")
        assert kind == "root" or t["parent_branch_id"] in root_ids
        if meta["zero_reason"] is None:
            assert t["reward"] in (0, 1)
        provenance = meta["provenance"]
        assert 0 <= provenance["prefix_messages"] <= len(t["messages"])
        assert all(t["messages"][i]["role"] == "assistant" for i in provenance["inserted_messages"])
        assert (provenance["prefix_messages"] == 0) == (kind == "root")
        for message in t["messages"]:
            if message["role"] in ("user", "system"):
                assert not any(tag in message["content"] for tag in HINTS)
    assert result["search_branches"] == len(result["trajectories"]) - len(roots)
    return outcome


def run_search(tasks, tmp_path, policy: list, review: list, spec: dict, env: dict | None = None,
               ) -> tuple[dict, dict, list]:
    """One search group through a fresh driver whose reviewer is the scripted `review` (its samples run
    as Run Store jobs with `env` naming one); the result, the request and the reviewer's requests."""
    key = None if env else POLICY_KEY  # workers call a URL a job names with no key
    with ScriptedModelServer(policy, api_key=key) as model, ScriptedModelServer(review) as reviewer:
        config = write_config(tmp_path / "driver.json", tasks[0], miles={
            "api_key_env": "SPROUT_MODEL_API_KEY",
            "review": {"endpoint": reviewer.base_url, "model": "reviewer", "continuation_prompt": CONTINUE}})
        driver = DriverProcess(config, free_port(), env=env).start()
        try:
            n = spec["roots"] + branches(spec)
            request = group_request(tasks[1], endpoint_of(model), n, minimum_returned_samples=1, search=spec,
                                    budgets={"max_wall_time_seconds": 120.0}, finalization_timeout_seconds=60.0)
            result = MilesShapedClient(driver.url).run_group(request)
            reviews = [r for r in reviewer.requests if r["path"].endswith("/chat/completions")]
        finally:
            driver.stop()
    return result, request, reviews


def by_slot(result: dict) -> dict[int, dict]:
    return {int(t["sample_slot_id"].rsplit(":", 1)[1]): t for t in result["trajectories"]}


SEARCH_EXAMPLE = REPO / "src" / "sprout" / "rl_driver" / "search_result.example.json"


def shape(result: dict) -> list:
    """What the shipped search example must share with a real run: the status, the slots, and the multiset
    of (group with the root's branch id left out, reward, provenance, kind, whether it names leak terms):
    which root a slot's sample grew from is the order the roots happened to ask the model in."""
    roots = [t["branch_id"] for t in result["trajectories"] if t["group"] == "root"]

    def generic(group: str) -> str:
        for branch_id in roots:
            group = group.replace(branch_id, "ROOT")
        return group

    return [result["status"], result["actual_samples"], sorted(by_slot(result)), sorted(
        (generic(t["group"]), t["reward"], json.dumps(t["metadata"]["provenance"]), t["metadata"]["search"]["kind"],
         bool(t["metadata"]["search"].get("leak_terms"))) for t in result["trajectories"])]


def test_ff_gives_the_fixture_shape_students_and_repairs_from_checkpoints(tasks, tmp_path):
    """The Miles fixture's FF group: 2 roots, 1 point each, 2 students, 2 candidates x 2 continuations = 14."""
    spec = search(candidates=2, student_continuations=2, candidate_continuations=2, tf_student_continuations=2)
    policy = root_script("alpha") + root_script("beta") + branch_submits(12)
    review = (reviewer_script("alpha", 2, [("The sum is computed with a minus.", FIX), ("Look first.", LOOK)])
              + reviewer_script("beta", 2, [("The sum is computed with a minus.", FIX), (LEAKY, LOOK)]))
    before = {s.id for s in Store().sandboxes()}
    result, request, reviews = run_search(tasks, tmp_path, policy, review, spec)
    assert result["status"] == "completed" and result["actual_samples"] == 14 and result["failed_samples"] == []
    assert recount(result, request) == "FF"
    slots = by_slot(result)
    assert sorted(slots) == list(range(11, 25))
    roots = {slots[11]["branch_id"]: slots[11], slots[12]["branch_id"]: slots[12]}
    for first in (13, 19):  # each root's point: 2 students, candidate 1 twice, candidate 2 twice
        point = slots[first]["metadata"]["search"]["point_id"]
        root = roots[slots[first]["parent_branch_id"]]
        assert point == f"{root['branch_id']}-step2"
        assert [slots[first + i]["group"] for i in range(6)] == [f"student:{point}"] * 2 + [
            f"repair:{point}:1"] * 2 + [f"repair:{point}:2"] * 2
        for i in range(6):
            t = slots[first + i]
            assert t["messages"][:6] == root["messages"][:6]  # the restored history, as the root had it
            inserted = [6] if i >= 2 else []
            assert t["metadata"]["provenance"] == {"prefix_messages": 6, "inserted_messages": inserted}
            assert sum(m["role"] == "assistant" for m in t["messages"]) == 3 + len(inserted)  # one policy call
            assert t["reward"] == (1.0 if i in (2, 3) else 0.0)  # graded for real: only the fix passes
        turn = slots[first + 2]["messages"][6]
        assert (turn["content"], turn["reasoning_content"]) == ("", "The sum is computed with a minus.")
        assert json.loads(turn["tool_calls"][0]["function"]["arguments"]) == {"command": FIX}
        assert "repair-ran" in slots[first + 2]["messages"][7]["content"]  # its real result
    leaky = [t for t in result["trajectories"] if t["metadata"]["search"].get("leak_terms")]
    assert {t["metadata"]["search"]["leak_terms"] == ["test_calc.py", "tests/test_calc.py"] for t in leaky} == {True}
    assert len(leaky) == 2 and all(t["messages"][6]["reasoning_content"] == LEAKY for t in leaky)
    assert all(t["metadata"]["search"]["leak_terms"] == [] for t in result["trajectories"]
               if t["metadata"]["search"]["kind"] == "repair" and t not in leaky)
    assert all(t["metadata"]["touched_test_paths"] == [] for t in result["trajectories"])
    assert len(reviews) == 4  # per root: the points, then the repairs
    assert {s.id for s in Store().sandboxes()} <= before
    if os.environ.get("SPROUT_WRITE_EXAMPLES"):  # how the shipped example is made: from this real run
        SEARCH_EXAMPLE.write_text(json.dumps(result, indent=2) + "\n")
    assert shape(json.loads(SEARCH_EXAMPLE.read_text())) == shape(result)  # the example is what a run gives
    assert_the_viewer_draws_the_search_tree(tmp_path, slots)


def assert_the_viewer_draws_the_search_tree(tmp_path, slots: dict[int, dict]) -> None:
    """`sprout view` over the driver's data directory: the group's tree from its slots' journals and grades
    (kinds, where each branch came from, inserted turns, rewards, the outcome), on the page too."""
    tree = Runs([tmp_path / "data"]).group(0)
    assert tree.outcome == "FF" and len(tree.reviews) == 2 and tree.problems == []
    assert (tree.status, tree.reason) == ("completed", None)
    seen = {int(s.slot.removeprefix("slot-")): s for s in tree.slots}
    assert sorted(seen) == sorted(slots)
    for index, slot in seen.items():
        kind = slots[index]["metadata"]["search"]["kind"]
        assert (slot.kind, slot.reward) == (kind, slots[index]["reward"])
        assert slot.inserted_turns == ([3] if kind == "repair" else [])
        assert slot.label == slots[index]["group"]
        assert slot.leak_terms == slots[index]["metadata"]["search"].get("leak_terms")
        assert (slot.parent, slot.from_turn) == ((None, None) if kind == "root" else (
            next(f"slot-{i}" for i, t in slots.items() if t["branch_id"] == slots[index]["parent_branch_id"]), 2))
    page = tmp_path / "group.html"
    write_static(Runs([tmp_path / "data"]), page)
    with Browser() as browser:
        browser.goto(f"file://{page}#/g/0")
        browser.wait_for("document.body.dataset.ready === '#/g/0'")
        assert browser.evaluate("document.querySelectorAll('[data-slot]').length") == 14
        assert browser.evaluate("document.querySelectorAll('.node.repair').length") == 8
        leaks = browser.evaluate("[...document.querySelectorAll('.leak')].map(n => n.textContent)")
        assert leaks == ["leak terms: test_calc.py, tests/test_calc.py"] * 2
        assert browser.evaluate("document.querySelector('main p').textContent").startswith("completed · outcome FF · 2 roots")
        repair = next(s.slot for s in tree.slots if s.kind == "repair")
        browser.goto(f"file://{page}#/g/0/s/{repair}")
        browser.wait_for(f"document.body.dataset.ready === '#/g/0/s/{repair}'")
        assert "(inserted by the reviewer)" in browser.evaluate("document.querySelector('#turn-3 h3').textContent")


def test_tf_and_ff_partial_branch_students_from_the_failed_roots_only(tasks, tmp_path):
    tf_spec = search(points=2, tf_student_continuations=2)  # 6 slots; the review picks one point: 2 stay unused
    fixing_root = [{"thought": "fix", "command": "sed -i 's/return a - b/return a + b/' /app/calc.py",
                    "match": "Fix it so that"}]
    after_fix = [{"thought": "done", "command": SUBMIT, "match": "returncode"}]  # last: the other steps come first
    policy = fixing_root + root_script("gamma") + branch_submits(2) + after_fix
    result, request, reviews = run_search(tasks, tmp_path, policy, reviewer_script("gamma", 1, None), tf_spec)
    assert recount(result, request) == "TF" and result["status"] == "completed"
    assert (result["max_samples"], result["actual_samples"], result["failed_samples"]) == (6, 4, [])
    students = [t for t in result["trajectories"] if t["metadata"]["search"]["kind"] == "student"]
    failed_root = next(t for t in result["trajectories"] if t["group"] == "root" and t["reward"] == 0)
    assert len(students) == 2 and {t["parent_branch_id"] for t in students} == {failed_root["branch_id"]}
    assert len(reviews) == 1  # the points: no repairs asked outside FF
    refusal = {"status": 400, "body": "the policy refused", "match": "Fix it so that"}
    (tmp_path / "partial").mkdir()
    result, request, _ = run_search(tasks, tmp_path / "partial", [refusal] + root_script("delta") + branch_submits(2),
                                    reviewer_script("delta", 1, None), tf_spec)
    assert recount(result, request) == "FF_partial" and result["status"] == "early_stopped"
    assert len(result["failed_samples"]) == 1 and result["actual_samples"] == 3


@pytest.fixture
def runstore(tmp_path):
    """A Run Store and one worker (2 slots); the variables that point a driver at them."""
    cfg = tmp_path / "cfg"
    assert services(cfg, "init", "--port", str(free_port()), "--slots", "2").returncode == 0
    up = services(cfg, "up", "runstore-api")
    worker = None
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        exports = dict(item.split("=", 1) for item in services(cfg, "env").stdout.split()[1:])
        worker = subprocess.Popen(
            [sys.executable, "-m", "sprout.worker", "serve", "--url", exports["SPROUT_RUNSTORE_URL"],
             "--token-file", str(cfg / "secrets" / "worker.token"), "--slots", "2"],
            cwd=REPO, env={**os.environ, "SPROUT_RUNTIME_BIN": str(RUNTIME_BIN),
                           "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        yield exports
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
        services(cfg, "down")


@pytest.mark.parametrize("where", ["local", "runstore"])
def test_a_second_round_inserts_a_turn_later_in_the_failed_repair(tasks, tmp_path, where, request):
    spec = search(roots=1, candidates=1, candidate_continuations=1, repair_rounds=2)
    policy = root_script("eps") + branch_submits(3)
    review = (reviewer_script("eps", 2, [("Look around first.", LOOK)])
              + reviewer_script("eps", 3, [("Now the sum: it subtracts.", FIX)], round_two=True))
    env = request.getfixturevalue("runstore") if where == "runstore" else None
    result, request, reviews = run_search(tasks, tmp_path, policy, review, spec, env)
    assert recount(result, request) == "FF" and result["status"] == "completed"
    slots = by_slot(result)
    assert [slots[i]["group"] for i in sorted(slots)] == ["root"] + [
        f"student:{slots[12]['metadata']['search']['point_id']}"] + [
        f"repair:{slots[12]['metadata']['search']['point_id']}:{n}" for n in (1, 2)]
    first, second = slots[13], slots[14]
    assert first["reward"] == 0 and second["reward"] == 1
    assert second["metadata"]["search"]["round"] == 2 and second["metadata"]["search"]["step"] == 3
    assert second["metadata"]["search"]["parent_job_id"] == first["branch_id"]
    assert second["parent_branch_id"] == slots[11]["branch_id"]
    assert second["metadata"]["provenance"] == {"prefix_messages": 8, "inserted_messages": [6, 8]}
    assert second["messages"][:8] == first["messages"][:8]
    assert len(reviews) == 4  # each round: the points, then the repairs
    assert all(bool(t["metadata"]["job_id"]) == (where == "runstore") for t in result["trajectories"])


def test_a_driver_killed_mid_search_runs_the_same_search_after_a_restart(tasks, tmp_path):
    """Killed while round 1's branches run: the restarted driver reads the stored review back (the reviewer
    is not asked again), reruns the unfinished branches in the same slots and goes on to round 2."""
    spec = search(roots=1, candidates=1, candidate_continuations=1, repair_rounds=2)
    policy = root_script("zeta") + branch_submits(6)  # spares for the branches the kill cut short
    review = (reviewer_script("zeta", 2, [("Look around first.", LOOK)])
              + reviewer_script("zeta", 3, [("Now the sum: it subtracts.", FIX)], round_two=True))
    before = {s.id for s in Store().sandboxes()}
    checkpoints = {c.id for c in Store().checkpoints()}
    with ScriptedModelServer(policy, api_key=POLICY_KEY, delay_s=1.0) as model, ScriptedModelServer(review) as reviewer:
        config = write_config(tmp_path / "driver.json", tasks[0], miles={
            "api_key_env": "SPROUT_MODEL_API_KEY",
            "review": {"endpoint": reviewer.base_url, "model": "reviewer", "continuation_prompt": CONTINUE}})
        port = free_port()
        driver = DriverProcess(config, port).start()
        try:
            request = group_request(tasks[1], endpoint_of(model), 4, minimum_returned_samples=1, search=spec,
                                    budgets={"max_wall_time_seconds": 120.0}, finalization_timeout_seconds=60.0)
            client = MilesShapedClient(driver.url)
            client.call("POST", "/rollout-groups", json=request)
            wait_for(lambda: len(model.requests) >= 4, 90, "round 1's branches to call the policy")
            assert len(reviewer.requests) == 2  # round 1's review is done and stored
            driver.stop(signal.SIGKILL)
            driver = DriverProcess(config, port).start()
            result = client.run_group(request, post=False)
            reviews = [r for r in reviewer.requests if r["path"].endswith("/chat/completions")]
        finally:
            driver.stop()
    assert recount(result, request) == "FF" and result["status"] == "completed"
    assert len(reviews) == 4  # round 1's review read back, round 2's asked once
    slots = by_slot(result)
    point = slots[12]["metadata"]["search"]["point_id"]
    assert [slots[i]["group"] for i in sorted(slots)] == ["root", f"student:{point}", f"repair:{point}:1",
                                                          f"repair:{point}:2"]
    assert slots[14]["reward"] == 1 and slots[14]["metadata"]["provenance"]["inserted_messages"] == [6, 8]
    assert {s.id for s in Store().sandboxes()} <= before
    # none left: the killed driver's unfinished branches (a snapshot it made but never journaled included) were
    # reaped by the restarted one, the rest released by the DELETE
    assert {c.id for c in Store().checkpoints()} <= checkpoints
