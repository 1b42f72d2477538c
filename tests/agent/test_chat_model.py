"""The agent's model class against the scripted model server: what a call sends, what a turn's message holds,
and which answers are not asked again."""

import pytest
from minisweagent.exceptions import FormatError
from minisweagent.models.utils.actions_toolcall import BASH_TOOL

from sprout.agent.chat import ChatError, ChatRefused
from sprout.agent.models import Endpoint, SamplingParams, make_model
from sprout.testing.scripted_model import ScriptedModelServer

pytestmark = pytest.mark.python_only

KEY_ENV = "SPROUT_TEST_MODEL_KEY"
CALL = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
HISTORY = [  # as a journal written through LiteLLM holds it: `extra`, and keys LiteLLM dumped as null
    {"role": "system", "content": "sys", "extra": {}},
    {"role": "user", "content": "task"},
    {"role": "assistant", "content": None, "tool_calls": [CALL], "function_call": None,
     "provider_specific_fields": None, "reasoning_content": "think", "extra": {"actions": [{"command": "ls"}]}},
    {"role": "tool", "tool_call_id": "c1", "content": "a.py", "extra": {"returncode": 0}},
]


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, "sk-test")
    return "sk-test"


def test_a_call_sends_the_name_as_given_the_sampling_fields_and_the_messages_without_bookkeeping(key: str) -> None:
    sampling = SamplingParams(temperature=0.5, top_k=20, max_tokens=64, extra_body={"min_p": 0.1})
    with ScriptedModelServer([{"thought": "again", "command": "cat a.py"}], api_key=key) as server:
        model = make_model("openai/gpt-oss-120b", Endpoint(server.base_url, KEY_ENV), sampling=sampling)
        message = model.query(HISTORY)
        body = server.requests[0]["body"]
    assert body == {"model": "openai/gpt-oss-120b", "tools": [BASH_TOOL], "temperature": 0.5, "top_k": 20,
                    "max_tokens": 64, "min_p": 0.1, "messages": [
                        {"role": "system", "content": "sys"}, {"role": "user", "content": "task"},
                        {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "think"},
                        {"role": "tool", "tool_call_id": "c1", "content": "a.py"}]}
    call_id = message["tool_calls"][0]["id"]
    assert message["role"] == "assistant" and message["content"] == "again"
    assert message["extra"]["actions"] == [{"command": "cat a.py", "tool_call_id": call_id}]
    assert message["extra"]["response"]["usage"]["completion_tokens"] > 0 and message["extra"]["cost"] == 0.0


def test_the_text_class_offers_no_tools_and_reads_one_command_block(key: str) -> None:
    with ScriptedModelServer([{"thought": "t", "command": "echo hi"}, {"content": "no block"}]) as server:
        model = make_model("scripted", Endpoint(server.base_url, KEY_ENV), "text")
        message = model.query([{"role": "user", "content": "task"}])
        with pytest.raises(FormatError) as caught:
            model.query([{"role": "user", "content": "task"}])
        bodies = [r["body"] for r in server.requests]
    assert "tools" not in bodies[0] and message["extra"]["actions"] == [{"command": "echo hi"}]
    assert "EXACTLY ONE action" in caught.value.messages[0]["content"]
    assert caught.value.messages[0]["extra"]["response"]["choices"][0]["message"]["content"] == "no block"


def test_a_tool_call_without_an_id_gets_one_that_its_observation_answers() -> None:
    model = make_model("m", Endpoint("http://127.0.0.1:9/v1"))
    call = {"type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    message = model.message({"choices": [{"message": {"role": "assistant", "content": "", "tool_calls": [call]},
                                          "finish_reason": "tool_calls"}]})
    call_id = message["tool_calls"][0]["id"]
    assert call_id.startswith("call_") and message["extra"]["actions"][0]["tool_call_id"] == call_id
    assert "id" not in message["extra"]["response"]["choices"][0]["message"]["tool_calls"][0]  # as it was sent
    [observation] = model.format_observation_messages(message, [{"output": "a.py", "returncode": 0, "exception_info": ""}])
    assert observation["role"] == "tool" and observation["tool_call_id"] == call_id


@pytest.mark.parametrize(("status", "why"), [(401, "the key was refused"), (404, "no such URL or model"),
                                             (400, "context length")])
def test_a_refused_call_is_not_asked_again(key: str, status: int, why: str) -> None:
    script = [{"status": status, "body": "context length exceeded" if status == 400 else "nope"},
              {"thought": "never", "command": "ls"}]
    with ScriptedModelServer(script) as server:
        model = make_model("scripted", Endpoint(server.base_url, KEY_ENV))
        with pytest.raises(ChatRefused, match=rf"the model endpoint {server.base_url} answered HTTP {status} "
                                              rf"for model 'scripted'.*{why}") as caught:
            model.query([{"role": "user", "content": "task"}])
        assert len(server.requests) == 1 and caught.value.status == status


def test_no_server_is_an_error_that_may_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
    model = make_model("m", Endpoint("http://127.0.0.1:9/v1"))
    with pytest.raises(ChatError, match=r"no answer from the model endpoint http://127.0.0.1:9/v1: ConnectError") \
            as caught:
        model.query([{"role": "user", "content": "task"}])
    assert type(caught.value) is ChatError and caught.value.status is None
