"""A microVM checkpoint's files, read through a guest: a VM booted on the checkpoint's disk with its writes
kept apart (QEMU's snapshot mode: the checkpoint is never written), its agent asked once for the tree's
inventory and then for the files a comparison reads. The host never mounts or parses the disk (a file
system the agent wrote is read by the guest's kernel only), and every path is resolved inside the guest.
"""

import hashlib
import shutil
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import cast

from ..diff import Entry, Tree
from ..errors import StoreError
from .files import GuestFiles
from .guest import GuestKit
from .vm import MicroVM, VMLimits


class GuestTree:
    """One disk's tree as its guest sees it (the `Tree` of sprout.sandbox.diff)."""

    def __init__(self, files: GuestFiles, entries: dict[bytes, Entry]):
        self.files, self.entries = files, entries
        self.children: dict[bytes, list[bytes]] = {}
        for rel in entries:
            if rel:
                parent, _, name = rel.rpartition(b"/")
                self.children.setdefault(parent, []).append(name)

    def lstat(self, rel: bytes) -> Entry | None:
        return self.entries.get(rel)

    def listing(self, rel: bytes) -> dict[bytes, Entry]:
        return {name: self.entries[rel + b"/" + name if rel else name] for name in self.children.get(rel, [])}

    def read(self, rel: bytes, cap: int) -> bytes | None:
        entry = self.entries.get(rel)
        if entry is None or entry.size > cap:
            return None if entry else b""
        return self.files.read_file(_guest_path(rel), cap) or b""

    def same_bytes(self, other: Tree, rel: bytes, size: int) -> bool:
        return self._digest(rel, size) == cast(GuestTree, other)._digest(rel, size)

    def _digest(self, rel: bytes, size: int) -> bytes:
        digest = _Digest()
        self.files.copy_out(_guest_path(rel), digest, size)
        return digest.value.digest()


class _Digest:
    """A sink that keeps only the SHA-256 of what it is given."""

    def __init__(self) -> None:
        self.value = hashlib.sha256()

    def write(self, data: bytes, /) -> None:
        self.value.update(data)


def _guest_path(rel: bytes) -> str:
    return "/" + rel.decode("utf-8", "surrogateescape")


@contextmanager
def disk_trees(kit: GuestKit, disks: Sequence[Path], run_root: Path, accel: str) -> Iterator[list[Tree]]:
    """The disks' trees, each read through a VM of its own (booted at once), stopped afterwards."""
    run_dirs = [run_root / f"inspect-{uuid.uuid4().hex[:12]}" for _ in disks]
    with ExitStack() as stack:
        stack.callback(lambda: [shutil.rmtree(d, ignore_errors=True) for d in run_dirs])
        with ThreadPoolExecutor(max_workers=len(disks)) as pool:
            booting = [pool.submit(MicroVM.boot, kit, disk, run_dir, limits=VMLimits(), accel=accel, keep_disk=True)
                       for disk, run_dir in zip(disks, run_dirs)]
        vms = [future.result() for future in booting if future.exception() is None]
        for vm in vms:  # stopped at the end, or now when another did not boot
            stack.callback(vm.kill)
        for future in booting:
            future.result()
        trees: list[Tree] = []
        for vm, disk in zip(vms, disks):
            files = stack.enter_context(vm.files())
            entries = files.inventory("/")
            if entries is None:
                raise StoreError(f"the guest booted on {disk} sees no root directory")
            trees.append(GuestTree(files, entries))
        yield trees
