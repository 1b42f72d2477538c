"""mini-swe-agent's own model classes pointed at any OpenAI-compatible Chat Completions endpoint."""

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from ..errors import SproutError

MODEL_CLASSES = {
    "tools": ("mini.yaml", "litellm"),  # tool calls (LitellmModel), mini-swe-agent's default
    "text": ("mini_textbased.yaml", "litellm_textbased"),  # ```mswea_bash_command blocks, no tools
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

    `top_k` and `extra_body` go in the request body as they are (litellm would drop a top_k it does not
    know for OpenAI-compatible servers; SGLang and vLLM read it from the body): -1 means off there."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)  # the completion token limit of each call
    extra_body: dict[str, Any] = {}

    def litellm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {k: v for k, v in self.model_dump(include={"temperature", "top_p", "stop",
                                                                             "max_tokens"}).items()
                                  if v is not None}
        body = self.extra_body | ({"top_k": self.top_k} if self.top_k is not None else {})
        return kwargs | ({"extra_body": body} if body else {})


def mswea_config(model_class: str) -> dict:
    from minisweagent.config import get_config_from_spec

    if model_class not in MODEL_CLASSES:
        raise SproutError(f"--model-class must be one of {', '.join(MODEL_CLASSES)}, got {model_class!r}")
    return get_config_from_spec(MODEL_CLASSES[model_class][0])


def make_model(name: str, endpoint: Endpoint, model_class: str = "tools", config: dict | None = None,
               sampling: SamplingParams | None = None):
    """LitellmModel (tools) or LitellmTextbasedModel (text) for `name` served at `endpoint`, every call
    made with `sampling`.

    Cost tracking ignores unpriced models (cost stays 0; Sprout limits tokens instead); retries with
    exponential backoff on 429/5xx/timeouts are mini-swe-agent's own (MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT)."""
    import litellm
    from minisweagent.models import get_model

    litellm.suppress_debug_info = True  # else every failed call prints a "Provider List" banner
    model_config = dict((config or mswea_config(model_class))["model"])
    model_config |= {
        "model_name": name if name.startswith("openai/") else f"openai/{name}",
        "model_class": MODEL_CLASSES[model_class][1],
        "cost_tracking": "ignore_errors",
        "model_kwargs": {**model_config.get("model_kwargs", {}), **(sampling.litellm_kwargs() if sampling else {}),
                         "api_base": endpoint.url, "api_key": endpoint.key or "none"},
    }
    return get_model(config=model_config)
