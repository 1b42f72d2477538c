"""HTTP client of the Run Store, with the methods of ``RunStore`` and the same models.

Connection errors and 5xx answers are retried with backoff for up to ``retry_for_s``
(so a worker rides out an API restart); 401, 403, 404 and 409 raise the typed errors
of ``sprout.runstore.errors`` (``Unauthorized``, ``Forbidden``, ``JobNotFound``,
``LeaseLost``, ...). ``submit`` adds an idempotency key when none is given, so a
retried submit cannot create a second job.
"""

from __future__ import annotations

import builtins
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Self

import httpx
from pydantic import TypeAdapter

from ..settings import settings
from . import sse
from .errors import ERRORS_BY_NAME, ApiError, Forbidden, RunStoreError, Unauthorized
from .models import (
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
)

_jobs = TypeAdapter(list[Job])
_claims = TypeAdapter(list[Claim])
_events = TypeAdapter(list[Event])

_STREAM_READ_TIMEOUT_S = 45.0  # the server sends a keepalive every 15 s


class RunStoreClient:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        retry_for_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s
        self._retry_for_s = retry_for_s
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
            transport=transport,
        )

    @classmethod
    def from_env(cls, **kwargs: Any) -> RunStoreClient:
        """A client for ``SPROUT_RUNSTORE_URL`` with the token ``SPROUT_RUNSTORE_TOKEN``."""
        config = settings()
        url, token = config.runstore_url, config.runstore_token
        missing = [
            name
            for name, value in (("SPROUT_RUNSTORE_URL", url), ("SPROUT_RUNSTORE_TOKEN", token))
            if not value
        ]
        if missing:
            raise RunStoreError(f"set {' and '.join(missing)} to reach the Run Store")
        return cls(url or "", token or "", **kwargs)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health")

    # -- submitter ---------------------------------------------------------------------

    def submit(self, kind: str, payload: dict[str, Any] | None = None, **opts: Any) -> Job:
        return self.submit_many([JobSpec(kind=kind, payload=payload or {}, **opts)])[0]

    def submit_many(self, specs: Iterable[JobSpec | dict[str, Any]]) -> list[Job]:
        jobs = [s if isinstance(s, JobSpec) else JobSpec.model_validate(s) for s in specs]
        body = [
            (
                s
                if s.idempotency_key
                else s.model_copy(update={"idempotency_key": f"client-{uuid.uuid4().hex}"})
            )
            for s in jobs
        ]
        data = self._request(
            "POST", "/v1/jobs/batch", json={"jobs": [s.model_dump(mode="json") for s in body]}
        )
        return _jobs.validate_python(data)

    def get(self, job_id: int) -> Job:
        return Job.model_validate(self._request("GET", f"/v1/jobs/{job_id}"))

    def cancel(self, job_id: int) -> Job:
        return Job.model_validate(self._request("POST", f"/v1/jobs/{job_id}/cancel"))

    def events(
        self, group_id: str, after_seq: int = 0, limit: int = 1000, wait_s: float = 0.0
    ) -> list[Event]:
        """Events of a group after ``after_seq``; with ``wait_s``, waits that long for the first."""
        params = {"after_seq": after_seq, "limit": limit, "wait_s": wait_s}
        data = self._request(
            "GET", f"/v1/groups/{group_id}/events", params=params, timeout=self._timeout_s + wait_s
        )
        return _events.validate_python(data)

    def stream_events(self, group_id: str, after_seq: int = 0) -> Iterator[Event]:
        """Follow a group's events over Server-Sent Events, reconnecting after errors; endless."""
        last_ok = time.monotonic()
        delay = 0.1
        while True:
            headers = {"Accept": "text/event-stream", "Last-Event-ID": str(after_seq)}
            timeout = httpx.Timeout(self._timeout_s, read=_STREAM_READ_TIMEOUT_S)
            failure: RunStoreError | None = None
            try:
                with self._http.stream(
                    "GET", f"/v1/groups/{group_id}/events", headers=headers, timeout=timeout
                ) as resp:
                    if resp.is_success:
                        last_ok = time.monotonic()
                        for event in sse.parse_events(resp.iter_lines()):
                            after_seq = event.seq
                            last_ok = time.monotonic()
                            delay = 0.1
                            yield event
                    else:
                        resp.read()
                        failure = _error(resp)
                        if resp.status_code < 500:
                            raise failure
            except httpx.TransportError as exc:
                failure = ApiError(f"lost the event stream from {self.url}: {exc}")
            if failure is not None and time.monotonic() - last_ok > self._retry_for_s:
                raise failure
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    # -- worker ------------------------------------------------------------------------

    def claim(
        self,
        worker_id: str,
        host: str,
        kinds: Sequence[str] | None = None,
        limit: int = 1,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
        retry_for_s: float | None = None,
    ) -> list[Claim]:
        """Lease up to ``limit`` jobs; with ``wait_s``, long-poll that long when none is ready.
        ``retry_for_s`` overrides the client's retry window (0: one try, for a caller's own loop)."""
        req = ClaimRequest(
            worker_id=worker_id,
            host=host,
            kinds=list(kinds) if kinds is not None else None,
            limit=limit,
            lease_s=lease_s,
            wait_s=wait_s,
        )
        data = self._request(
            "POST",
            "/v1/claims",
            json=req.model_dump(mode="json"),
            timeout=self._timeout_s + wait_s,
            retry_for_s=retry_for_s,
        )
        return _claims.validate_python(data)

    def heartbeat(self, job_id: int, lease_token: int, extend_s: float = 60.0) -> Job:
        return self._lease_call(
            job_id, "heartbeat", HeartbeatRequest(lease_token=lease_token, extend_s=extend_s)
        )

    def complete(self, job_id: int, lease_token: int, result: Any = None) -> Job:
        return self._lease_call(job_id, "complete", CompleteRequest(lease_token=lease_token, result=result))

    def fail(self, job_id: int, lease_token: int, error: str, retry: bool = True) -> Job:
        return self._lease_call(
            job_id, "fail", FailRequest(lease_token=lease_token, error=error, retry=retry)
        )

    def release(self, job_id: int, lease_token: int) -> Job:
        return self._lease_call(job_id, "release", LeaseRequest(lease_token=lease_token))

    def register_host(self, name: str, ship_url: str | None, retry_for_s: float | None = None) -> Host:
        body = HostRequest(ship_url=ship_url).model_dump(mode="json")
        return Host.model_validate(
            self._request("PUT", f"/v1/hosts/{name}", json=body, retry_for_s=retry_for_s)
        )

    def hosts(self, seen_within_s: float = 180.0) -> builtins.list[Host]:
        """The live hosts: those whose workers registered within `seen_within_s`."""
        data = self._request("GET", "/v1/hosts", params={"seen_within_s": seen_within_s})
        return [Host.model_validate(h) for h in data]

    def host(self, name: str) -> Host:
        """The host a worker registered (raises HostNotFound)."""
        return Host.model_validate(self._request("GET", f"/v1/hosts/{name}"))

    def list(
        self,
        state: JobState | str | None = None,
        kind: str | None = None,
        group_id: str | None = None,
        limit: int = 100,
        cursor: int | None = None,
    ) -> JobPage:
        params = {"state": state, "kind": kind, "group_id": group_id, "limit": limit, "cursor": cursor}
        data = self._request("GET", "/v1/jobs", params={k: v for k, v in params.items() if v is not None})
        return JobPage.model_validate(data)

    # -- internals ---------------------------------------------------------------------

    def _lease_call(self, job_id: int, action: str, req: LeaseRequest) -> Job:
        return Job.model_validate(
            self._request("POST", f"/v1/jobs/{job_id}/{action}", json=req.model_dump(mode="json"))
        )

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
        retry_for_s: float | None = None,
    ) -> Any:
        deadline = time.monotonic() + (self._retry_for_s if retry_for_s is None else retry_for_s)
        delay = 0.1
        while True:
            try:
                resp = self._http.request(
                    method, path, json=json, params=params, timeout=timeout or self._timeout_s
                )
            except httpx.TransportError as exc:
                if time.monotonic() + delay > deadline:
                    raise ApiError(f"cannot reach the Run Store at {self.url}: {exc}") from exc
            else:
                if resp.is_success:
                    return resp.json()
                if resp.status_code < 500 or time.monotonic() + delay > deadline:
                    raise _error(resp)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def _error(resp: httpx.Response) -> RunStoreError:
    try:
        body = resp.json()
    except ValueError:
        body = {"detail": resp.text}
    name = body.get("error") if isinstance(body, dict) else None
    detail = body.get("detail") if isinstance(body, dict) else body
    if not isinstance(detail, str):
        detail = f"{detail}"
    cls = ERRORS_BY_NAME.get(name or "") or {401: Unauthorized, 403: Forbidden}.get(resp.status_code)
    if cls is not None:
        return cls(detail)
    error = ApiError(f"HTTP {resp.status_code} from {resp.request.method} {resp.request.url.path}: {detail}")
    error.status = resp.status_code
    return error
