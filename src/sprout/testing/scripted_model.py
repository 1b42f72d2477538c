"""Scripted model server: replays a fixed script over the OpenAI Chat Completions API.

Tests and dry runs point an agent at this server instead of a real LLM: Sprout's (sprout.agent.chat_model),
or any OpenAI client, e.g. mini-swe-agent's LitellmModel with model_name "openai/scripted" and model_kwargs
{"api_base": <base URL>}.

Script file (JSON): a list of steps, or {"model": "scripted", "steps": [...]}.
Each step is exactly one of:

  {"thought": "...", "command": "ls"}          one bash action
  {"thought": "...", "commands": ["a", "b"]}   several actions in one reply
  {"content": "raw assistant text"}            raw text, no action (e.g. to cause a format error)
  {"status": 500, "body": "message"}           an HTTP error (400-599) instead of a reply; a string
                                               body is sent as {"error": {"message": ...}}, a JSON
                                               object body is sent as is

Any step may also have:

  "delay_s": 0.5      wait this many seconds before answering
  "match": "regex"    answer only a request whose last user/tool message content matches
                      (re.search)
  "conversation": "regex"
                      answer only a request where some message's content matches (re.search):
                      routes concurrent conversations, e.g. branches by their review notes

Step selection: each chat request is answered by the FIRST unused step, in script order, whose
"match" and "conversation" succeed (a step without them matches anything); that step is then used up. Without
any "match" this is plain in-order replay. A step whose match fails is skipped and stays unused,
so a later request can still take it. When no unused step fits, the server answers HTTP 500
("scripted model: script exhausted after N steps", or "... no unused step matches ..." when
unused steps remain), so a run that goes past its script fails loudly.

Reply format follows the request. With a non-empty "tools" list, actions are "bash" tool_calls
(arguments {"command": ...}, finish_reason "tool_calls", content = the thought). Without tools,
the content is the thought, a blank line, then one ```mswea_bash_command block per command
(mini-swe-agent's text-based format). usage counts ceil(characters / 4) tokens.

Endpoints: POST /v1/chat/completions, GET /v1/models (both also without /v1), GET /health,
GET /_scripted/requests (recorded requests, JSON list), POST /_scripted/reset (rewind the
script and clear the records). Every request except /health and /_scripted/* is recorded and,
with an API key set, must carry "Authorization: Bearer KEY" (else 401).
"""

from __future__ import annotations

import json
import math
import re
import signal
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import UsageError

ACTION_FENCE = "mswea_bash_command"


class ScriptError(ValueError):
    """A script that cannot be loaded or does not follow the script format."""


class ScriptStep(BaseModel):
    """One scripted reply: an action reply, raw content, or an HTTP error."""

    model_config = ConfigDict(extra="forbid")

    thought: str = ""
    command: str | None = None
    commands: list[str] | None = Field(default=None, min_length=1)
    content: str | None = None
    status: int | None = Field(default=None, ge=400, le=599)
    body: str | dict[str, Any] | None = None
    delay_s: float = Field(default=0.0, ge=0)
    match: str | None = None
    conversation: str | None = None

    @field_validator("match", "conversation")
    @classmethod
    def _valid_regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as e:
                raise ValueError(f"invalid regex {value!r}: {e}") from None
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> Self:
        kinds = [k for k in ("command", "commands", "content", "status") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(
                f"a step needs exactly one of command, commands, content, status (got {kinds or 'none'})"
            )
        if kinds[0] in ("content", "status") and "thought" in self.model_fields_set:
            raise ValueError(f"'thought' goes with command/commands, not with {kinds[0]}")
        if self.body is not None and self.status is None:
            raise ValueError("'body' goes only with status")
        return self

    @property
    def actions(self) -> list[str]:
        """The bash commands of this step (empty for content and error steps)."""
        if self.command is not None:
            return [self.command]
        return self.commands or []

    def matches(self, text: str, conversation: list[str]) -> bool:
        """Whether this step may answer a request whose last user/tool message is `text` and whose
        messages' contents are `conversation`."""
        return ((self.match is None or re.search(self.match, text) is not None)
                and (self.conversation is None or any(re.search(self.conversation, c) for c in conversation)))


class Script(BaseModel):
    """A whole script: the model name reported by the server and its steps."""

    model_config = ConfigDict(extra="forbid")

    model: str = "scripted"
    steps: list[ScriptStep] = Field(min_length=1)


def parse_script(data: Any, source: str = "script") -> Script:
    """Validate script data (a list of steps or an object with "steps"); raise ScriptError if bad."""
    if isinstance(data, list):
        data = {"steps": data}
    if not isinstance(data, dict):
        raise ScriptError(
            f"bad {source}: expected a list of steps or an object with 'steps', got {type(data).__name__}"
        )
    try:
        return Script.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()
        )
        raise ScriptError(f"bad {source}: {problems}") from None


def load_script(path: str | Path) -> Script:
    """Read and validate a JSON script file; raise ScriptError with a one-line reason if bad."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ScriptError(f"cannot read script {path}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise ScriptError(f"bad script {path}: invalid JSON at {where}: {e.msg}") from None
    return parse_script(data, f"script {path}")


def render_text_reply(thought: str, commands: list[str]) -> str:
    """Format a reply for mini-swe-agent's text-based model: thought, then one fenced block per command."""
    blocks = [f"```{ACTION_FENCE}\n{command}\n```" for command in commands]
    return "\n\n".join(part for part in [thought, *blocks] if part)


def _text(content: Any) -> str:
    """Text of a message content (a string, a list of content parts, or None)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _tokens(chars: int) -> int:
    return math.ceil(chars / 4)


def _error(message: str, kind: str = "scripted_model_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


class ScriptedModelServer:
    """An OpenAI-compatible HTTP server that replays a script; see the module docstring.

    The socket is bound on construction (port 0 picks a free port). Use it as a context manager,
    or call start() (serve from a daemon thread) and stop(); a stopped server cannot restart.
    """

    def __init__(
        self,
        script: Script | list[dict[str, Any]] | dict[str, Any] | str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        record: str | Path | None = None,
        delay_s: float = 0.0,
    ) -> None:
        """`delay_s`: seconds every chat answer waits (a model's latency), on top of a step's own."""
        if isinstance(script, Script):
            self.script = script
        elif isinstance(script, list | dict):
            self.script = parse_script(script)
        else:
            self.script = load_script(script)
        self.api_key, self.delay_s = api_key, delay_s
        self.record_path = Path(record) if record is not None else None
        self._lock = threading.Lock()
        self._used = [False] * len(self.script.steps)
        self._requests: list[dict[str, Any]] = []
        self._httpd = _HTTPServer((host, port), self)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        """OpenAI base URL, e.g. http://127.0.0.1:PORT/v1."""
        return f"http://{self._httpd.server_address[0]!s}:{self.port}/v1"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Copies of the recorded requests, oldest first."""
        with self._lock:
            return [dict(r) for r in self._requests]

    @property
    def remaining(self) -> list[ScriptStep]:
        """The steps not used yet, in script order."""
        with self._lock:
            return [s for s, used in zip(self.script.steps, self._used) if not used]

    def reset(self) -> None:
        """Rewind the script and forget the recorded requests (the record file is kept)."""
        with self._lock:
            self._used = [False] * len(self.script.steps)
            self._requests = []

    def start(self) -> Self:
        """Serve from a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.serve_forever, name="scripted-model", daemon=True)
            self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until interrupted or stopped."""
        self._httpd.serve_forever(poll_interval=0.05)

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def handle(self, method: str, path: str, headers: Mapping[str, str], raw_body: bytes) -> tuple[int, Any]:
        """Answer one HTTP request: (status, JSON payload)."""
        route = urlsplit(path).path.rstrip("/") or "/"
        if route == "/health":
            return 200, {"status": "ok"}
        if route == "/_scripted/requests" and method == "GET":
            return 200, self.requests
        if route == "/_scripted/reset" and method == "POST":
            self.reset()
            return 200, {"status": "reset", "steps": len(self.script.steps)}
        headers = {k.lower(): v for k, v in headers.items()}
        try:
            body: Any = json.loads(raw_body) if raw_body else None
        except ValueError:
            body = raw_body.decode(errors="replace")
        record: dict[str, Any] = {
            "time": time.time(),
            "method": method,
            "path": path,
            "headers": headers | ({"authorization": "<redacted>"} if "authorization" in headers else {}),
            "body": body,
        }
        status, payload, step = self._api(method, route, headers, body)
        self._record(record | {"status": status, "step": step, "response": payload})
        return status, payload

    def _api(
        self, method: str, route: str, headers: dict[str, str], body: Any
    ) -> tuple[int, Any, int | None]:
        if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
            return 401, _error("scripted model: invalid or missing API key", "authentication_error"), None
        if method == "GET" and route in ("/v1/models", "/models"):
            model = {"id": self.script.model, "object": "model", "created": 0, "owned_by": "sprout"}
            return 200, {"object": "list", "data": [model]}, None
        if method == "POST" and route in ("/v1/chat/completions", "/chat/completions"):
            return self._chat(body)
        return 404, _error(f"scripted model: no route {method} {route}", "not_found_error"), None

    def _chat(self, body: Any) -> tuple[int, Any, int | None]:
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return 400, _error("scripted model: body must be a JSON object with a 'messages' list"), None
        if body.get("stream"):
            return 400, _error("scripted model: streaming is not supported"), None
        last: dict[str, Any] = next((m for m in reversed(messages) if m.get("role") in ("user", "tool")), {})
        text = _text(last.get("content"))
        conversation = [_text(m.get("content")) for m in messages]
        with self._lock:
            steps = self.script.steps
            index = next((i for i, s in enumerate(steps) if not self._used[i] and s.matches(text, conversation)),
                         None)
            if index is None:
                unused = self._used.count(False)
                if unused == 0:
                    message = f"scripted model: script exhausted after {len(steps)} steps"
                else:
                    message = (
                        f"scripted model: no unused step matches the last user/tool message {text[:200]!r}"
                        f" ({unused} of {len(steps)} steps unused)"
                    )
                return 500, _error(message), None
            self._used[index] = True
        step = steps[index]
        time.sleep(self.delay_s + step.delay_s)
        if step.status is not None:
            if isinstance(step.body, dict):
                return step.status, step.body, index
            return step.status, _error(step.body or f"scripted error {step.status}"), index
        return 200, self._completion(step, index, body), index

    def _completion(self, step: ScriptStep, index: int, body: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any]
        if step.content is None and body.get("tools"):
            calls: list[dict[str, Any]] = [
                {
                    "id": f"call_scripted_{index}_{j}",
                    "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"command": command})},
                }
                for j, command in enumerate(step.actions)
            ]
            message = {"role": "assistant", "content": step.thought or None, "tool_calls": calls}
            finish_reason = "tool_calls"
            completion_chars = len(step.thought) + sum(len(c["function"]["arguments"]) for c in calls)
        else:
            content = step.content
            if content is None:
                content = render_text_reply(step.thought, step.actions)
            message = {"role": "assistant", "content": content}
            finish_reason = "stop"
            completion_chars = len(content)
        prompt_tokens = _tokens(sum(len(_text(m.get("content"))) for m in body["messages"]))
        completion_tokens = _tokens(completion_chars)
        return {
            "id": f"chatcmpl-scripted-{index}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.script.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _record(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._requests.append(record)
            if self.record_path is not None:
                with self.record_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], owner: ScriptedModelServer) -> None:
        self.owner = owner
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._respond()

    def do_POST(self) -> None:
        self._respond()

    def _respond(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw_body = self.rfile.read(length) if length else b""
        status, payload = self.server.owner.handle(self.command, self.path, dict(self.headers), raw_body)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: requests are recorded instead of logged."""


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve(script: str | Path, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
          record: str | Path | None = None, delay_s: float = 0.0) -> int:
    """Serves a script file until SIGINT or SIGTERM (`sprout scripted-model`)."""
    try:
        server = ScriptedModelServer(script, host=host, port=port, api_key=api_key, record=record, delay_s=delay_s)
    except ScriptError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"scripted model server on {server.base_url} ({len(server.script.steps)} steps)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":  # the seed's form of `sprout scripted-model`
    from ..cli import alias

    alias("sprout.testing.scripted_model")
