"""HTTP API of the Run Store (FastAPI): `create_app(store, tokens)`; `sprout runstore serve` serves it.

Every route but ``/health`` and the docs needs ``Authorization: Bearer <token>``: a
missing or unknown token gets 401 before the body is read, a token of the wrong scope
403. A body over ``--max-body-bytes`` gets 413, a number out of range 422. Errors are
JSON ``{"error": "<class name>", "detail": "<message>"}``; the client turns them back
into the classes of ``sprout.runstore.errors``.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from . import sse
from .auth import Scope, TokenTable
from .errors import Forbidden, HostNotFound, InvalidRequest, RunStoreError, Unauthorized
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
    app = FastAPI(
        title="Sprout Run Store",
        version="1",
        description="Jobs (rollout, grade, review, gate) claimed by workers under leases.",
    )
    open_paths = {"/health", app.docs_url, app.redoc_url, app.openapi_url, app.swagger_ui_oauth2_redirect_url}
    app.add_middleware(
        Guard, tokens=table, max_body_bytes=max_body_bytes, open_paths={p for p in open_paths if p}
    )
    _add_error_handlers(app)
    api = _Api(store, Changes(), poll_s)
    bearer = HTTPBearer(auto_error=False, description="A token of scope worker, submitter or admin")

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

    @app.get("/health", tags=["health"])
    async def health() -> JSONResponse:
        try:
            version = await api.call(store.schema_version, changed=False)
        except Exception:
            log.exception("health check failed")
            return JSONResponse({"status": "unavailable"}, 503)
        return JSONResponse({"status": "ok", "database": store.dialect, "schema_version": version})

    _add_submitter_routes(app, api, [require(Scope.SUBMITTER)])
    _add_host_list_route(app, api, [require(Scope.SUBMITTER)])
    _add_worker_routes(app, api, [require(Scope.WORKER)])
    return app


def _add_host_list_route(app: FastAPI, api: "_Api", submitter: list[Any]) -> None:
    @app.get("/v1/hosts", dependencies=submitter, tags=["submitter"])
    async def list_hosts(seen_within_s: Annotated[float, Query(gt=0, le=86400)] = 180.0) -> list[Host]:
        """The hosts whose workers registered within `seen_within_s` (they do every minute)."""
        return await api.call(api.store.hosts, seen_within_s, changed=False)


class _Api:
    """What the routes share: the store, the change notifier that wakes long-polls, how often they look."""

    def __init__(self, store: RunStore, changes: Changes, poll_s: float) -> None:
        self.store, self.changes, self.poll_s = store, changes, poll_s

    async def call(self, fn: Callable[..., Any], *args: Any, changed: bool = True, **kwargs: Any) -> Any:
        """`fn` in a worker thread (the store blocks); `changed`: wake the long-polls afterwards."""
        result = await run_in_threadpool(fn, *args, **kwargs)
        if changed:
            self.changes.notify()
        return result


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RunStoreError)
    async def store_error(_request: Request, exc: RunStoreError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidRequest(validation_detail(exc)))

    @app.exception_handler(ValueError)
    async def value_error(_request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse({"error": "InvalidRequest", "detail": str(exc)}, 422)


def _add_submitter_routes(app: FastAPI, api: _Api, submitter: list[Any]) -> None:
    store, changes, poll_s, call = api.store, api.changes, api.poll_s, api.call

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


def _add_worker_routes(app: FastAPI, api: _Api, worker: list[Any]) -> None:
    store, changes, poll_s, call = api.store, api.changes, api.poll_s, api.call

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


def serve(store: RunStore, tokens: TokenTable, *, host: str = "127.0.0.1", port: int = 8470,
          log_level: str = "info", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Serves the API over `store` until interrupted; the store is closed at the end."""
    import uvicorn

    try:
        uvicorn.run(create_app(store, tokens, max_body_bytes=max_body_bytes), host=host, port=port,
                    log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        store.close()


if __name__ == "__main__":  # the seed's form of `sprout runstore serve`
    from ..cli import alias

    alias("sprout.runstore.api")
