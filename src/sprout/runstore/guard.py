"""The Run Store API's front door (ASGI middleware), run before any route reads a body.

* Every request but to the open paths (``/health``, the docs) must carry a known bearer
  token: a missing or unknown one gets 401 at once, its body never read.
* A body over ``max_body_bytes`` gets 413: by its ``Content-Length`` before it is read, or,
  without one (chunked), as soon as the bytes received pass the limit.

The scope of the token (worker, submitter) is checked later, by the route's dependency.
"""

from __future__ import annotations

from collections.abc import Collection

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .auth import TokenTable
from .errors import BodyTooLarge, RunStoreError, Unauthorized

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def error_response(exc: RunStoreError) -> JSONResponse:
    """The API's JSON error: ``{"error": "<class name>", "detail": "<message>"}``."""
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
    return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, exc.status, headers=headers)


def bearer_token(headers: Headers) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def authenticate(tokens: TokenTable, headers: Headers) -> Unauthorized | None:
    """Why the request may not go on (a missing or unknown token), or None."""
    token = bearer_token(headers)
    if token is None:
        return Unauthorized("missing bearer token (Authorization: Bearer <token>)")
    if tokens.scope_of(token) is None:
        return Unauthorized("unknown bearer token")
    return None


def declared_too_large(headers: Headers, limit: int) -> BodyTooLarge | None:
    """A ``BodyTooLarge`` when the request's ``Content-Length`` is over ``limit``."""
    try:
        declared = int(headers.get("content-length", "0"))
    except ValueError:
        return None  # the HTTP server rejects a malformed Content-Length itself
    return too_large(limit) if declared > limit else None


def too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"the request body is over the limit of {limit} bytes")


class _CappedBody:
    """A request's receive and send: counts body bytes and, past the limit, refuses."""

    def __init__(self, receive: Receive, send: Send, limit: int) -> None:
        self._receive, self._send, self.limit = receive, send, limit
        self.received = 0
        self.exceeded = False
        self.started = False

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.exceeded = True
                raise too_large(self.limit)
        return message

    async def send(self, message: Message) -> None:
        if self.exceeded and not self.started:
            return  # whatever the app makes of the refused body, the answer is 413
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


class Guard:
    """ASGI middleware: authentication and the body size cap, before any route runs."""

    def __init__(
        self, app: ASGIApp, *, tokens: TokenTable, max_body_bytes: int, open_paths: Collection[str]
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.max_body_bytes = max_body_bytes
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self.refusal(scope["path"], headers)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        body = _CappedBody(receive, send, self.max_body_bytes)
        try:
            await self.app(scope, body.receive, body.send)
        except Exception:
            if not body.exceeded or body.started:
                raise
        if body.exceeded and not body.started:
            await error_response(too_large(self.max_body_bytes))(scope, receive, send)

    def refusal(self, path: str, headers: Headers) -> RunStoreError | None:
        """The error that ends the request before the app sees it, or None."""
        if path not in self.open_paths:
            unauthorized = authenticate(self.tokens, headers)
            if unauthorized is not None:
                return unauthorized
        return declared_too_large(headers, self.max_body_bytes)
