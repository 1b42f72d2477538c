"""The export of a rollout into the messages Miles trains on, checked on messages built the way a rollout
builds them (the agent's model class on a server's response, mini-swe-agent's own observation and
format-error helpers), and on messages as journals written through LiteLLM hold them."""

import copy
import json

import pytest
from minisweagent.exceptions import FormatError
from minisweagent.models.utils.actions_text import format_observation_messages
from minisweagent.models.utils.actions_toolcall import (
    BASH_TOOL,
    format_toolcall_observation_messages,
    parse_toolcall_actions,
)
from minisweagent.models.utils.openai_multimodal import DEFAULT_MULTIMODAL_REGEX

from sprout.agent.journal import Header, Journal, Limits, Outcome, ParentRef, Turn
from sprout.rl_driver.export import (
    SUBMITTED_ANSWER,
    TOOLS_BY_MODEL_CLASS,
    ExportError,
    export_messages,
    journal_messages,
    tool_call_count,
)
from sprout.rl_driver.protocol import HINT_CLOSE, HINT_OPEN, strip_hints

pytestmark = pytest.mark.python_only

TEMPLATE = ("{% if output.exception_info %}<exception>{{output.exception_info}}</exception>\n{% endif %}"
            "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output}}</output>")  # mini-swe-agent's default
KEYS = {"system": {"role", "content"}, "user": {"role", "content"},
        "tool": {"role", "content", "tool_call_id"},
        "assistant": {"role", "content", "tool_calls", "reasoning_content"}}


def assert_miles_accepts(messages: list[dict]) -> None:
    """The message rules of Miles's importer (rl-driver-contract §3), checked independently of the export."""
    assert messages and any(m["role"] == "assistant" for m in messages)
    pending: list[str] = []
    seen: set[str] = set()
    for m in messages:
        role = m["role"]
        assert role in KEYS and set(m) <= KEYS[role], m
        assert m["content"] is None or isinstance(m["content"], str), m
        assert "reasoning_content" not in m or isinstance(m["reasoning_content"], str)
        if role in ("user", "system"):
            assert HINT_OPEN not in m["content"] and HINT_CLOSE not in m["content"], m
        if role == "assistant" and "tool_calls" in m:
            assert m["tool_calls"], "an empty tool_calls list"
            for call in m["tool_calls"]:
                assert set(call) == {"id", "type", "function"} and call["type"] == "function"
                assert set(call["function"]) == {"name", "arguments"}
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
                assert isinstance(call["id"], str) and call["id"] and call["id"] not in seen, call
                seen.add(call["id"])
                pending.append(call["id"])
        if role == "tool":
            assert m["tool_call_id"] in pending, m
            pending.remove(m["tool_call_id"])
    assert not pending, f"unanswered calls {pending}"


def export(messages: list[dict], **kwargs):
    before = copy.deepcopy(messages)
    result = export_messages(messages, **kwargs)
    assert messages == before, "the export changed its input"
    assert_miles_accepts(result.messages)
    assert result.tool_calls == tool_call_count(result.messages)
    assert result.model_calls == sum(m["role"] == "assistant" for m in result.messages)
    return result


def system(content: str = "You are a helpful assistant.") -> dict:
    return {"role": "system", "content": content}


def user(content: str = "Fix the bug in add().") -> dict:
    return {"role": "user", "content": content}


def assistant(content: str | None, *calls: tuple[str, str], **fields) -> dict:
    """A server's message with these tool calls, plus the `extra` the agent's model class adds to it."""
    tool_calls = [{"id": i, "type": "function",
                   "function": {"name": "bash", "arguments": json.dumps({"command": c})}} for i, c in calls]
    message = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if calls else {}), **fields}
    return {**message, "extra": {"actions": [{"command": c, "tool_call_id": i} for i, c in calls],
                                 "response": {"choices": [{"index": 0, "message": message}]}, "cost": 0.0,
                                 "timestamp": 1.0}}


def observations(message: dict, *outputs: str, **kwargs) -> list[dict]:
    """The tool messages mini-swe-agent writes for an assistant message's actions (unrun ones padded)."""
    return format_toolcall_observation_messages(
        actions=message["extra"]["actions"], observation_template=TEMPLATE,
        outputs=[{"output": o, "returncode": 0, "exception_info": ""} for o in outputs], **kwargs)


def exit_message(status: str, submission: str = "") -> dict:
    return {"role": "exit", "content": submission or status,
            "extra": {"exit_status": status, "submission": submission}}


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["id"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


def test_a_tool_call_rollout_exports_only_api_roles_and_keys() -> None:
    first = assistant("Look first.", ("call_a", "ls"), reasoning_content="I should look around.")
    first |= {"thinking_blocks": [{"type": "thinking", "thinking": "x"}], "annotations": [], "audio": None,
              "function_call": None, "provider_specific_fields": None}  # as LiteLLM dumped a message
    second = assistant(None, ("call_b", "cat add.py"))
    raw = [system(), user(), first, *observations(first, "add.py"), second, *observations(second, "def add"),
           exit_message("LimitsExceeded")]
    result = export(raw)
    roles = [m["role"] for m in result.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert result.messages[:2] == [system(), user()]
    call = {"id": "call_a", "type": "function",
            "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    assert result.messages[2] == {"role": "assistant", "content": "Look first.",
                                  "reasoning_content": "I should look around.", "tool_calls": [call]}
    assert result.messages[4]["content"] is None
    assert calls_of(result.messages[4]) == [("call_b", {"command": "cat add.py"})]
    assert result.messages[3] == {"role": "tool", "tool_call_id": "call_a",
                                  "content": "<returncode>0</returncode>\n<output>\nadd.py</output>"}
    counts = (result.model_calls, result.tool_calls, result.trimmed, result.hints_removed_any)
    assert counts == (2, 2, 0, False)


def test_a_submitting_turn_is_answered_not_cut() -> None:
    """The environment raises Submitted instead of answering the submitting call; that turn must train."""
    first = assistant("Fix it.", ("c1", "sed -i s/-/+/ add.py"))
    submit = assistant("Done.", ("c2", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"))
    raw = [system(), user(), first, *observations(first, ""), submit,
           exit_message("Submitted", "diff --git a/add.py")]
    result = export(raw)
    assert result.messages[-2]["content"] == "Done." and result.trimmed == 0
    assert result.messages[-1] == {"role": "tool", "content": SUBMITTED_ANSWER, "tool_call_id": "c2"}
    cut = export(raw, answer_submission=False)
    assert cut.messages == result.messages[:4] and cut.trimmed == 1


def test_a_cut_off_last_turn_is_trimmed() -> None:
    first = assistant("Look.", ("c1", "ls"))
    last = assistant("Two at once.", ("c2", "pytest"), ("c3", "git status"))
    answered = observations(last, "1 passed")[:1]  # the second call never came back
    raw = [system(), user(), first, *observations(first, "add.py"), last, *answered,
           exit_message("TimeExceeded")]
    result = export(raw)
    assert [m["role"] for m in result.messages] == ["system", "user", "assistant", "tool"]
    assert (result.trimmed, result.model_calls, result.tool_calls) == (2, 1, 1)
    without_exit = export(raw[:-1])
    assert without_exit.messages == result.messages and without_exit.trimmed == 2


def test_a_turn_left_unanswered_mid_rollout_cuts_everything_from_it() -> None:
    first = assistant("Look.", ("c1", "ls"))
    stuck = assistant("Run.", ("c2", "pytest"))
    later = assistant("Again.", ("c3", "pytest"))
    raw = [system(), user(), first, *observations(first, "add.py"), stuck, later, *observations(later, "ok")]
    result = export(raw)
    assert result.messages[-1]["tool_call_id"] == "c1" and result.trimmed == 3


def test_repeated_and_missing_ids_become_unique_and_the_answers_follow() -> None:
    first = assistant("One.", ("call_1", "ls"))
    second = assistant("Two.", ("call_1", "pwd"), ("call_1", "id"), ("x", "uname"))
    second["tool_calls"][2].pop("id")  # a server that sent no id (litellm would have made one up)
    answers = observations(second, "/repo", "uid=0", "Linux")
    answers[2]["tool_call_id"] = None
    third = assistant("Three.", ("call_2", "date"))  # the model's own id that a fresh one must not reuse
    raw = [system(), user(), first, *observations(first, "add.py"), second, *answers,
           third, *observations(third, "now")]
    result = export(raw)
    ids = [c["id"] for m in result.messages if m["role"] == "assistant" for c in m["tool_calls"]]
    assert ids == ["call_1", "call_3", "call_4", "call_5", "call_2"]
    commands = {c["id"]: json.loads(c["function"]["arguments"])["command"]
                for m in result.messages if m["role"] == "assistant" for c in m["tool_calls"]}
    outputs = {m["tool_call_id"]: m["content"].split("<output>\n")[1]
               for m in result.messages if m["role"] == "tool"}
    assert {commands[i]: outputs[i] for i in ids} == {"ls": "add.py</output>", "pwd": "/repo</output>",
                                                        "id": "uid=0</output>", "uname": "Linux</output>",
                                                        "date": "now</output>"}


def test_a_tool_message_that_answers_nothing_is_dropped() -> None:
    first = assistant("Look.", ("c1", "ls"))
    stray = {"role": "tool", "content": "late", "tool_call_id": "c9", "extra": {}}
    again = {"role": "tool", "content": "twice", "tool_call_id": "c1", "extra": {}}
    result = export([system(), user(), first, *observations(first, "add.py"), stray, again])
    assert [m["content"] for m in result.messages if m["role"] == "tool"] == [
        "<returncode>0</returncode>\n<output>\nadd.py</output>"]
    assert result.trimmed == 0


def test_hints_are_removed_from_user_and_system_only() -> None:
    hint = f"{HINT_OPEN}The bug is in add(): it subtracts.{HINT_CLOSE}"
    first = assistant(f"Quoting {hint}", ("c1", "ls"))
    tool = observations(first, f"echo {HINT_OPEN}")
    raw = [system(f"Be brief.\n{hint}"), user(), first, *tool, user(f"Continue from here.\n\n{hint}"),
           user(hint), assistant("Done.")]
    result = export(raw)
    assert result.hints_removed_any
    assert [m["content"] for m in result.messages if m["role"] in ("user", "system")] == [
        "Be brief.", "Fix the bug in add().", "Continue from here."]
    assert result.messages[2]["content"] == f"Quoting {hint}"  # what the model wrote is what it trains on
    assert HINT_OPEN in result.messages[3]["content"]
    # a hint-only message goes (an empty user turn would be trained around); the rest keep their order
    assert [m["role"] for m in result.messages] == [m["role"] for m in raw if m is not raw[-2]]


def test_strip_hints_removes_every_span_and_stray_tag() -> None:
    text = f"a {HINT_OPEN}one\ntwo{HINT_CLOSE} b {HINT_OPEN}three{HINT_CLOSE} c {HINT_CLOSE}"
    assert strip_hints(text) == ("a  b  c", True)
    assert strip_hints(f"keep {HINT_OPEN}an unclosed hint\nruns to the end") == ("keep", True)
    assert strip_hints("  nothing here\n") == ("  nothing here\n", False)


def test_list_content_is_joined_from_its_text_parts() -> None:
    first = assistant("Look.", ("c1", "cat shot.txt"))
    regex = DEFAULT_MULTIMODAL_REGEX
    image = "<MSWEA_MULTIMODAL_CONTENT><CONTENT_TYPE>image_url</CONTENT_TYPE>x</MSWEA_MULTIMODAL_CONTENT>"
    tool = observations(first, f"before{image}after", multimodal_regex=regex)
    assert isinstance(tool[0]["content"], list)
    parts = [{"type": "text", "text": "Fix "}, {"type": "image_url", "image_url": {"url": "u"}},
             {"type": "text", "text": f"this.{HINT_OPEN}x{HINT_CLOSE}"}]
    result = export([system(), {"role": "user", "content": parts}, first, *tool])
    assert result.messages[1]["content"] == "Fix this." and result.hints_removed_any
    assert result.messages[3]["content"] == "<returncode>0</returncode>\n<output>\nbeforeafter</output>"


def test_a_text_model_rollout_alternates_user_and_assistant() -> None:
    def text_turn(command: str, output: str) -> list[dict]:
        reply = assistant(f"THOUGHT\n\n```mswea_bash_command\n{command}\n```")
        outputs = [{"output": output, "returncode": 0, "exception_info": ""}]
        return [reply, *format_observation_messages(outputs, observation_template=TEMPLATE)]

    submit = assistant("```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```")
    raw = [system(), user(), *text_turn("ls", "add.py"), *text_turn("cat add.py", "def add"), submit,
           exit_message("Submitted")]
    result = export(raw)
    roles = [m["role"] for m in result.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert all(set(m) == {"role", "content"} for m in result.messages)
    assert (result.model_calls, result.tool_calls, result.trimmed) == (3, 0, 0)
    assert TOOLS_BY_MODEL_CLASS == {"tools": [BASH_TOOL], "text": []}


def test_a_format_error_stays_a_user_message() -> None:
    with pytest.raises(FormatError) as caught:
        parse_toolcall_actions([], format_error_template="{{ error }}")
    first = assistant("Look.", ("c1", "ls"))
    raw = [system(), user(), *caught.value.messages, first, *observations(first, "add.py")]
    result = export(raw)
    assert result.messages[2] == {"role": "user", "content": caught.value.messages[0]["content"]}
    assert [m["role"] for m in result.messages] == ["system", "user", "user", "assistant", "tool"]


def test_assistant_fields_are_normalized() -> None:
    plain = assistant(None, reasoning_content="")
    dict_args = assistant("Go.", ("c1", "ls"), reasoning_content=None)
    dict_args["tool_calls"][0]["function"]["arguments"] = {"command": "ls -a"}
    result = export([user(), plain, user("next"), dict_args, *observations(dict_args, "x")])
    assert result.messages[1] == {"role": "assistant", "content": ""}
    assert calls_of(result.messages[3]) == [("c1", {"command": "ls -a"})]
    assert "reasoning_content" not in result.messages[3]


def test_nothing_trainable_is_an_error() -> None:
    with pytest.raises(ExportError, match="no assistant message"):
        export_messages([system(), user(), exit_message("LimitsExceeded")])
    cut_off = assistant("Run.", ("c1", "pytest"))
    with pytest.raises(ExportError, match="no assistant message"):
        export_messages([system(), user(), cut_off, exit_message("TimeExceeded")])
    with pytest.raises(ExportError, match="developer"):
        export_messages([{"role": "developer", "content": "x"}, user(), assistant("hi")])


def journal(messages: list[dict], turns: list[list[dict]]) -> Journal:
    header = Header(task="fix add()", model="m", model_class="tools", endpoint_host="h", image="i",
                    image_key="im-1", cwd="/repo", store="/store", sandbox="sb-1", git_commit=None, host="h",
                    messages=messages,
                    limits=Limits(step_limit=5, token_limit=100, wall_time_s=60, command_timeout_s=10),
                    parent=ParentRef(journal="runs/root.jsonl", turn=1, checkpoint="ck-1"))
    records = [Turn(turn=n, checkpoint=f"ck-{n}", thought="t", commands=["ls"], observation="o", exit_code=0,
                    tokens_in=1, tokens_out=1, model_latency_s=0.1, command_s=0.1, checkpoint_ms=1.0,
                    n_calls=n, new_messages=new) for n, new in enumerate(turns, start=2)]
    outcome = Outcome(status="submitted", exit_status="Submitted", turns=len(turns), tokens_in=1,
                      tokens_out=1, wall_s=1.0, final_checkpoint="ck-3")
    return Journal.model_validate_json(
        Journal(path="runs/branch.jsonl", header=header, turns=records, outcome=outcome).model_dump_json())


def test_a_branch_journal_exports_its_history_and_turns_in_order() -> None:
    first = assistant("Look.", ("c1", "ls"))
    restored = [system(), user(), first, *observations(first, "add.py"),
                user(f"Continue.\n{HINT_OPEN}Check add().{HINT_CLOSE}")]
    second = assistant("Fix.", ("c2", "sed -i s/-/+/ add.py"))
    submit = assistant("Done.", ("c3", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"))
    turns = [[second, *observations(second, "")], [submit, exit_message("Submitted", "diff")]]
    loaded = journal(restored, turns)
    messages = journal_messages(loaded)
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user", "assistant", "tool", "user", "assistant", "tool", "assistant", "exit"]
    result = export(messages)
    assert result.messages[4] == {"role": "user", "content": "Continue."} and result.hints_removed_any
    ids = [c[0] for m in result.messages if m["role"] == "assistant" for c in calls_of(m)]
    assert ids == ["c1", "c2", "c3"]
    assert (result.model_calls, result.tool_calls, result.trimmed) == (3, 3, 0)
