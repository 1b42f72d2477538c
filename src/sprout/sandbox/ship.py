"""Shipping checkpoints between stores, incrementally when possible.

A checkpoint is sent against its newest ancestor (parent chain, then its image) that the receiving store
already holds, so usually only the turn's changes travel (~13 ms for a 1 MiB delta, against seconds for
a full rootfs). The image a checkpoint needs is shipped first when the receiver lacks it. Streams are
`btrfs send | btrfs receive` where both ends run as root, and sprout.sandbox.tarstream's where either
is rootless (it can neither send nor receive an incremental btrfs stream); the receiver picks.
`receive(dst, source, id)` pulls from any `ShipSource`: `StoreSource` is another store on this machine
(`ship` joins the two), sprout.worker.shipping serves a store over HTTP to other hosts.
"""

import time
from collections.abc import Generator
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

from .. import rootless
from . import btrfs, shell, tarstream
from .errors import CheckpointNotFound, CommandError, ImageNotFound
from .store import Store

Kind = Literal["images", "checkpoints"]
Format = Literal["btrfs", "tar"]
SendStream = Generator[bytes, None, None]
"""A subvolume's stream in chunks; `close()` stops a sender the receiver did not read to the end."""
CHUNK = 1 << 20


@dataclass
class ShipReport:
    checkpoint: str
    shipped: list[str]  # subvolumes sent, in order (an image first when the receiver lacked it)
    parent: str | None  # what the checkpoint's stream was made against (None: a full send)
    bytes_sent: int
    seconds: float


@dataclass
class CheckpointMeta:
    id: str
    sandbox_id: str
    image_key: str
    parent: str | None
    label: str | None
    created: float
    duration_ms: float | None
    limits: dict


@dataclass
class ImageMeta:
    key: str
    image_id: str
    names: list[str]
    config: dict


class ShipSource(Protocol):
    """Where checkpoints are shipped from: their metadata, and streams of subvolumes."""

    def formats(self) -> tuple[Format, ...]:
        """The stream formats it can send."""
        ...

    def checkpoint(self, checkpoint_id: str) -> CheckpointMeta | None: ...

    def image(self, key: str) -> ImageMeta: ...

    def send(self, kind: Kind, name: str, parent: tuple[Kind, str] | None, fmt: Format) -> SendStream:
        """The stream of `kind/name` in `fmt`, made against `parent` when given; raises CommandError."""
        ...


def formats() -> tuple[Format, ...]:
    """The stream formats this process can send and receive: btrfs's own needs root."""
    return ("tar",) if rootless.active() else ("btrfs", "tar")


def send_stream(store: Store, kind: Kind, name: str, parent: tuple[Kind, str] | None, fmt: Format) -> SendStream:
    """A subvolume of `store` in `fmt`, in chunks; raises CommandError when it cannot be sent."""
    path, parent_path = store.root / kind / name, store.root / parent[0] / parent[1] if parent else None
    if fmt == "tar":
        return tarstream.send(path, parent_path)
    command = ["btrfs", "send", "-q", *(["-p", str(parent_path)] if parent_path else []), str(path)]
    return shell.stream_out(command, f"btrfs send of {kind}/{name}", CHUNK)


class StoreSource:
    """Another store on this machine; `formats` limits what it sends (a rootless host's, in tests)."""

    def __init__(self, store: Store, formats: tuple[Format, ...] | None = None):
        self.store = store
        self._formats = formats

    def formats(self) -> tuple[Format, ...]:
        return self._formats or formats()

    def checkpoint(self, checkpoint_id: str) -> CheckpointMeta | None:
        try:
            cp = self.store.checkpoint(checkpoint_id)
        except CheckpointNotFound:
            return None
        return CheckpointMeta(cp.id, cp.sandbox_id, cp.image_key, cp.parent, cp.label, cp.created, cp.duration_ms,
                              cp.limits)

    def image(self, key: str) -> ImageMeta:
        image = self.store.image(key)
        return ImageMeta(image.key, image.image_id, image.names, asdict(image.config))

    def send(self, kind: Kind, name: str, parent: tuple[Kind, str] | None, fmt: Format) -> SendStream:
        if fmt not in self.formats():
            raise CommandError(f"this store cannot send {fmt} streams")
        return send_stream(self.store, kind, name, parent, fmt)


def _receive_subvolume(dst: Store, source: ShipSource, kind: Kind, name: str,
                       parent: tuple[Kind, str] | None) -> int:
    """Makes `kind/name` in `dst` from `source`'s stream against `parent`, returning the stream's size;
    raises CommandError from either side, leaving nothing half-received."""
    fmt: Format = "btrfs" if "btrfs" in source.formats() and "btrfs" in formats() else "tar"
    if fmt not in source.formats():
        raise CommandError(f"the source sends only {', '.join(source.formats())} streams, which this "
                           "rootless store cannot receive")
    btrfs.delete(dst.root / kind / name)  # what a failed or killed receive left
    chunks = source.send(kind, name, parent, fmt)
    try:
        if fmt == "tar":
            return tarstream.receive(dst.root / kind / name, dst.root / parent[0] / parent[1] if parent else None,
                                     chunks)
        return shell.stream_in(["btrfs", "receive", "-q", str(dst.root / kind)], chunks, "btrfs receive")
    except BaseException:
        btrfs.delete(dst.root / kind / name)
        raise
    finally:
        chunks.close()  # stops a sender we did not read to the end


def _ancestors(source: ShipSource, checkpoint: CheckpointMeta) -> list[CheckpointMeta]:
    chain, parent = [], checkpoint.parent
    while parent and (ancestor := source.checkpoint(parent)) is not None:
        chain.append(ancestor)
        parent = ancestor.parent
    return chain


def holds(store: Store, checkpoint_id: str) -> bool:
    return bool(store.meta.one("SELECT 1 FROM checkpoints WHERE id = ?", checkpoint_id)) and btrfs.is_subvolume(
        store.root / "checkpoints" / checkpoint_id)


def receive(dst: Store, source: ShipSource, checkpoint_id: str) -> ShipReport:
    """Copies a checkpoint (and its image when needed) from `source` into `dst`; idempotent. Receives into
    one store run one at a time: a second receiver of the same checkpoint waits, then finds it there."""
    started = time.monotonic()
    if not holds(dst, checkpoint_id):  # else no wait behind another receive
        with dst.building(), dst.receiving():  # subvolumes first, rows after: gc must wait
            if not holds(dst, checkpoint_id):
                return _receive(dst, source, checkpoint_id, started)
    return ShipReport(checkpoint_id, [], None, 0, time.monotonic() - started)


def _receive(dst: Store, source: ShipSource, checkpoint_id: str, started: float) -> ShipReport:
    checkpoint = source.checkpoint(checkpoint_id)
    if checkpoint is None:
        raise CheckpointNotFound(f"checkpoint {checkpoint_id} is not in the source store either")
    shipped: list[str] = []
    if not btrfs.is_subvolume(dst.root / "images" / checkpoint.image_key):
        try:
            image = source.image(checkpoint.image_key)
        except ImageNotFound:
            raise ImageNotFound(f"checkpoint {checkpoint_id} needs image {checkpoint.image_key}, which the "
                                "source store no longer has") from None
        _receive_subvolume(dst, source, "images", image.key, None)
        dst.meta.put_image(image.key, image.image_id, image.names, image.config)
        shipped.append(image.key)
    candidates: list[tuple[Kind, str] | None] = [
        ("checkpoints", a.id) for a in _ancestors(source, checkpoint) if holds(dst, a.id)]
    candidates += [("images", checkpoint.image_key), None]
    sent, parent = 0, None
    for candidate in candidates:
        try:
            sent = _receive_subvolume(dst, source, "checkpoints", checkpoint.id, candidate)
            parent = candidate[1] if candidate else None
            break
        except CommandError:  # e.g. the receiver's copy of the parent was not received from this source
            if candidate is None:
                raise
    shipped.append(checkpoint.id)
    dst.meta.put_checkpoint(checkpoint.id, checkpoint.sandbox_id, checkpoint.image_key, checkpoint.parent,
                            checkpoint.label, checkpoint.created, checkpoint.duration_ms or 0.0, checkpoint.limits)
    return ShipReport(checkpoint.id, shipped, parent, sent, time.monotonic() - started)


def ship(src: Store, dst: Store, checkpoint_id: str) -> ShipReport:
    """Copies a checkpoint (and its image when needed) from `src` into `dst`, both on this machine."""
    return receive(dst, StoreSource(src), checkpoint_id)
