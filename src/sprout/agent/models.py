"""mini-swe-agent's own model classes pointed at any OpenAI-compatible Chat Completions endpoint."""

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from ..errors import SproutError

MODEL_CLASSES = {  # mini-swe-agent's config file, and the class of sprout.agent.chat_model
    "tools": ("mini.yaml", "ToolCallModel"),  # tool calls, mini-swe-agent's default
    "text": ("mini_textbased.yaml", "TextModel"),  # ```mswea_bash_command blocks, no tools
}


@dataclass
class Endpoint:
    """Where the model is served. The key is read from an environment variable, never stored; with
    key_env None no key is sent. `name`: an endpoint configured on Run Store workers (its URL may be
    unknown to the submitter; sprout.jobs.endpoints)."""

    url: str
    key_env: str | None = "OPENAI_API_KEY"
    name: str | None = None

    @property
    def host(self) -> str:
        return urlsplit(self.url).netloc or (f"endpoint {self.name}" if self.name else "")

    @property
    def key(self) -> str:
        return os.environ.get(self.key_env, "") if self.key_env else ""

    @classmethod
    def resolve(cls, url: str | None, key_env: str | None, *, require_key: bool = True) -> "Endpoint":
        """The endpoint from flags or the environment; `require_key`: its key variable must be set here
        (not where workers elsewhere make the calls)."""
        url = url or os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_BASE")
        if not url:
            raise SproutError("no model endpoint: pass --model-endpoint URL or set OPENAI_BASE_URL")
        if not url.startswith(("http://", "https://")):
            raise SproutError(f"the model endpoint must be an http(s) URL, got {url!r}")
        key_env = key_env or "OPENAI_API_KEY"
        if require_key and key_env not in os.environ:
            raise SproutError(f"the model key variable {key_env} is not set (export it, or pass "
                              "--model-key-env with the name of the variable holding the key)")
        return cls(url.rstrip("/"), key_env)


class SamplingParams(BaseModel):
    """Sampling settings sent with every model call of a rollout (unset: the server's defaults).

    `top_k` and the fields of `extra_body` go in the request body as they are (SGLang and vLLM read them
    there; -1 means off for top_k)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)  # the completion token limit of each call
    extra_body: dict[str, Any] = {}

    def request_fields(self) -> dict[str, Any]:
        """The fields this adds to a Chat Completions request's body."""
        fields = self.model_dump(include={"temperature", "top_p", "top_k", "stop", "max_tokens"}, exclude_none=True)
        return self.extra_body | fields


def mswea_config(model_class: str) -> dict:
    from minisweagent.config import get_config_from_spec

    if model_class not in MODEL_CLASSES:
        raise SproutError(f"--model-class must be one of {', '.join(MODEL_CLASSES)}, got {model_class!r}")
    return get_config_from_spec(MODEL_CLASSES[model_class][0])


def make_model(name: str, endpoint: Endpoint, model_class: str = "tools", config: dict | None = None,
               sampling: SamplingParams | None = None):
    """The model (sprout.agent.chat_model) that asks `name` at `endpoint` for the agent's turns, as tool calls
    ("tools") or text ("text"), every call made with `sampling`, with the templates of mini-swe-agent's config
    (`config`, else its file for the model class; its LiteLLM-only `model_kwargs` do not apply)."""
    from . import chat_model

    templates = (config or mswea_config(model_class))["model"]
    fields = {k: v for k, v in templates.items() if k in chat_model.ChatModelConfig.model_fields}
    model_config = chat_model.ChatModelConfig(model_name=name, **fields,
                                              request_fields=sampling.request_fields() if sampling else {})
    return getattr(chat_model, MODEL_CLASSES[model_class][1])(model_config, endpoint)
