"""Reading a sandbox's files from the host without trusting them.

A sandbox's rootfs is a host directory its agent controls. A host-side read resolves the path as the
sandbox would (openat2 with RESOLVE_IN_ROOT: an absolute symlink or `..` never leaves the rootfs),
opens only regular files (a FIFO, device or socket is refused before it is opened for reading, so
nothing blocks and no host device is read), and reads at most a bounded number of bytes.
"""

import ctypes
import errno
import os
import stat
from pathlib import Path

from ..settings import settings
from .errors import SproutError

SYS_OPENAT2 = 437  # the same number on every architecture (new syscalls share one table)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
O_PATH = getattr(os, "O_PATH", 0o10000000)
DEFAULT_MAX_BYTES = 4 << 20
CHUNK = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


class UnsafeFile(SproutError):
    """A sandbox file that the host refuses to read (not a regular file, or too large)."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(dir_fd: int, path: bytes, flags: int, resolve: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, 0, resolve)
    fd = _libc.syscall(SYS_OPENAT2, dir_fd, path or b".", ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(path))
    return fd


def open_in_root(root: Path, path: str, flags: int) -> int:
    """A file descriptor for the in-sandbox `path`, resolved with `root` as `/`."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _openat2(root_fd, os.fsencode(path.lstrip("/")), flags, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    finally:
        os.close(root_fd)


def open_beneath(dir_fd: int, path: bytes, flags: int) -> int:
    """A file descriptor for `path` below the directory `dir_fd`, following no symbolic link on the way
    (a link among its components is ELOOP): the tree as it is on disk, not as a process would see it."""
    return _openat2(dir_fd, path.lstrip(b"/"), flags, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)


def makedirs_in_root(root: Path, path: str, mode: int = 0o755) -> None:
    """Creates the directory `path` and its missing parents inside the rootfs, owned by root:root with
    `mode`, as docker creates a missing WORKDIR. Every component resolves with `root` as `/` (a link
    such as /app -> /etc makes /app/sub land at /etc/sub in the rootfs, never on the host). Raises
    NotADirectoryError, or FileExistsError for a dangling link, when the path cannot be a directory."""
    parts = [part for part in os.path.normpath("/" + path).split("/") if part]
    for depth in range(1, len(parts) + 1):
        prefix = "/".join(parts[:depth])
        try:
            os.close(open_in_root(root, prefix, O_PATH | os.O_DIRECTORY))
            continue
        except FileNotFoundError:
            pass
        parent = open_in_root(root, "/".join(parts[:depth - 1]), O_PATH | os.O_DIRECTORY)
        try:
            os.mkdir(parts[depth - 1], mode, dir_fd=parent)
        finally:
            os.close(parent)
        fd = open_in_root(root, prefix, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fchown(fd, 0, 0)
            os.fchmod(fd, mode)  # mkdir's mode went through the umask
        finally:
            os.close(fd)


def _regular_file_handle(root: Path, path: str) -> int | None:
    """An O_PATH descriptor of the regular file `path` inside the sandbox (None: nothing there)."""
    try:
        handle = open_in_root(root, path, O_PATH)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise UnsafeFile(f"cannot open {path} in the sandbox: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(handle).st_mode):
        os.close(handle)
        raise UnsafeFile(f"{path} in the sandbox is not a regular file")
    return handle


def check_regular(root: Path, path: str) -> None:
    """Raises UnsafeFile unless `path` inside the sandbox is a regular file or absent."""
    handle = _regular_file_handle(root, path)
    if handle is not None:
        os.close(handle)


def _open_regular(root: Path, path: str) -> int | None:
    """A read descriptor of the regular file `path` inside the sandbox (None: nothing there)."""
    handle = _regular_file_handle(root, path)
    if handle is None:
        return None
    try:  # the O_PATH descriptor pinned the inode: this reopens the regular file checked above
        return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(handle)


def copy_out(root: Path, path: str, target: Path, max_bytes: int | None = None) -> bool:
    """Copies the regular file `path` inside the sandbox to `target` on the host; False when there is
    no such file. Raises UnsafeFile for a special file or one larger than `max_bytes` (default
    $SPROUT_MAX_COPY_OUT_BYTES)."""
    max_bytes = max_bytes or settings().max_copy_out_bytes
    fd = _open_regular(root, path)
    if fd is None:
        return False
    copied = 0
    try:
        with open(target, "wb") as out:
            while chunk := os.read(fd, CHUNK):
                copied += len(chunk)
                if copied > max_bytes:
                    raise UnsafeFile(f"{path} in the sandbox is larger than {max_bytes} bytes")
                out.write(chunk)
    except UnsafeFile:
        target.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return True


def read_file(root: Path, path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes | None:
    """The bytes of the regular file `path` inside the sandbox, or None when it does not exist.
    Raises UnsafeFile for anything else there (FIFO, device, socket, directory) or a larger file."""
    fd = _open_regular(root, path)
    if fd is None:
        return None
    try:
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise UnsafeFile(f"{path} in the sandbox is larger than {max_bytes} bytes")
    return data
