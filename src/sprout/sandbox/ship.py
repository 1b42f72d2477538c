"""Shipping checkpoints between stores with `btrfs send | btrfs receive`, incrementally when possible.

A checkpoint is sent with `-p` against its newest ancestor (parent chain, then its image) that the
receiving store already holds, so usually only the turn's changed blocks travel (~13 ms for a 1 MiB
delta, against seconds for a full rootfs). The image a checkpoint needs is shipped first when the
receiver lacks it. `receive(dst, source, id)` pulls from any `ShipSource`: `StoreSource` is another
store on this machine (`ship` joins the two), sprout.worker.shipping serves a store over HTTP to
other hosts.
"""

import subprocess
import time
from collections.abc import Generator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Protocol

from . import btrfs
from .errors import CheckpointNotFound, CommandError, ImageNotFound
from .store import Store

Kind = Literal["images", "checkpoints"]
SendStream = Generator[bytes, None, None]
"""A `btrfs send` stream in chunks; `close()` stops a sender the receiver did not read to the end."""
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
    """Where checkpoints are shipped from: their metadata, and btrfs send streams of subvolumes."""

    def checkpoint(self, checkpoint_id: str) -> CheckpointMeta | None: ...

    def image(self, key: str) -> ImageMeta: ...

    def send(self, kind: Kind, name: str, parent: tuple[Kind, str] | None) -> SendStream:
        """The stream of `kind/name`, made against `parent` when given; raises CommandError."""
        ...


def send_command(path: Path, parent: Path | None = None) -> list[str]:
    return ["btrfs", "send", "-q", *(["-p", str(parent)] if parent else []), str(path)]


def receive_command(directory: Path) -> list[str]:
    return ["btrfs", "receive", "-q", str(directory)]


def send_stream(store: Store, kind: Kind, name: str, parent: tuple[Kind, str] | None) -> SendStream:
    """`btrfs send` of a subvolume of `store`, in chunks; raises CommandError when it fails."""
    parent_path = store.root / parent[0] / parent[1] if parent else None
    sender = subprocess.Popen(send_command(store.root / kind / name, parent_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    assert sender.stdout and sender.stderr
    try:
        while chunk := sender.stdout.read(CHUNK):
            yield chunk
        error = sender.stderr.read().decode().strip()
        if sender.wait() != 0:
            raise CommandError(f"btrfs send of {kind}/{name} failed: {error}")
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
        sender.stdout.close()
        sender.stderr.close()


class StoreSource:
    """Another store on this machine."""

    def __init__(self, store: Store):
        self.store = store

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

    def send(self, kind: Kind, name: str, parent: tuple[Kind, str] | None) -> SendStream:
        return send_stream(self.store, kind, name, parent)


def _receive_into(directory: Path, chunks: SendStream) -> int:
    """Feeds a send stream to `btrfs receive`, returning its size; raises CommandError from either side."""
    receiver = subprocess.Popen(receive_command(directory), stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert receiver.stdin and receiver.stderr
    size = 0
    try:
        for chunk in chunks:
            size += len(chunk)
            receiver.stdin.write(chunk)
    except BrokenPipeError:
        pass  # receive gave up; its error follows
    except BaseException:
        receiver.kill()
        receiver.wait()
        raise
    finally:
        chunks.close()  # stops a sender we did not read to the end
        try:
            receiver.stdin.close()
        except BrokenPipeError:
            pass
    error = receiver.stderr.read().decode().strip()
    receiver.stderr.close()
    if receiver.wait() != 0:
        raise CommandError(f"btrfs receive failed: {error}")
    return size


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
    """Copies a checkpoint (and its image when needed) from `source` into `dst`; idempotent."""
    started = time.monotonic()
    if holds(dst, checkpoint_id):
        return ShipReport(checkpoint_id, [], None, 0, time.monotonic() - started)
    with dst.building():  # subvolumes first, rows after: gc must wait
        return _receive(dst, source, checkpoint_id, started)


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
        _receive_into(dst.root / "images", source.send("images", image.key, None))
        dst.meta.put_image(image.key, image.image_id, image.names, image.config)
        shipped.append(image.key)
    candidates: list[tuple[Kind, str] | None] = [
        ("checkpoints", a.id) for a in _ancestors(source, checkpoint) if holds(dst, a.id)]
    candidates += [("images", checkpoint.image_key), None]
    sent, parent = 0, None
    for candidate in candidates:
        btrfs.delete(dst.root / "checkpoints" / checkpoint.id)  # a half-received one from a failed try
        try:
            sent = _receive_into(dst.root / "checkpoints", source.send("checkpoints", checkpoint.id, candidate))
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
