"""Copying files into and out of any sandbox, as `docker cp` does: a container's through its rootfs on
the host (sprout.tasks.transfer), a microVM's through its guest agent (sprout.sandbox.microvm.files).
Both follow the sandbox's own links inside the sandbox only, and the host only ever gets regular files.
"""

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from ..sandbox import Sandbox, rootfs
from ..sandbox.microvm.files import GuestFileError, GuestFiles
from . import transfer
from .transfer import TransferError


def ensure_dirs(sandbox: Sandbox, paths: list[str], owner: tuple[int, int]) -> None:
    """Creates the directories and makes them world-writable (Harbor's mount targets, /logs/...)."""
    if sandbox.backend != "microvm":
        return transfer.ensure_dirs(sandbox.rootfs, paths, owner)
    with _guest(sandbox) as files:
        for path in paths:
            files.make_dirs(path, owner, 0o777)


def upload_file(sandbox: Sandbox, source: Path, target: str, owner: tuple[int, int]) -> None:
    """Into TARGET, or inside it when it is a directory (a link there is followed, inside the sandbox)."""
    if sandbox.backend != "microvm":
        return transfer.upload_file(sandbox.rootfs, source, target, owner)
    with _guest(sandbox) as files:
        if target.endswith("/") or files.kind(target) == "dir":
            target = str(PurePosixPath(target) / Path(source).name)
        files.make_dirs(str(PurePosixPath(target).parent), owner)
        _write(files, Path(source), target, owner, follow=True)


def upload_dir(sandbox: Sandbox, source: Path, target: str, owner: tuple[int, int]) -> None:
    """Merges DIR's contents into TARGET (symlinks copied as links; a link in TARGET where a file goes
    is refused)."""
    if sandbox.backend != "microvm":
        return transfer.upload_dir(sandbox.rootfs, source, target, owner)
    source = Path(source)
    if not source.is_dir():
        raise TransferError(f"{source} is not a directory")
    with _guest(sandbox) as files:
        files.make_dirs(target, owner)
        for current, dirs, names in os.walk(source):
            rel = Path(current).relative_to(source).as_posix()
            base = PurePosixPath(target) / rel
            for name in sorted(dirs + names):
                local, inside = Path(current) / name, str(base / name)
                if local.is_symlink():
                    files.symlink(inside, os.readlink(local), owner)
                elif local.is_dir():
                    files.make_dirs(inside, owner)
                else:
                    _write(files, local, inside, owner, follow=False)
            dirs[:] = [d for d in dirs if not (Path(current) / d).is_symlink()]


def read_file(sandbox: Sandbox, path: str, max_bytes: int) -> bytes | None:
    """The bytes of a regular file in the sandbox (None when absent), read in chunks; TransferError for
    anything else there or a larger file."""
    if sandbox.backend == "microvm":
        with _guest(sandbox) as files:
            return files.read_file(path, max_bytes)
    with tempfile.TemporaryDirectory(prefix="sprout-read-") as tmp:
        local = Path(tmp) / "file"
        try:
            return local.read_bytes() if rootfs.copy_out(sandbox.rootfs, path, local, max_bytes) else None
        except rootfs.UnsafeFile as e:
            raise TransferError(str(e)) from None


def download_file(sandbox: Sandbox, source: str, target: Path) -> None:
    """Copies an in-sandbox file to the host (into `target`, or inside it when it is a directory)."""
    if sandbox.backend != "microvm":
        return transfer.download_file(sandbox.rootfs, source, target)
    target = Path(target)
    if target.is_dir():
        target = target / PurePosixPath(source).name
    target.parent.mkdir(parents=True, exist_ok=True)
    with _guest(sandbox) as files:
        if not _copy_out(files, source, target):
            raise TransferError(f"{source} is not a file in the sandbox")


def download_dir(sandbox: Sandbox, source: str, target: Path) -> None:
    """Copies an in-sandbox directory's contents into `target` on the host, overwriting. Links are
    copied as the files they point to; links to directories, special and oversized files are skipped."""
    if sandbox.backend != "microvm":
        return transfer.download_dir(sandbox.rootfs, source, target)
    target = Path(target)
    with _guest(sandbox) as files:
        listing = files.list(source, recursive=True)
        if not listing or listing["."] != "dir":
            raise TransferError(f"{source} is not a directory in the sandbox")
        target.mkdir(parents=True, exist_ok=True)
        for rel, kind in sorted(listing.items()):
            host = target / rel
            if rel in ("", ".") or not _inside(target, host) or kind == "other":
                continue
            try:
                if kind == "dir":
                    host.mkdir(parents=True, exist_ok=True)
                elif not host.is_symlink():
                    host.parent.mkdir(parents=True, exist_ok=True)
                    _copy_out(files, str(PurePosixPath(source) / rel), host)
            except (GuestFileError, OSError):
                continue  # oversized, replaced meanwhile, or a name that clashes with one listed before


def _write(files: GuestFiles, local: Path, inside: str, owner: tuple[int, int], *, follow: bool) -> None:
    with open(local, "rb") as data:
        files.write_file(inside, data, local.stat().st_mode & 0o7777, owner, follow=follow)


def _copy_out(files: GuestFiles, inside: str, host: Path) -> bool:
    """The guest's file at `inside` into `host`, whole or not at all (a partial copy never replaces it)."""
    partial = host.with_name(f".{host.name}.sprout-partial")
    try:
        with open(partial, "wb") as sink:
            found = files.copy_out(inside, sink, rootfs.MAX_COPY_BYTES)
        if found:
            os.replace(partial, host)
        return found
    finally:
        partial.unlink(missing_ok=True)


@contextmanager
def _guest(sandbox: Sandbox) -> Iterator[GuestFiles]:
    """The microVM's files for one transfer; what its guest refuses is a TransferError, as for containers."""
    try:
        with sandbox.guest_files() as files:
            yield files
    except GuestFileError as e:
        raise TransferError(str(e)) from None


def _inside(root: Path, path: Path) -> bool:
    """Whether a guest-given relative path stays under `root` (no '..', no absolute part)."""
    parts = PurePosixPath(path.relative_to(root)).parts if path.is_relative_to(root) else ("..",)
    return not any(part in ("..", "") for part in parts)
