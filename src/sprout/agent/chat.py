"""The one client for OpenAI-compatible Chat Completions endpoints: the agent's model calls
(sprout.agent.chat_model) and the SPROUT reviewer's (sprout.method.review).

One POST of a request body to `<endpoint>/chat/completions` over httpx, with the endpoint's key as a bearer
token; the answer is the response's JSON, checked to hold a message. What goes wrong is one of two errors:
`ChatRefused`, a 4xx that asking again will not change (a wrong key, URL or model, a request the server
rejects), and `ChatError`, anything asking again may fix (no connection, a timeout, 408, 409, 425, 429, a
5xx, a body that is not a completion). Retrying is the caller's policy.
"""

import os
import threading
from typing import TYPE_CHECKING, Any

import httpx

from ..errors import SproutError

if TYPE_CHECKING:
    from .models import Endpoint

CONNECT_TIMEOUT_S = 10.0
RETRYABLE = frozenset({408, 409, 425, 429})  # 4xx statuses a server sends for a passing condition
WHY = {401: "the key was refused", 403: "access is forbidden", 404: "no such URL or model"}
DETAIL_CAP = 300  # characters of an error body kept in the message


class ChatError(SproutError):
    """No completion came back, for a reason that may pass: asking again may help. `status`: the HTTP
    status, None when no answer (or no completion) came."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ChatRefused(ChatError):
    """The endpoint refused the request (a 4xx other than 408, 409, 425 and 429): asking again will not
    change its answer."""


_clients: dict[int, httpx.Client] = {}
_clients_lock = threading.Lock()


def _client() -> httpx.Client:
    """This process's client, whose connections are kept between calls (a forked child makes its own)."""
    with _clients_lock:
        client = _clients.get(os.getpid())
        if client is None:
            client = _clients[os.getpid()] = httpx.Client(limits=httpx.Limits(max_connections=None))
        return client


def complete(endpoint: "Endpoint", body: dict[str, Any], *, timeout_s: float, purpose: str = "model") -> dict:
    """The JSON of one Chat Completions call with `body`, whose first choice holds a message. `purpose` names
    the endpoint in errors ("model", "reviewer")."""
    where = f"the {purpose} endpoint {endpoint.url}"
    headers = {"Authorization": f"Bearer {endpoint.key}"} if endpoint.key else {}
    timeout = httpx.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s))
    try:
        response = _client().post(f"{endpoint.url}/chat/completions", json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise ChatError(f"no answer from {where}: {type(e).__name__}: {str(e) or 'no detail'}") from None
    status = response.status_code
    if status >= 400:
        why = f" ({WHY[status]})" if status in WHY else ""
        message = f"{where} answered HTTP {status} for model {body.get('model')!r}{why}: {_detail(response)}"
        refused = status < 500 and status not in RETRYABLE
        raise (ChatRefused if refused else ChatError)(message, status)
    try:
        data = response.json()
        if not isinstance(data["choices"][0]["message"], dict):
            raise TypeError("the message is not an object")
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ChatError(f"{where} answered {status} without a completion ({type(e).__name__}: {e}): "
                        f"{response.text[:DETAIL_CAP]!r}", status) from None
    return data


def _detail(response: httpx.Response) -> str:
    """The server's error message (OpenAI's {"error": {"message": ...}}), else the start of its body."""
    try:
        error = response.json().get("error")
        detail = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        detail = None
    return str(detail or response.text or "no body")[:DETAIL_CAP]
