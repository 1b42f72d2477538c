"""mini-swe-agent's model protocol over sprout.agent.chat: the agent's policy at any OpenAI-compatible Chat
Completions endpoint, as tool calls (`ToolCallModel`, mini-swe-agent's default) or as ```mswea_bash_command
blocks (`TextModel`).

The actions are parsed and the observations written by mini-swe-agent's own helpers, with its config files'
templates, and retried by its own policy (`MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT` tries, exponential backoff),
so a turn is what its LiteLLM classes make of the same answer; what differs is how the call is made. The
request is the model's name as given, the messages, the bash tool (tool calls only) and the sampling fields,
nothing else; the returned message is the server's, as it sent it, plus mini-swe-agent's `extra` (the
actions, the whole response, cost 0: Sprout limits tokens, not cost). A refused request (`ChatRefused`) is
not asked again. LiteLLM is not imported: it costs seconds of CPU in every process that runs an agent.
"""

import copy
import logging
import time
import uuid
from types import SimpleNamespace
from typing import Any

from minisweagent.exceptions import FormatError
from minisweagent.models.utils.actions_text import format_observation_messages, parse_regex_actions
from minisweagent.models.utils.actions_toolcall import (
    BASH_TOOL,
    format_toolcall_observation_messages,
    parse_toolcall_actions,
)
from minisweagent.models.utils.openai_multimodal import expand_multimodal_content
from minisweagent.models.utils.retry import retry
from pydantic import BaseModel, ConfigDict, Field

from .chat import ChatRefused, complete
from .models import Endpoint

log = logging.getLogger("sprout.agent.model")


class ChatModelConfig(BaseModel):
    """The model section of mini-swe-agent's config (its templates), the model's name and the request's fields."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_name: str
    request_fields: dict[str, Any] = {}  # sampling settings, sent in the body of every call
    timeout_s: float = Field(600.0, gt=0)  # one call, at most
    observation_template: str
    format_error_template: str
    multimodal_regex: str = ""
    action_regex: str = r"```mswea_bash_command\s*\n(.*?)\n```"  # text actions only


class ToolCallModel:
    """The policy as tool calls of mini-swe-agent's bash tool."""

    tools: list[dict] = [BASH_TOOL]

    def __init__(self, config: ChatModelConfig, endpoint: Endpoint):
        self.config, self.endpoint = config, endpoint

    def query(self, messages: list[dict], **kwargs: Any) -> dict:
        body = {"model": self.config.model_name, "messages": api_messages(messages),
                **({"tools": self.tools} if self.tools else {}), **self.config.request_fields, **kwargs}
        abort: list = [ChatRefused, KeyboardInterrupt]  # as in mini-swe-agent's classes
        for attempt in retry(logger=log, abort_exceptions=abort):
            with attempt:
                response = complete(self.endpoint, body, timeout_s=self.config.timeout_s)
        return self.message(response)

    def message(self, response: dict) -> dict:
        """The turn's message: the first choice's, with its actions and the response in `extra`. Raises
        FormatError (the response kept in it, as mini-swe-agent's contract asks) when it has no usable action.
        The response stays as the server sent it: ids given to tool calls go into the message only."""
        choice = copy.deepcopy(response["choices"][0])
        extra = {"response": response, "cost": 0.0}
        try:
            actions = self.parse_actions(choice)
        except FormatError as e:
            e.messages[0]["extra"].update(extra)
            raise
        return {**choice["message"], "extra": {"actions": actions, **extra, "timestamp": time.time()}}

    def parse_actions(self, choice: dict) -> list[dict]:
        """The bash commands of the choice's tool calls (a call without an id gets one, as LiteLLM gave)."""
        calls = [c for c in choice["message"].get("tool_calls") or [] if isinstance(c, dict)]
        for call in calls:
            call["id"] = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
        functions: list[dict] = [c["function"] if isinstance(c.get("function"), dict) else {} for c in calls]
        parsed = [SimpleNamespace(id=c["id"], function=SimpleNamespace(name=f.get("name"), arguments=f.get("arguments")))
                  for c, f in zip(calls, functions)]
        return parse_toolcall_actions(parsed, format_error_template=self.config.format_error_template,
                                      template_kwargs={"finish_reason": choice.get("finish_reason")})

    def format_message(self, **kwargs: Any) -> dict:
        return expand_multimodal_content(kwargs, pattern=self.config.multimodal_regex)

    def format_observation_messages(self, message: dict, outputs: list[dict],
                                    template_vars: dict | None = None) -> list[dict]:
        return format_toolcall_observation_messages(
            actions=message.get("extra", {}).get("actions", []), outputs=outputs,
            observation_template=self.config.observation_template, template_vars=template_vars,
            multimodal_regex=self.config.multimodal_regex)

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return self.config.model_dump()

    def serialize(self) -> dict:
        return {"info": {"config": {"model": self.config.model_dump(mode="json"),
                                    "model_type": f"{type(self).__module__}.{type(self).__name__}"}}}


class TextModel(ToolCallModel):
    """The policy as exactly one ```mswea_bash_command block in the message's text; no tools are offered."""

    tools: list[dict] = []

    def parse_actions(self, choice: dict) -> list[dict]:
        return parse_regex_actions(choice["message"].get("content") or "", action_regex=self.config.action_regex,
                                   format_error_template=self.config.format_error_template,
                                   template_kwargs={"finish_reason": choice.get("finish_reason")})

    def format_observation_messages(self, message: dict, outputs: list[dict],
                                    template_vars: dict | None = None) -> list[dict]:
        return format_observation_messages(outputs, observation_template=self.config.observation_template,
                                           template_vars=template_vars, multimodal_regex=self.config.multimodal_regex)


def api_messages(messages: list[dict]) -> list[dict]:
    """The conversation as the API takes it: without mini-swe-agent's `extra`, and without the keys a message
    holds as null other than `content` (journals written through LiteLLM hold `function_call` and
    `provider_specific_fields` so)."""
    return [{k: v for k, v in m.items() if k != "extra" and (v is not None or k == "content")} for m in messages]
