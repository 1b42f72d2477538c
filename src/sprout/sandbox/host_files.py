"""Copying files into and out of a sandbox whose files are a host directory (a container's rootfs).

Every in-sandbox path is resolved as the sandbox would resolve it, with the rootfs as `/`:
symlinks are followed inside the rootfs only (an absolute link is relative to the rootfs, `..`
stops at it), so a file the sandbox controls can never make the host read or write outside it.
"""

import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from . import rootfs
from .errors import TransferError

MAX_SYMLINKS = 40
# Bind-mounted into the container from elsewhere or kernel filesystems: not the rootfs's files.
NOT_IN_ROOTFS = ("/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/run/.containerenv", "/proc", "/sys",
                 "/dev")


def resolve(root: Path, path: str, *, follow_last: bool = True) -> Path:
    """The host path of an absolute in-sandbox `path`, never outside `root`."""
    pure = PurePosixPath(path)
    if not pure.is_absolute():
        raise TransferError(f"sandbox path {path!r} is not absolute")
    if any(str(pure) == p or str(pure).startswith(p + "/") for p in NOT_IN_ROOTFS):
        raise TransferError(f"{path} is not part of the sandbox's disk (a bind mount or kernel filesystem)")
    pending = list(pure.parts[1:])
    done: list[str] = []
    hops = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        candidate = root.joinpath(*done, part)
        if candidate.is_symlink() and (pending or follow_last):
            hops += 1
            if hops > MAX_SYMLINKS:
                raise TransferError(f"too many levels of symbolic links in {path}")
            target = PurePosixPath(os.readlink(candidate))
            if target.is_absolute():
                done = []
            pending = list(target.parts[1:] if target.is_absolute() else target.parts) + pending
            continue
        done.append(part)
    return root.joinpath(*done)


def _make_dirs(root: Path, path: str, owner: tuple[int, int], mode: int | None = None) -> Path:
    """mkdir -p inside the sandbox; new directories belong to `owner` (uid, gid)."""
    current = "/"
    for part in PurePosixPath(path).parts[1:]:
        current = str(PurePosixPath(current) / part)
        host = resolve(root, current)
        if not host.exists():
            host.mkdir()
            os.chown(host, *owner)
            if mode is not None:
                host.chmod(mode)
        elif not host.is_dir():
            raise TransferError(f"{current} exists in the sandbox and is not a directory")
    host = resolve(root, path)
    if mode is not None:
        host.chmod(mode)
    return host


def _copy_file_in(source: Path, host: Path, owner: tuple[int, int]) -> None:
    if host.is_symlink() or (host.exists() and not host.is_file()):
        raise TransferError(f"cannot write over {host.name!r} in the sandbox: not a regular file")
    try:
        shutil.copyfile(source, host, follow_symlinks=True)
    except OSError as e:  # e.g. a link in the sandbox to a directory it does not have
        raise TransferError(f"cannot write {host.name!r} in the sandbox: {e.strerror}") from None
    shutil.copymode(source, host)
    os.chown(host, *owner)


def _copy_out(root: Path, source: str, target: Path, max_bytes: int | None = None) -> bool:
    """rootfs.copy_out with its refusals as TransferError (the sandbox is live while this reads it)."""
    try:
        return rootfs.copy_out(root, source, target, max_bytes)
    except rootfs.UnsafeFile as e:
        raise TransferError(str(e)) from None


class HostFiles:
    """The files of a sandbox whose rootfs is the host directory `root` (sprout.sandbox.files)."""

    def __init__(self, root: Path):
        self.root = root

    def ensure_dirs(self, paths: list[str], owner: tuple[int, int]) -> None:
        for path in paths:
            _make_dirs(self.root, path, owner, mode=0o777)

    def upload_file(self, source: Path, target: str, owner: tuple[int, int]) -> None:
        """Like `docker cp FILE main:TARGET`: into TARGET, or inside it when it is a directory."""
        host = resolve(self.root, target)
        if target.endswith("/") or host.is_dir():
            target = str(PurePosixPath(target) / Path(source).name)
        _make_dirs(self.root, str(PurePosixPath(target).parent), owner)
        _copy_file_in(Path(source), resolve(self.root, target), owner)

    def upload_dir(self, source: Path, target: str, owner: tuple[int, int]) -> None:
        """Like `docker cp DIR/. main:TARGET`: merges DIR's contents into TARGET (symlinks copied as links)."""
        source = Path(source)
        if not source.is_dir():
            raise TransferError(f"{source} is not a directory")
        _make_dirs(self.root, target, owner)
        for current, dirs, files in os.walk(source):
            rel = Path(current).relative_to(source)
            base = PurePosixPath(target) / rel.as_posix() if rel.parts else PurePosixPath(target)
            for name in dirs:
                if (Path(current) / name).is_symlink():
                    files.append(name)
                else:
                    _make_dirs(self.root, str(base / name), owner)
            dirs[:] = [d for d in dirs if not (Path(current) / d).is_symlink()]
            for name in files:
                local = Path(current) / name
                host = resolve(self.root, str(base / name), follow_last=False)
                if local.is_symlink():
                    if host.is_symlink() or host.is_file():
                        host.unlink()
                    os.symlink(os.readlink(local), host)
                    os.lchown(host, *owner)
                else:
                    _copy_file_in(local, host, owner)

    def read_file(self, path: str, max_bytes: int) -> bytes | None:
        with tempfile.TemporaryDirectory(prefix="sprout-read-") as tmp:
            local = Path(tmp) / "file"
            return local.read_bytes() if _copy_out(self.root, path, local, max_bytes) else None

    def download_file(self, source: str, target: Path) -> None:
        """Copies an in-sandbox file to the host (into `target`, or inside it when it is a directory)."""
        resolve(self.root, source)  # refuses what is not on the sandbox's disk (bind mounts, /proc, ...)
        target = Path(target)
        if target.is_dir():
            target = target / PurePosixPath(source).name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not _copy_out(self.root, source, target):
            raise TransferError(f"{source} is not a file in the sandbox")

    def download_dir(self, source: str, target: Path) -> None:
        """Copies an in-sandbox directory's contents into `target` on the host, overwriting.

        A symlink is copied as the file it points to inside the sandbox; links to directories, to
        nothing or to special files are skipped, so the host only ever gets regular files."""
        host_dir = resolve(self.root, source)
        if not host_dir.is_dir():
            raise TransferError(f"{source} is not a directory in the sandbox")
        target = Path(target)
        target.mkdir(parents=True, exist_ok=True)
        for current, dirs, files in os.walk(host_dir):
            rel = Path(current).relative_to(host_dir)
            (target / rel).mkdir(parents=True, exist_ok=True)
            for name in files + [d for d in dirs if (Path(current) / d).is_symlink()]:
                in_sandbox = PurePosixPath(source) / rel.as_posix() / name
                try:
                    _copy_out(self.root, str(in_sandbox), target / rel / name)
                except TransferError:
                    continue  # a link to a directory, a special or oversized file: the host gets regular files only
