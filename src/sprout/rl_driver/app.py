"""The HTTP API Miles' rollout function calls: POST, GET and DELETE /rollout-groups[/{id}].

GET /health answers without a token (for supervisors). POST answers 202 `{rollout_job_id, status}`
once the group is in the ledger (the work runs in the background); GET answers the group's result (valid while queued or running, with the samples done so
far); DELETE cancels unfinished work and answers the group's terminal status. Errors are FastAPI
`{"detail": ...}` bodies: 400 a task the driver cannot serve, 401 a missing or wrong bearer token, 404
an unknown id, 409 an id reused with another body, 413 an oversized body, 422 a body that breaks the
contract (the fields named; values are never echoed).
"""

import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from ..sandbox import SproutError, Store
from .config import DriverConfig, TaskNotServed, served_task_dirs
from .groups import Driver, GroupConflict, GroupNotFound, RequestRefused
from .ledger import Ledger
from .protocol import RolloutGroupRequest
from .samples import LocalSamples, RunStoreSamples

log = logging.getLogger("sprout.rl_driver")
RUNSTORE_WAITERS = 256  # threads that wait on Run Store jobs (the workers run them)


def make_driver(config: DriverConfig) -> Driver:
    """The driver with its ledger and where its samples run: Run Store jobs when one is configured,
    else `local_slots` slots in this process."""
    ledger = Ledger(config.ledger_url)
    runstore = config.runstore()
    if runstore is not None:
        from ..runstore.client import RunStoreClient

        client = RunStoreClient(*runstore)
        samples = RunStoreSamples(client, config.poll_interval_s, config.backend, config.branch_affinity_s)
        if config.prepare_hosts:
            samples.prepare(served_task_dirs(config))
        return Driver(config, ledger, samples, slots=RUNSTORE_WAITERS)
    # with an owner: a killed driver's leftovers are reaped
    store = Store(runtime_bin=config.runtime_bin, owner={"worker": "rl-driver"}, backend=config.backend)
    try:  # what a killed driver left: its unfinished samples' sandboxes and checkpoints, half-made subvolumes
        for line in store.gc():
            log.info("reaped %s", line)
    except SproutError as e:
        log.warning("could not clean up what a killed driver left: %s", e)
    return Driver(config, ledger, LocalSamples(store), slots=config.local_slots)


def create_app(config: DriverConfig, driver: Driver | None = None) -> FastAPI:
    driver = driver or make_driver(config)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        driver.start()
        try:
            yield
        finally:
            await run_in_threadpool(driver.close)

    app = FastAPI(title="Sprout RL driver", lifespan=lifespan)
    app.state.driver = driver

    @app.middleware("http")
    async def guard(request: Request, call_next):
        token = config.driver_token()
        if request.url.path == "/health":
            return await call_next(request)
        sent = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        if token and not hmac.compare_digest(sent, f"Bearer {token}".encode()):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer $SPROUT_RL_DRIVER_TOKEN)")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > config.max_request_bytes):
            return _error(413, f"request body over {config.max_request_bytes} bytes")
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/rollout-groups", status_code=202)
    async def submit(request: Request):
        body = await _body(request, config.max_request_bytes)
        try:
            group = RolloutGroupRequest.model_validate_json(body)
        except ValidationError as e:
            return _error(422, _problems(e))
        return _json(await run_in_threadpool(driver.submit, group), 202)

    @app.get("/rollout-groups/{rollout_job_id}")
    async def get(rollout_job_id: str):
        return _json(await run_in_threadpool(driver.result, rollout_job_id))

    @app.delete("/rollout-groups/{rollout_job_id}")
    async def cancel(rollout_job_id: str):
        return _json(await run_in_threadpool(driver.delete, rollout_job_id))

    for error, status in ((TaskNotServed, 400), (RequestRefused, 400), (GroupNotFound, 404), (GroupConflict, 409)):
        app.add_exception_handler(error, lambda _request, exc, status=status: _error(status, str(exc)))
    app.add_exception_handler(_TooLarge, lambda _request, _exc: _error(
        413, f"request body over {config.max_request_bytes} bytes"))
    return app


class _TooLarge(Exception):
    pass


async def _body(request: Request, limit: int) -> bytes:
    """The body, read up to `limit` bytes (a chunked body has no Content-Length to check first)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


def _problems(error: ValidationError) -> str:
    """What is wrong, by field, without the values sent (they may hold anything)."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in error.errors())


def _json(model: BaseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), status_code=status)


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)
