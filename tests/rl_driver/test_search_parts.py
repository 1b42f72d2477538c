"""The search's parts without sandboxes: the leak gate's terms, merged repairs, and the provenance of an
exported repair branch (its reviewer, the one SPROUT reviewer, is tested in tests/method/test_review.py)."""

import json
from pathlib import Path

import pytest

from sprout.agent.journal import Header, JournalWriter, Limits, Outcome, ParentRef, Turn
from sprout.agent.runner import InsertedTurn
from sprout.method.records import Repair
from sprout.rl_driver.export import export_messages, journal_messages, restored_messages
from sprout.rl_driver.leaks import hidden_terms, leak_terms, message_text
from sprout.rl_driver.outcome import annotate, root_counts
from sprout.rl_driver.protocol import HINT_CLOSE, HINT_OPEN
from sprout.rl_driver.search import merge

pytestmark = pytest.mark.python_only


def test_hidden_terms_follow_the_contracts_length_and_generic_rules():
    terms = hidden_terms(["tests/test_hidden.py", "tests/conftest.py", "a/b.py", "t.py"],
                         ["tests/test_hidden.py::TestParser::test_parse_empty_input[3]", "test_x", "x::12345678"])
    assert terms == ["TestParser", "a/b.py", "test_hidden", "test_hidden.py", "test_parse_empty_input",
                     "tests/conftest.py", "tests/test_hidden.py",
                     "tests/test_hidden.py::TestParser::test_parse_empty_input[3]", "x::12345678"]
    # not terms: generic or short basenames (conftest.py, b.py), short paths (t.py), short names (test_x),
    # numeric parts (12345678)
    turn = "Run tests/test_hidden.py and look at test_parse_empty_input."
    assert leak_terms(turn, "history", terms) == [
        "test_hidden", "test_hidden.py", "test_parse_empty_input", "tests/test_hidden.py"]
    assert leak_terms(turn, "the agent saw test_parse_empty_input fail in test_hidden.py", terms) == [
        "tests/test_hidden.py"]  # what the history showed is no leak


def test_identical_repairs_merge_with_their_multiplicity():
    a, b = Repair(reasoning="Fix it.", command="sed -i s/-/+/ calc.py"), Repair(reasoning="Look.", command="ls")
    merged = merge([a, b, Repair(reasoning=" Fix it. ", command="sed -i s/-/+/ calc.py "), a])
    assert [(r.command, n) for r, n in merged] == [("sed -i s/-/+/ calc.py", 3), ("ls", 1)]


def test_root_counts_and_annotation_count_a_missing_grade_as_ungraded():
    def root(reward: float, zero: str | None) -> dict:
        return {"reward": reward, "metadata": {"zero_reason": zero, "search": {"kind": "root"}}}

    roots = [root(1.0, None), root(0.0, "grade_failed"), None]
    counts = root_counts(3, roots)
    assert counts == {"planned": 3, "graded": 1, "resolved": 1}
    annotate([roots[0]], counts)
    assert roots[0]["metadata"]["search"] == {"kind": "root", "outcome": "TT_partial", "root_counts": counts}


def write_journal(path: Path, turns: int, *, parent: ParentRef | None = None, messages: list | None = None,
                  first: int = 1, new: list | None = None) -> Path:
    writer = JournalWriter(path)
    writer.write(Header(task="fix add()", model="m", model_class="tools", endpoint_host="h", image="i",
                        image_key="k", cwd="/app", limits=Limits(step_limit=10, token_limit=0, wall_time_s=60,
                                                                 command_timeout_s=10),
                        store="/s", sandbox="sb", parent=parent, first_turn=first, n_calls=first - 1,
                        messages=messages or [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix"}]))
    for n in range(first, first + turns):
        writer.write(Turn(turn=n, checkpoint=f"ck-{n}", thought=f"thought {n}", commands=[f"echo step-{n}"],
                          observation=f"step-{n}", exit_code=0, tokens_in=1, tokens_out=1, model_latency_s=0,
                          command_s=0, checkpoint_ms=1, n_calls=n,
                          new_messages=(new or [])[n - first] if new else []))
    writer.write(Outcome(status="submitted", exit_status="Submitted", turns=turns, tokens_in=0, tokens_out=0,
                         wall_s=1, final_checkpoint=f"ck-{first + turns - 1}"))
    writer.close()
    return path


def test_a_repair_branch_exports_its_prefix_and_inserted_turns(tmp_path):
    root = write_journal(tmp_path / "root.jsonl", 3)
    hint = {"role": "user", "content": f"{HINT_OPEN}Carry on.{HINT_CLOSE}"}
    restored = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix"},
                {"role": "assistant", "content": "a", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
                {"role": "tool", "content": "o", "tool_call_id": "c1"}, hint]
    inserted = InsertedTurn(reasoning="The sum subtracts.", command="sed -i s/-/+/ calc.py", call_id="repair-1-1")
    message = inserted.message()
    policy = {"role": "assistant", "content": "done", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]}
    new = [[message, {"role": "tool", "content": "ok", "tool_call_id": "repair-1-1"}],
           [policy, {"role": "tool", "content": "ok", "tool_call_id": "c2"}]]
    branch = write_journal(tmp_path / "branch.jsonl", 2, first=2, messages=restored, new=new,
                           parent=ParentRef(journal=str(root), turn=1, checkpoint="ck-1", note=hint["content"]))
    from sprout.agent.journal import read_journal

    loaded = read_journal(branch)
    assert restored_messages(loaded) == 4  # the hint came after the restored history
    exported = export_messages(journal_messages(loaded), prefix=restored_messages(loaded))
    assert [m["role"] for m in exported.messages] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                      "assistant", "tool"]  # the hint-only message went
    assert (exported.prefix_messages, exported.inserted_messages) == (4, [4])
    turn = exported.messages[4]
    assert turn == {"role": "assistant", "content": "", "reasoning_content": "The sum subtracts.", "tool_calls": [
        {"id": "repair-1-1", "type": "function",
         "function": {"name": "bash", "arguments": json.dumps({"command": "sed -i s/-/+/ calc.py"})}}]}


def test_the_leak_gate_does_not_count_an_earlier_repair_as_shown():
    from sprout.rl_driver.search import policy_messages

    earlier = InsertedTurn(reasoning="Run tests/test_hidden.py.", command="pytest tests/test_hidden.py",
                           call_id="repair-1-1").message()
    history = [{"role": "user", "content": "fix"}, earlier,
               {"role": "tool", "content": "tests/test_hidden.py: 1 failed", "tool_call_id": "repair-1-1"},
               {"role": "assistant", "content": "ok", "tool_calls": [
                   {"id": "c9", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
               {"role": "tool", "content": "done", "tool_call_id": "c9"}]
    kept = policy_messages(history)
    assert [m["content"] for m in kept] == ["fix", "ok", "done"]
    terms = hidden_terms(["tests/test_hidden.py"], [])
    assert leak_terms("pytest tests/test_hidden.py", message_text(kept), terms) == [
        "test_hidden.py", "tests/test_hidden.py"]


def test_a_branch_whose_restored_history_is_cut_is_not_exported():
    from sprout.rl_driver.export import ExportError

    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    restored = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a", "tool_calls": [call]},
                {"role": "user", "content": "format error: the call was never run"}]
    own = [{"role": "assistant", "content": "b", "tool_calls": [dict(call, id="c2")]},
           {"role": "tool", "content": "o", "tool_call_id": "c2"}]
    with pytest.raises(ExportError, match="restored history"):
        export_messages(restored + own, prefix=len(restored))
