"""What changed on disk between two checkpoints of one lineage: files added, changed and removed.

The candidates come from btrfs: an incremental send without data (`btrfs.changed_paths`) names every path
whose inode differs, and costs what changed rather than the tree's size. Where btrfs cannot tell (no
CAP_SYS_ADMIN, as a rootless user), a walk of both trees gives the candidates instead: every entry whose
metadata differs. Either way each candidate is then compared in the two read-only snapshots (type, mode,
owner, size, link target, bytes), every path resolved below the snapshot without following a link, so a
link the agent planted never makes the host read outside the checkpoint. Text files get GNU diff's unified
diff of the bytes read that way.

A microVM's checkpoint holds a disk, whose files the host does not read: its trees are read through the
agent of a VM booted on each disk (sprout.sandbox.microvm.inspect), and walked. Both kinds of tree answer
the `Tree` protocol, so the comparison is one.
"""

import errno
import os
import stat
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict

from . import btrfs, rootfs
from .errors import StoreError

TEXT_CAP = 256 << 10  # files larger than this are compared by size and bytes, not shown as a diff
DIFF_CAP = 20_000  # characters of one file's unified diff
SUMMARY_PATHS = 20  # paths a change summary lists by name
CHUNK = 1 << 20
Kind = Literal["file", "dir", "symlink", "fifo", "socket", "char", "block"]
_KINDS: dict[int, Kind] = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink",
                           stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket", stat.S_IFCHR: "char",
                           stat.S_IFBLK: "block"}
_LETTER = {"added": "A", "changed": "M", "removed": "D"}


class Node(BaseModel):
    """One side of a change: what the path was in one checkpoint."""

    model_config = ConfigDict(extra="forbid")

    kind: Kind
    mode: str  # permission bits in octal, e.g. "0644"
    owner: str  # "uid:gid" as stored on disk
    size: int
    target: str | None = None  # a symbolic link's


class FileChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str  # inside the sandbox, absolute
    change: Literal["added", "changed", "removed"]
    what: list[Literal["type", "mode", "owner", "content", "target"]] = []  # for a change
    before: Node | None = None
    after: Node | None = None
    diff: str | None = None  # a unified diff of a text file under the size cap
    binary: bool = False  # a file whose bytes are not shown (not UTF-8 text, or over the cap)

    def line(self) -> str:
        detail = ", ".join(self.what)
        return f"{_LETTER[self.change]} {self.path}" + (f" ({detail})" if detail else "")


class ChangeSummary(BaseModel):
    """What one turn changed, as its journal line keeps it: counts and the first paths by name."""

    model_config = ConfigDict(extra="forbid")

    added: int
    changed: int
    removed: int
    paths: list[str]  # "A /app/x.py", "M /app/y.py (content)", ...: the first SUMMARY_PATHS
    more: int = 0  # changed paths not listed by name
    since: str  # the checkpoint (or image) compared against

    def counts(self) -> str:
        return f"{self.added} added, {self.changed} changed, {self.removed} removed"

    def line(self) -> str:
        counts = self.counts()
        listed = "; ".join(self.paths) + (f"; and {self.more} more" if self.more else "")
        return counts + (f": {listed}" if listed else "")


class CheckpointDiff(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base: str
    target: str
    method: Literal["btrfs-send", "walk"]
    changes: list[FileChange]
    elapsed_ms: float

    def summary(self) -> ChangeSummary:
        counts = {kind: sum(c.change == kind for c in self.changes) for kind in ("added", "changed", "removed")}
        return ChangeSummary(**counts, paths=[c.line() for c in self.changes[:SUMMARY_PATHS]],
                             more=max(0, len(self.changes) - SUMMARY_PATHS), since=self.base)


@dataclass(frozen=True)
class Entry:
    """What a tree holds at one path: lstat's fields the comparison looks at, and a link's target."""

    mode: int  # st_mode: the type and the permission bits
    uid: int
    gid: int
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    target: str | None = None

    def key(self) -> tuple:
        """What tells an entry changed without reading it (a walk's candidates)."""
        return self.ino, self.mode, self.uid, self.gid, self.size, self.mtime_ns, self.ctime_ns, self.target


class Tree(Protocol):
    """A read-only snapshot's files, by path relative to its top (bytes, no leading slash)."""

    def lstat(self, rel: bytes) -> Entry | None: ...

    def listing(self, rel: bytes) -> dict[bytes, Entry]:
        """The directory `rel`'s entries by name (empty when it is no directory here)."""
        ...

    def read(self, rel: bytes, cap: int) -> bytes | None:
        """The bytes of the regular file `rel`; None when it holds more than `cap`."""
        ...

    def same_bytes(self, other: "Tree", rel: bytes, size: int) -> bool:
        """Whether the regular file `rel`, `size` bytes on both sides, holds the same bytes in `other`."""
        ...


def diff_trees(trees: Sequence[Tree], *, base_name: str, target_name: str, subvolumes: Sequence[Path] = (),
               content: bool = True, text_cap: int = TEXT_CAP, walk: bool = False,
               start_made: frozenset[str] = frozenset()) -> CheckpointDiff:
    """The changes from the read-only tree `trees[0]` to `trees[1]` (of one lineage); `content`: with a
    unified diff of each changed text file under `text_cap` bytes. With the trees' two `subvolumes` on this
    host, btrfs names the candidates unless `walk`; else both trees are walked. `start_made`: paths whose
    appearance or change is not the agent's (what the sandbox's start wrote, against an image)."""
    started = time.perf_counter()
    method, candidates = _candidates(subvolumes, trees, walk)
    changes: dict[bytes, FileChange] = {}
    for rel in sorted(candidates):
        if rel not in changes and not rel.startswith(b"/"):
            changes.update(_compare(trees[0], trees[1], rel, candidates[rel]))
    changes = {rel: c for rel, c in changes.items() if not (c.change != "removed" and c.path in start_made)}
    if content:
        for rel, change in changes.items():
            _add_text_diff(change, rel, trees, text_cap)
    return CheckpointDiff(base=base_name, target=target_name, method=method,
                          changes=[changes[rel] for rel in sorted(changes)],
                          elapsed_ms=round((time.perf_counter() - started) * 1000, 2))


@contextmanager
def host_trees(subvolumes: Sequence[Path]) -> Iterator[list[Tree]]:
    """Read-only subvolumes on this host, open as trees."""
    with ExitStack() as stack:
        yield [stack.enter_context(HostTree(path)) for path in subvolumes]


def _candidates(subvolumes: Sequence[Path], trees: Sequence[Tree],
                walk: bool) -> tuple[Literal["btrfs-send", "walk"], dict[bytes, bool]]:
    """The paths to compare, each with whether its bytes may differ, and how they were found."""
    if subvolumes and not walk:
        try:
            return "btrfs-send", btrfs.changed_paths(*subvolumes)
        except OSError as e:  # not allowed to send (rootless), or not two subvolumes of one filesystem
            if e.errno not in (errno.EPERM, errno.EACCES, errno.ENOTTY, errno.EINVAL, errno.EXDEV):
                raise
    return "walk", {rel: True for rel, _, _ in walk_differences(*trees)}


class HostTree:
    """A read-only snapshot on this host, read below its top without following links."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> "HostTree":
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def open(self, rel: bytes, flags: int) -> int | None:
        try:
            return rootfs.open_beneath(self.fd, rel, flags)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return None  # not there, or behind a link: not this path in this tree
            raise

    def lstat(self, rel: bytes) -> Entry | None:
        parent, name = _split(rel)
        fd = self.open(parent, os.O_PATH | os.O_DIRECTORY)
        if fd is None:
            return None
        try:
            return _entry_at(fd, name)
        finally:
            os.close(fd)

    def read(self, rel: bytes, cap: int) -> bytes | None:
        fd = self.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        if fd is None:
            return b""
        try:
            data = b""
            while len(data) <= cap and (chunk := os.read(fd, min(CHUNK, cap + 1 - len(data)))):
                data += chunk
            return data if len(data) <= cap else None
        finally:
            os.close(fd)

    def listing(self, rel: bytes) -> dict[bytes, Entry]:
        """Read through one descriptor of the directory, not one per entry (a walk's cost)."""
        fd = self.open(rel, os.O_RDONLY | os.O_DIRECTORY)
        if fd is None:
            return {}
        try:
            found = {name: _entry_at(fd, name) for name in map(os.fsencode, os.listdir(fd))}
            return {name: entry for name, entry in found.items() if entry is not None}
        finally:
            os.close(fd)

    def same_bytes(self, other: Tree, rel: bytes, size: int) -> bool:
        assert isinstance(other, HostTree)
        left = self.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        right = other.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if left is None or right is None:
                return False
            for _ in range(0, size + 1, CHUNK):
                if os.read(left, CHUNK) != os.read(right, CHUNK):
                    return False
            return True
        finally:
            for fd in (left, right):
                if fd is not None:
                    os.close(fd)


def _entry_at(dir_fd: int, name: bytes) -> Entry | None:
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        target = os.fsdecode(os.readlink(name, dir_fd=dir_fd)) if stat.S_ISLNK(info.st_mode) else None
    except FileNotFoundError:
        return None
    return Entry(mode=info.st_mode, uid=info.st_uid, gid=info.st_gid, size=info.st_size,
                 mtime_ns=info.st_mtime_ns, ctime_ns=info.st_ctime_ns, ino=info.st_ino, target=target)


def _split(rel: bytes) -> tuple[bytes, bytes]:
    parent, _, name = rel.rpartition(b"/")
    return parent, name


def _node(tree: Tree, rel: bytes) -> Node | None:
    entry = tree.lstat(rel)
    if entry is None:
        return None
    return Node(kind=_KINDS.get(stat.S_IFMT(entry.mode), "file"), mode=f"{stat.S_IMODE(entry.mode):04o}",
                owner=f"{entry.uid}:{entry.gid}", size=entry.size, target=entry.target)


def _display(rel: bytes) -> str:
    """The in-sandbox path, readable: bytes that are not UTF-8 and control characters escaped."""
    text = rel.decode("utf-8", errors="backslashreplace")
    return "/" + "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _compare(base: Tree, target: Tree, rel: bytes, data_changed: bool) -> Iterator[tuple[bytes, FileChange]]:
    """The changes at `rel` (and below it, where a directory is on one side only)."""
    old, new = _node(base, rel), _node(target, rel)
    if old is None and new is None:
        return  # a temporary name of the send stream
    if old is None or new is None:
        yield from _whole(base, rel, "removed") if new is None else _whole(target, rel, "added")
        return
    if old.kind != new.kind:
        yield rel, FileChange(path=_display(rel), change="changed", what=["type"], before=old, after=new)
        yield from _whole(base, rel, "removed", below_only=True)
        yield from _whole(target, rel, "added", below_only=True)
        return
    what: list[Literal["type", "mode", "owner", "content", "target"]] = []
    if old.mode != new.mode:
        what.append("mode")
    if old.owner != new.owner:
        what.append("owner")
    if old.target != new.target:
        what.append("target")
    if old.kind == "file" and (old.size != new.size or (data_changed and not base.same_bytes(target, rel, old.size))):
        what.append("content")
    if what:
        yield rel, FileChange(path=_display(rel), change="changed", what=what, before=old, after=new)


def _whole(tree: Tree, rel: bytes, change: Literal["added", "removed"], *,
           below_only: bool = False) -> Iterator[tuple[bytes, FileChange]]:
    """`rel` and, for a directory, everything below it, as added or removed (`below_only`: not `rel` itself)."""
    stack = [rel]
    while stack:
        current = stack.pop()
        node = _node(tree, current)
        if node is None:
            continue
        if not (below_only and current == rel):
            yield current, FileChange(path=_display(current), change=change,
                                      **({"after": node} if change == "added" else {"before": node}))
        if node.kind == "dir":
            stack.extend(current + b"/" + name for name in tree.listing(current))


def walk_differences(base: Tree, target: Tree) -> Iterator[tuple[bytes, Entry | None, Entry | None]]:
    """Every path whose entry differs between the trees (a name on one side only, or another inode,
    type, mode, owner, size, mtime or ctime), with its entry on each side, descending into directories
    both trees hold."""
    pending = [b""]
    while pending:
        current = pending.pop()
        before, after = base.listing(current), target.listing(current)
        for name in sorted(before.keys() | after.keys()):
            rel = current + b"/" + name if current else name
            old, new = before.get(name), after.get(name)
            if old is None or new is None or old.key() != new.key():
                yield rel, old, new
            if old is not None and new is not None and stat.S_ISDIR(old.mode) and stat.S_ISDIR(new.mode):
                pending.append(rel)




def _add_text_diff(change: FileChange, rel: bytes, trees: Sequence[Tree], text_cap: int) -> None:
    """The unified diff of a text file's bytes (GNU diff's, a few ms even for a rewritten file), or
    `binary` when they are not shown: over the cap, a NUL byte, or not UTF-8."""
    sides = [change.before, change.after]
    if "content" not in change.what and change.change == "changed":
        return
    files = [side is not None and side.kind == "file" for side in sides]
    if not any(files):
        return
    data = [tree.read(rel, text_cap) if is_file else b"" for tree, is_file in zip(trees, files)]
    if any(d is None or b"\0" in d or not _utf8(d) for d in data):
        change.binary = True
        return
    text = _unified(change.path, *(d if is_file else None for d, is_file in zip(data, files)))
    change.diff = text if len(text) <= DIFF_CAP else text[:DIFF_CAP] + f"\n... ({len(text) - DIFF_CAP} more characters)\n"


def _unified(path: str, before: bytes | None, after: bytes | None) -> str:
    """GNU diff -u of two byte strings (None: no file on that side), read from memory files."""
    fds: list[int | None] = []
    try:
        for data in (before, after):
            fd = None if data is None else os.memfd_create("sprout-diff")
            if fd is not None and data:
                os.write(fd, data)
            fds.append(fd)
        labels = [arg for prefix, fd in zip("ab", fds)
                  for arg in ("--label", f"{prefix}{path}" if fd is not None else "/dev/null")]
        inputs = [f"/proc/self/fd/{fd}" if fd is not None else "/dev/null" for fd in fds]
        done = subprocess.run(["diff", "-u", *labels, *inputs], capture_output=True,
                              pass_fds=[fd for fd in fds if fd is not None], timeout=60)
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)
    if done.returncode not in (0, 1):
        raise StoreError(f"diff of {path} failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout.decode(errors="replace")


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False
