"""What changed on disk between two checkpoints of one lineage: files added, changed and removed.

The candidates come from btrfs: an incremental send without data (`btrfs.changed_paths`) names every path
whose inode differs, and costs what changed rather than the tree's size. Where btrfs cannot tell (no
CAP_SYS_ADMIN, as a rootless user), a walk of both trees gives the candidates instead: every entry whose
metadata differs. Either way each candidate is then compared in the two read-only snapshots (type, mode,
owner, size, link target, bytes), every path resolved below the snapshot without following a link, so a
link the agent planted never makes the host read outside the checkpoint. Text files get GNU diff's unified
diff, run on descriptors opened that way.
"""

import errno
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

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


def diff_trees(base: Path, target: Path, *, base_name: str, target_name: str, content: bool = True,
               text_cap: int = TEXT_CAP, walk: bool = False, not_added: frozenset[str] = frozenset()) -> CheckpointDiff:
    """The changes from the read-only tree `base` to the read-only tree `target` (two subvolumes of one
    lineage); `content`: with a unified diff of each changed text file under `text_cap` bytes. `walk`:
    find the candidates by walking both trees even where btrfs could name them. `not_added`: paths whose
    appearance is not a change (what the sandbox's start put there, against an image)."""
    started = time.perf_counter()
    with ExitStack() as stack:
        trees = [stack.enter_context(_Tree(path)) for path in (base, target)]
        method, candidates = _candidates(base, target, trees, walk)
        changes: dict[bytes, FileChange] = {}
        for rel in sorted(candidates):
            if rel not in changes and not rel.startswith(b"/"):
                changes.update(_compare(trees[0], trees[1], rel, candidates[rel]))
        changes = {rel: c for rel, c in changes.items() if not (c.change == "added" and c.path in not_added)}
        if content:
            for rel, change in changes.items():
                _add_text_diff(change, rel, trees, text_cap)
    return CheckpointDiff(base=base_name, target=target_name, method=method,
                          changes=[changes[rel] for rel in sorted(changes)],
                          elapsed_ms=round((time.perf_counter() - started) * 1000, 2))


def _candidates(base: Path, target: Path, trees: list["_Tree"],
                walk: bool) -> tuple[Literal["btrfs-send", "walk"], dict[bytes, bool]]:
    """The paths to compare, each with whether its bytes may differ, and how they were found."""
    if not walk:
        try:
            return "btrfs-send", btrfs.changed_paths(base, target)
        except OSError as e:  # not allowed to send (rootless), or not two subvolumes of one filesystem
            if e.errno not in (errno.EPERM, errno.EACCES, errno.ENOTTY, errno.EINVAL, errno.EXDEV):
                raise
    return "walk", dict.fromkeys(_walk_differences(*trees), True)


class _Tree:
    """A read-only snapshot, read below its top without following links."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> "_Tree":
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

    def lstat(self, rel: bytes) -> os.stat_result | None:
        parent, name = _split(rel)
        fd = self.open(parent, os.O_PATH | os.O_DIRECTORY)
        if fd is None:
            return None
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    def readlink(self, rel: bytes) -> str:
        parent, name = _split(rel)
        fd = self.open(parent, os.O_PATH | os.O_DIRECTORY)
        assert fd is not None
        try:
            return os.fsdecode(os.readlink(name, dir_fd=fd))
        finally:
            os.close(fd)

    def read(self, rel: bytes, limit: int) -> bytes:
        """Up to `limit` bytes of the regular file `rel` (checked regular before this is called)."""
        fd = self.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        assert fd is not None
        try:
            data = b""
            while len(data) < limit and (chunk := os.read(fd, min(CHUNK, limit - len(data)))):
                data += chunk
            return data
        finally:
            os.close(fd)

    def listdir(self, rel: bytes) -> list[bytes]:
        fd = self.open(rel, os.O_RDONLY | os.O_DIRECTORY)
        if fd is None:
            return []
        try:
            return [os.fsencode(name) for name in os.listdir(fd)]
        finally:
            os.close(fd)


def _split(rel: bytes) -> tuple[bytes, bytes]:
    parent, _, name = rel.rpartition(b"/")
    return parent, name


def _node(tree: _Tree, rel: bytes) -> tuple[Node, os.stat_result] | None:
    info = tree.lstat(rel)
    if info is None:
        return None
    kind = _KINDS.get(stat.S_IFMT(info.st_mode), "file")
    node = Node(kind=kind, mode=f"{stat.S_IMODE(info.st_mode):04o}", owner=f"{info.st_uid}:{info.st_gid}",
                size=info.st_size, target=tree.readlink(rel) if kind == "symlink" else None)
    return node, info


def _display(rel: bytes) -> str:
    """The in-sandbox path, readable: bytes that are not UTF-8 and control characters escaped."""
    text = rel.decode("utf-8", errors="backslashreplace")
    return "/" + "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _compare(base: _Tree, target: _Tree, rel: bytes, data_changed: bool) -> Iterator[tuple[bytes, FileChange]]:
    """The changes at `rel` (and below it, where a directory is on one side only)."""
    before, after = _node(base, rel), _node(target, rel)
    if before is None and after is None:
        return  # a temporary name of the send stream
    if before is None or after is None:
        yield from _whole(base, rel, "removed") if after is None else _whole(target, rel, "added")
        return
    (old, _), (new, _) = before, after
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
    if old.kind == "file" and (old.size != new.size or (data_changed and not _same_bytes(base, target, rel, old.size))):
        what.append("content")
    if what:
        yield rel, FileChange(path=_display(rel), change="changed", what=what, before=old, after=new)


def _whole(tree: _Tree, rel: bytes, change: Literal["added", "removed"], *,
           below_only: bool = False) -> Iterator[tuple[bytes, FileChange]]:
    """`rel` and, for a directory, everything below it, as added or removed (`below_only`: not `rel` itself)."""
    stack = [rel]
    while stack:
        current = stack.pop()
        found = _node(tree, current)
        if found is None:
            continue
        node = found[0]
        if not (below_only and current == rel):
            yield current, FileChange(path=_display(current), change=change,
                                      **({"after": node} if change == "added" else {"before": node}))
        if node.kind == "dir":
            stack.extend(current + b"/" + name for name in tree.listdir(current))


def _same_bytes(base: _Tree, target: _Tree, rel: bytes, size: int) -> bool:
    left = base.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    right = target.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
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


def _walk_differences(base: _Tree, target: _Tree) -> Iterator[bytes]:
    """Every path whose entry differs between the trees (a name on one side only, or another inode,
    type, mode, owner, size, mtime or ctime), descending into directories both trees hold."""
    pending = [b""]
    while pending:
        current = pending.pop()
        for name in sorted(set(base.listdir(current)) | set(target.listdir(current))):
            rel = current + b"/" + name if current else name
            old, new = base.lstat(rel), target.lstat(rel)
            if old is None or new is None or _entry(old) != _entry(new):
                yield rel
            if old is not None and new is not None and stat.S_ISDIR(old.st_mode) and stat.S_ISDIR(new.st_mode):
                pending.append(rel)


def _entry(info: os.stat_result) -> tuple[int, ...]:
    return (info.st_ino, info.st_mode, info.st_uid, info.st_gid, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _add_text_diff(change: FileChange, rel: bytes, trees: list[_Tree], text_cap: int) -> None:
    """The unified diff of a text file's bytes (GNU diff's, a few ms even for a rewritten file), or
    `binary` when they are not shown: over the cap, a NUL byte, or not UTF-8."""
    sides = [change.before, change.after]
    if "content" not in change.what and change.change == "changed":
        return
    files = [side is not None and side.kind == "file" for side in sides]
    if not any(files):
        return
    for tree, is_file in zip(trees, files):
        data = tree.read(rel, text_cap + 1) if is_file else b""
        if len(data) > text_cap or b"\0" in data or not _utf8(data):
            change.binary = True
            return
    fds = [tree.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK) if is_file else None
           for tree, is_file in zip(trees, files)]
    try:
        args = [arg for prefix, fd in zip("ab", fds) for arg in ("--label", f"{prefix}{change.path}" if fd else "/dev/null")]
        inputs = [f"/proc/self/fd/{fd}" if fd is not None else "/dev/null" for fd in fds]
        done = subprocess.run(["diff", "-u", *args, *inputs], capture_output=True,
                              pass_fds=[fd for fd in fds if fd is not None], timeout=60)
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)
    if done.returncode not in (0, 1):
        raise StoreError(f"diff of {change.path} failed: {done.stderr.decode(errors='replace').strip()}")
    text = done.stdout.decode(errors="replace")
    change.diff = text if len(text) <= DIFF_CAP else text[:DIFF_CAP] + f"\n... ({len(text) - DIFF_CAP} more characters)\n"


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False
