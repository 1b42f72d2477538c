"""Subvolume streams as tar, for stores that cannot use btrfs's own: a rootless user may neither
`btrfs send` (it needs CAP_SYS_ADMIN) nor receive an incremental stream (its parent is looked up by
UUID with a tree search, which needs it too).

A stream made against a parent that the receiver holds carries only what differs. The sender walks both
read-only snapshots (sprout.sandbox.diff.walk_differences: another inode, type, mode, owner, size, mtime
or ctime) and sends

    b"sprout-tar 1\\n", a JSON line {"remove": [paths]}, then a POSIX tar archive (numeric owners,
    extended attributes, sparse files) of every entry that differs, directories new to it whole.

The receiver snapshots its copy of the parent, removes the listed paths (each resolved beneath the new
subvolume without following a link), extracts the archive into it and makes it read-only. Without a
parent the archive is the whole subvolume. The paths to remove are every entry gone or no longer a
directory on both sides, so the extraction never meets a link the agent left where a directory now is.

Rootless, both ends run inside the user's namespace, so owners travel as the sandbox sees them: uid 0 is
the sandbox's root on a rootless host and on a root one alike. The sender is trusted as a worker holding
the workers' token (sprout.worker.shipping), as with btrfs streams: what it names is written into the
new subvolume by tar.
"""

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path

from . import btrfs, diff, rootfs, shell
from .errors import CommandError

MAGIC = b"sprout-tar 1\n"
HEADER_CAP = 256 << 20  # bytes of the remove list a receiver accepts
TAR_FLAGS = ["--numeric-owner", "--xattrs", "--xattrs-include=*", "--acls"]


def send(path: Path, parent: Path | None) -> Generator[bytes, None, None]:
    """The stream of the read-only subvolume `path`, against the read-only `parent` when given;
    raises CommandError when either is not a subvolume or tar fails."""
    for subvolume in (path, parent):
        if subvolume is not None and not btrfs.is_subvolume(subvolume):
            raise CommandError(f"cannot send {path.name}: {subvolume} is not a subvolume here")
    with tempfile.NamedTemporaryFile(prefix="sprout-tar-members-") as members:
        remove = _write_members(path, parent, members)
        yield MAGIC + json.dumps({"remove": [os.fsdecode(rel) for rel in remove]}).encode() + b"\n"
        yield from shell.stream_out(["tar", "-c", "-f", "-", "-C", str(path), *TAR_FLAGS, "--sparse",
                                     "--format=posix", "--no-recursion", "--null", "--verbatim-files-from",
                                     "-T", members.name], f"tar of {path.name}")


def _write_members(path: Path, parent: Path | None, out: "tempfile._TemporaryFileWrapper[bytes]") -> list[bytes]:
    """Writes the archive's members (NUL-separated, parents first) to `out`; returns the paths to remove."""
    remove: list[bytes] = []
    with diff.HostTree(parent or path) as old, diff.HostTree(path) as new:
        out.write(b".\0")
        changed = diff.walk_differences(old, new) if parent else ((rel, None, e) for rel, e in _below(new, b""))
        for rel, before, after in changed:
            if before is not None and not (after is not None and _is_dir(before) and _is_dir(after)):
                remove.append(rel)
            if after is None:
                continue
            out.write(b"./" + rel + b"\0")
            if parent and _is_dir(after) and not (before is not None and _is_dir(before)):
                out.writelines(b"./" + below + b"\0" for below, _ in _below(new, rel))
    out.flush()
    return remove


def _below(tree: diff.HostTree, rel: bytes) -> Iterator[tuple[bytes, diff.Entry]]:
    """Every path below the directory `rel` with its entry, each directory before what it holds."""
    for name, entry in sorted(tree.listing(rel).items()):
        child = rel + b"/" + name if rel else name
        yield child, entry
        if _is_dir(entry):
            yield from _below(tree, child)


def _is_dir(entry: diff.Entry) -> bool:
    return stat.S_ISDIR(entry.mode)


def receive(target: Path, parent: Path | None, chunks: Iterator[bytes]) -> int:
    """Makes the read-only subvolume `target` from a stream made against `parent` (which this store holds);
    returns the stream's size. Raises CommandError on a malformed stream or when tar fails."""
    size, buffer = 0, b""
    for chunk in chunks:
        size, buffer = size + len(chunk), buffer + chunk
        if buffer.count(b"\n") >= 2 or len(buffer) > HEADER_CAP:
            break
    magic, _, rest = buffer.partition(b"\n")
    header, newline, archive = rest.partition(b"\n")
    if magic + b"\n" != MAGIC or not newline:
        raise CommandError(f"not a sprout tar stream (it begins {buffer[:40]!r})")
    try:
        remove = [os.fsencode(rel) for rel in json.loads(header)["remove"]]
    except (ValueError, KeyError, TypeError) as e:
        raise CommandError(f"a sprout tar stream with a malformed remove list: {e}") from None
    if any(part in (b"", b".", b"..") for rel in remove for part in rel.split(b"/")):
        raise CommandError("a sprout tar stream may remove only paths below the subvolume")
    if parent is None:
        btrfs.create(target)
    else:
        btrfs.snapshot(parent, target, readonly=False)
    _remove(target, remove)
    size += shell.stream_in(["tar", "-x", "-f", "-", "-C", str(target), *TAR_FLAGS, "--same-owner",
                             "--preserve-permissions"], chunks, f"tar extraction into {target.name}", archive)
    btrfs.set_readonly(target)
    return size


def _remove(target: Path, paths: list[bytes]) -> None:
    """Removes each path below `target` (a directory with what it holds), following no link on the way."""
    root = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for rel in paths:
            parent, _, name = rel.rpartition(b"/")
            try:
                directory = rootfs.open_beneath(root, parent, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                continue  # below something removed already
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
                    shutil.rmtree(os.fsdecode(name), dir_fd=directory)
                else:
                    os.unlink(name, dir_fd=directory)
            except FileNotFoundError:
                pass
            finally:
                os.close(directory)
    finally:
        os.close(root)
