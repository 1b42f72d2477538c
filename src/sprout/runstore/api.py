"""HTTP API of the Run Store (FastAPI).

    python -m sprout.runstore.api --db URL --host 127.0.0.1 --port 8470 --tokens TOKENS_FILE

Every route but ``/health`` and the docs needs ``Authorization: Bearer <token>``: a
missing or unknown token gets 401 before the body is read, a token of the wrong scope
403. A body over ``--max-body-bytes`` gets 413, a number out of range 422. Errors are
JSON ``{"error": "<class name>", "detail": "<message>"}``; the client turns them back
into the classes of ``sprout.runstore.errors``.
"""

import argparse
import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from . import sse
from .auth import Scope, TokensFileError, TokenTable, load_tokens
from .errors import Forbidden, HostNotFound, InvalidRequest, RunStoreError, StoreOpenError, Unauthorized
from .guard import DEFAULT_MAX_BODY_BYTES, Guard, error_response
from .models import (
    INT64_MAX,
    INT64_MIN,
    Claim,
    ClaimRequest,
    CompleteRequest,
    Event,
    FailRequest,
    HeartbeatRequest,
    Host,
    HostRequest,
    Job,
    JobPage,
    JobSpec,
    JobState,
    LeaseRequest,
    SubmitBatch,
)
from .notify import Changes
from .store import MAX_PAGE, RunStore

log = logging.getLogger("sprout.runstore.api")

MAX_WAIT_S = 60.0  # longest long-poll (claim, events)
POLL_S = 0.5  # how often a long-poll looks at the database for changes made by other processes
KEEPALIVE_S = 15.0  # SSE comment sent when a stream has been quiet this long

JobId = Annotated[int, Path(ge=INT64_MIN, le=INT64_MAX)]
Seq = Annotated[int, Query(ge=0, le=INT64_MAX)]


def validation_detail(exc: RequestValidationError) -> str:
    """One line for a request's validation errors: ``where: what; ...``."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error.get("loc", ()))
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def create_app(
    store: RunStore,
    tokens: TokenTable | Mapping[str, str],
    *,
    poll_s: float = POLL_S,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The API over ``store``; ``tokens`` maps sha256 hex digests of tokens to scopes.
    Request bodies over ``max_body_bytes`` are refused (413)."""
    table = tokens if isinstance(tokens, TokenTable) else TokenTable(dict(tokens))
    changes = Changes()
    bearer = HTTPBearer(auto_error=False, description="A token of scope worker, submitter or admin")
    app = FastAPI(
        title="Sprout Run Store",
        version="1",
        description="Jobs (rollout, grade, review, gate) claimed by workers under leases.",
    )
    open_paths = {"/health", app.docs_url, app.redoc_url, app.openapi_url, app.swagger_ui_oauth2_redirect_url}
    app.add_middleware(
        Guard, tokens=table, max_body_bytes=max_body_bytes, open_paths={p for p in open_paths if p}
    )

    def require(scope: Scope) -> Any:
        def check(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
            if credentials is None:
                raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
            granted = table.scope_of(credentials.credentials)
            if granted is None:
                raise Unauthorized("unknown bearer token")
            if not granted.allows(scope):
                raise Forbidden(f"a {granted.value} token may not do {scope.value} operations")

        return Depends(check)

    worker = [require(Scope.WORKER)]
    submitter = [require(Scope.SUBMITTER)]

    @app.exception_handler(RunStoreError)
    async def store_error(_request: Request, exc: RunStoreError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidRequest(validation_detail(exc)))

    @app.exception_handler(ValueError)
    async def value_error(_request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse({"error": "InvalidRequest", "detail": str(exc)}, 422)

    async def call(fn: Callable[..., Any], *args: Any, changed: bool = True, **kwargs: Any) -> Any:
        result = await run_in_threadpool(fn, *args, **kwargs)
        if changed:
            changes.notify()
        return result

    @app.get("/health", tags=["health"])
    async def health() -> JSONResponse:
        try:
            version = await call(store.schema_version, changed=False)
        except Exception:
            log.exception("health check failed")
            return JSONResponse({"status": "unavailable"}, 503)
        return JSONResponse({"status": "ok", "database": store.dialect, "schema_version": version})

    # -- submitter ---------------------------------------------------------------------

    @app.post("/v1/jobs", status_code=201, dependencies=submitter, tags=["submitter"])
    async def submit(spec: JobSpec) -> Job:
        return (await call(store.submit_many, [spec]))[0]

    @app.post("/v1/jobs/batch", status_code=201, dependencies=submitter, tags=["submitter"])
    async def submit_many(batch: SubmitBatch) -> list[Job]:
        return await call(store.submit_many, batch.jobs)

    @app.get("/v1/jobs", dependencies=submitter, tags=["submitter"])
    async def list_jobs(
        state: JobState | None = None,
        kind: str | None = None,
        group_id: str | None = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
        cursor: Annotated[int | None, Query(ge=INT64_MIN, le=INT64_MAX)] = None,
    ) -> JobPage:
        return await call(store.list, state, kind, group_id, limit, cursor, changed=False)

    @app.get("/v1/jobs/{job_id}", dependencies=submitter, tags=["submitter"])
    async def get_job(job_id: JobId) -> Job:
        return await call(store.get, job_id, changed=False)

    @app.post("/v1/jobs/{job_id}/cancel", dependencies=submitter, tags=["submitter"])
    async def cancel(job_id: JobId) -> Job:
        return await call(store.cancel, job_id)

    @app.get(
        "/v1/groups/{group_id}/events",
        dependencies=submitter,
        tags=["submitter"],
        response_model=list[Event],
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def group_events(
        group_id: str,
        after_seq: Seq = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
        wait_s: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 0.0,
        accept: Annotated[str, Header()] = "application/json",
        last_event_id: Annotated[int | None, Header(ge=0, le=INT64_MAX)] = None,
    ) -> Any:
        """Events with ``seq > after_seq``. JSON: long-polls up to ``wait_s`` for the first one.
        With ``Accept: text/event-stream``: an endless SSE stream (resumes after ``Last-Event-ID``)."""
        if "text/event-stream" in accept:
            start = last_event_id if last_event_id is not None else after_seq
            return StreamingResponse(stream(group_id, start), media_type="text/event-stream")
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            ticket = changes.ticket()
            found = await call(store.events, group_id, after_seq, limit, changed=False)
            remaining = deadline - asyncio.get_running_loop().time()
            if found or remaining <= 0:
                return found
            await changes.wait(ticket, min(poll_s, remaining))

    async def stream(group_id: str, after_seq: int) -> AsyncIterator[str]:
        quiet_since = asyncio.get_running_loop().time()
        while True:
            ticket = changes.ticket()
            found = await call(store.events, group_id, after_seq, changed=False)
            for event in found:
                yield sse.format_event(event)
                after_seq = event.seq
            now = asyncio.get_running_loop().time()
            if found:
                quiet_since = now
                continue
            if now - quiet_since >= KEEPALIVE_S:
                yield sse.KEEPALIVE
                quiet_since = now
            await changes.wait(ticket, poll_s)

    # -- worker ------------------------------------------------------------------------

    @app.post("/v1/claims", dependencies=worker, tags=["worker"])
    async def claim(req: ClaimRequest) -> list[Claim]:
        """Lease up to ``limit`` jobs; long-polls up to ``wait_s`` when none is claimable."""
        deadline = asyncio.get_running_loop().time() + min(req.wait_s, MAX_WAIT_S)
        while True:
            ticket = changes.ticket()
            claims = await call(
                store.claim, req.worker_id, req.host, req.kinds, req.limit, req.lease_s, changed=False
            )
            remaining = deadline - asyncio.get_running_loop().time()
            if claims:
                changes.notify()
                return claims
            if remaining <= 0:
                return claims
            await changes.wait(ticket, min(poll_s, remaining))

    @app.post("/v1/jobs/{job_id}/heartbeat", dependencies=worker, tags=["worker"])
    async def heartbeat(job_id: JobId, req: HeartbeatRequest) -> Job:
        return await call(store.heartbeat, job_id, req.lease_token, req.extend_s, changed=False)

    @app.post("/v1/jobs/{job_id}/complete", dependencies=worker, tags=["worker"])
    async def complete(job_id: JobId, req: CompleteRequest) -> Job:
        return await call(store.complete, job_id, req.lease_token, req.result)

    @app.post("/v1/jobs/{job_id}/fail", dependencies=worker, tags=["worker"])
    async def fail(job_id: JobId, req: FailRequest) -> Job:
        return await call(store.fail, job_id, req.lease_token, req.error, req.retry)

    @app.post("/v1/jobs/{job_id}/release", dependencies=worker, tags=["worker"])
    async def release(job_id: JobId, req: LeaseRequest) -> Job:
        return await call(store.release, job_id, req.lease_token)

    @app.put("/v1/hosts/{name}", dependencies=worker, tags=["worker"])
    async def register_host(name: str, req: HostRequest) -> Host:
        """A worker says it runs on ``name`` and where it serves that host's checkpoints."""
        return await call(store.register_host, name, req.ship_url, changed=False)

    @app.get("/v1/hosts/{name}", dependencies=worker, tags=["worker"])
    async def get_host(name: str) -> Host:
        host = await call(store.host, name, changed=False)
        if host is None:
            raise HostNotFound(f"no worker has registered host {name!r}")
        return host

    return app


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from ..jobs.payloads import job_kinds

    parser = argparse.ArgumentParser(
        prog="python -m sprout.runstore.api", description="Serve the Sprout Run Store API."
    )
    parser.add_argument(
        "--db", required=True, help="a SQLite file path, sqlite:///PATH or postgresql+psycopg://..."
    )
    parser.add_argument(
        "--tokens", required=True, help='JSON file {"<sha256 hex>": "worker"|"submitter"|"admin"}'
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument(
        "--endpoints", default="", metavar="NAME,...",
        help="model endpoint names the workers have configured (services.json); jobs may name only these",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body accepted; bigger ones get 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    args = parser.parse_args(argv)
    try:
        tokens = load_tokens(args.tokens)
        store = RunStore(args.db, job_kinds([n for n in args.endpoints.split(",") if n]))
    except (TokensFileError, StoreOpenError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        uvicorn.run(
            create_app(store, tokens, max_body_bytes=args.max_body_bytes),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
        )
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
