"""Shipping checkpoints between worker hosts: each worker serves its store over HTTP, and a worker
that claims a job whose checkpoint is on another host pulls it (sprout.sandbox.ship).

    GET /v1/formats                      the stream formats this host sends ({"formats": ["btrfs", "tar"]};
                                         a rootless host sends tar only)
    GET /v1/checkpoints/{id}             the checkpoint's metadata (404: not here)
    GET /v1/images/{key}                 an image's metadata
    GET /v1/send/{kind}/{name}[?format=F&parent_kind=K&parent=P]
                                         the stream of images/NAME or checkpoints/NAME in format F
                                         (default btrfs), made against P when given (incremental)

Requests carry the workers' token (Bearer); workers that ship to each other share it. A worker
registers its server's URL with the Run Store (`hosts`), where the claimer looks it up by the
claim's `ship_from`. The stream is incremental against the newest ancestor the receiver holds
(sprout.sandbox.ship.receive), so a branch a few turns on usually moves only those turns' blocks.
"""

import hashlib
import hmac
import json
import logging
import re
import socket
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

import httpx

from ..jobs.payloads import Shipped
from ..runstore.client import RunStoreClient
from ..runstore.errors import HostNotFound
from ..runstore.models import Claim
from ..sandbox import Store
from ..sandbox.errors import CommandError, ImageNotFound, SproutError
from ..sandbox.ship import (
    CHUNK,
    CheckpointMeta,
    Format,
    ImageMeta,
    Kind,
    SendStream,
    StoreSource,
    holds,
    receive,
)

log = logging.getLogger("sprout.shipping")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")  # ids and image keys; never a path
KINDS: tuple[Kind, ...] = ("images", "checkpoints")


class CheckpointUnavailable(SproutError):
    """A job's checkpoint cannot be had from the host that holds it (gone, or never serving): trying the
    job again elsewhere cannot help, so its worker fails it without a retry."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class ShipServer:
    """Serves `store` to other hosts on `bind`:`port` (0: any free port) until `stop()`."""

    def __init__(self, store: Store, token: str, *, bind: str = "127.0.0.1", port: int = 0,
                 advertise: str | None = None):
        source, expected = StoreSource(store), _digest(token)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
                log.debug("ship server: " + format, *args)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
                if not hmac.compare_digest(_digest(given), expected):
                    return self._json(401, {"detail": "a worker token is required"})
                url = urlsplit(self.path)
                parts = url.path.strip("/").split("/")
                try:
                    match parts:
                        case ["v1", "formats"]:
                            return self._json(200, {"formats": list(source.formats())})
                        case ["v1", "checkpoints", name] if NAME.match(name):
                            meta = source.checkpoint(name)
                            if meta is None:
                                return self._json(404, {"detail": f"checkpoint {name} is not on this host"})
                            return self._json(200, asdict(meta))
                        case ["v1", "images", name] if NAME.match(name):
                            return self._json(200, asdict(source.image(name)))
                        case ["v1", "send", kind, name] if kind in KINDS and NAME.match(name):
                            return self._send(kind, name, parse_qs(url.query))
                    return self._json(404, {"detail": f"no such path {url.path}"})
                except ImageNotFound as e:
                    return self._json(404, {"detail": str(e)})
                except SproutError as e:
                    return self._json(500, {"detail": str(e)})

            def _send(self, kind: Kind, name: str, query: dict[str, list[str]]) -> None:
                parent_kind, parent = query.get("parent_kind", [""])[0], query.get("parent", [""])[0]
                fmt = query.get("format", ["btrfs"])[0]
                if parent and (parent_kind not in KINDS or not NAME.match(parent)):
                    return self._json(400, {"detail": "parent_kind must be images or checkpoints, with a parent name"})
                if fmt not in source.formats():
                    return self._json(400, {"detail": f"this host sends {', '.join(source.formats())} streams, "
                                                      f"not {fmt}"})
                if not (store.root / kind / name).is_dir():
                    return self._json(404, {"detail": f"{kind}/{name} is not on this host"})
                stream = source.send(kind, name, (cast(Kind, parent_kind), parent) if parent else None,
                                     cast(Format, fmt))
                try:
                    first = next(stream, b"")
                except CommandError as e:  # e.g. no such parent here: the receiver tries another
                    return self._json(409, {"detail": str(e)})
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                try:
                    self.wfile.write(first)
                    for chunk in stream:
                        self.wfile.write(chunk)
                except (CommandError, OSError) as e:  # the receiver sees a truncated stream and fails
                    log.warning("ship server: sending %s/%s stopped: %s", kind, name, e)
                finally:
                    stream.close()

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer((bind, port), Handler)
        self._server.daemon_threads = True
        host = bind if bind not in ("", "0.0.0.0", "::") else socket.getfqdn()
        self.url = advertise or f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="ship-server", daemon=True)

    def start(self) -> "ShipServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "ShipServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HttpSource:
    """Another host's ShipServer, as a ShipSource for sprout.sandbox.ship.receive."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"},
                                  timeout=httpx.Timeout(timeout_s, read=None))
        self._formats: tuple[Format, ...] | None = None

    def _get(self, path: str) -> httpx.Response:
        try:
            response = self._http.get(path)
        except httpx.ConnectError as e:  # nothing listens there any more: the host or its worker is gone
            raise CheckpointUnavailable(f"its checkpoint server at {self.url} does not answer ({e})") from None
        except httpx.TransportError as e:
            raise SproutError(f"cannot reach the checkpoint server at {self.url}: {e}") from None
        if response.status_code == 401:
            raise SproutError(f"{self.url} refused this worker's token (workers that ship must share one)")
        return response

    def formats(self) -> tuple[Format, ...]:
        if self._formats is None:
            sent = self._get("/v1/formats").raise_for_status().json()["formats"]
            self._formats = tuple(cast(Format, f) for f in sent if f in ("btrfs", "tar"))
        return self._formats

    def checkpoint(self, checkpoint_id: str) -> CheckpointMeta | None:
        response = self._get(f"/v1/checkpoints/{checkpoint_id}")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return CheckpointMeta(**response.json())

    def image(self, key: str) -> ImageMeta:
        response = self._get(f"/v1/images/{key}")
        if response.status_code == 404:
            raise ImageNotFound(response.json().get("detail", f"image {key} is not on {self.url}"))
        response.raise_for_status()
        return ImageMeta(**response.json())

    def send(self, kind: Kind, name: str, parent: tuple[Kind, str] | None, fmt: Format) -> SendStream:
        params = {"format": fmt, **({"parent_kind": parent[0], "parent": parent[1]} if parent else {})}
        try:
            with self._http.stream("GET", f"/v1/send/{kind}/{name}", params=params) as response:
                if response.status_code != 200:
                    response.read()
                    raise CommandError(f"{self.url}: sending {kind}/{name} failed "
                                       f"(HTTP {response.status_code}): {response.text.strip()}")
                yield from response.iter_bytes(CHUNK)
        except httpx.TransportError as e:
            raise CommandError(f"{self.url}: the stream of {kind}/{name} broke: {e}") from None

    def close(self) -> None:
        self._http.close()


def job_checkpoint(claim: Claim) -> str | None:
    """The checkpoint a job works from: a branch's `from_checkpoint`, a grade's `checkpoint_id`."""
    payload = claim.job.payload
    return payload.get("from_checkpoint") or payload.get("checkpoint_id")


def fetch_checkpoint(claim: Claim, client: RunStoreClient, store: Store, token: str) -> Shipped | None:
    """Before a job claimed away from its preferred host runs: ships its checkpoint here from that
    host's checkpoint server. Returns what was shipped (recorded in the job's result), None when
    nothing had to move."""
    checkpoint = job_checkpoint(claim)
    if not claim.ship_from or not checkpoint or holds(store, checkpoint):
        return None
    try:
        host = client.host(claim.ship_from)
    except HostNotFound:
        raise CheckpointUnavailable(f"checkpoint {checkpoint} is on host {claim.ship_from}, which no worker has "
                                    "registered") from None
    if not host.ship_url:
        raise CheckpointUnavailable(f"checkpoint {checkpoint} is on host {claim.ship_from}, whose worker serves no "
                                    "checkpoints (start it with --ship-listen)")
    source = HttpSource(host.ship_url, token)
    try:
        report = receive(store, source, checkpoint)
    except CheckpointUnavailable as e:
        raise CheckpointUnavailable(f"checkpoint {checkpoint} exists only on host {claim.ship_from}, and {e}: "
                                    "the host is down or its worker is gone, so nothing can start from it") from None
    finally:
        source.close()
    log.info("job %d: shipped %s from %s (%s, %d bytes, %.2fs)", claim.job.id, checkpoint, claim.ship_from,
             f"incremental against {report.parent}" if report.parent else "full", report.bytes_sent, report.seconds)
    return Shipped(host=claim.ship_from, checkpoint=checkpoint, subvolumes=report.shipped, parent=report.parent,
                   bytes=report.bytes_sent, seconds=round(report.seconds, 3))
