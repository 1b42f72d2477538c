"""A running microVM's files (sprout.sandbox.files), through its guest agent: the guest resolves every
path in its own root, so nothing it plants points the host elsewhere; the host only receives regular
files, under the target it named, each whole or not at all. What the guest refuses is a TransferError,
as it is for containers."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from ...settings import settings
from ..errors import TransferError
from .files import GuestFileError, GuestFiles


class GuestTransfer:
    def __init__(self, files: GuestFiles):
        self.files = files

    def ensure_dirs(self, paths: list[str], owner: tuple[int, int]) -> None:
        with refusals():
            for path in paths:
                self.files.make_dirs(path, owner, 0o777)

    def upload_file(self, source: Path, target: str, owner: tuple[int, int]) -> None:
        with refusals():
            if target.endswith("/") or self.files.kind(target) == "dir":
                target = str(PurePosixPath(target) / Path(source).name)
            self.files.make_dirs(str(PurePosixPath(target).parent), owner)
            self._write(Path(source), target, owner, follow=True)

    def upload_dir(self, source: Path, target: str, owner: tuple[int, int]) -> None:
        source = Path(source)
        if not source.is_dir():
            raise TransferError(f"{source} is not a directory")
        with refusals():
            self.files.make_dirs(target, owner)
            for current, dirs, names in os.walk(source):
                base = PurePosixPath(target) / Path(current).relative_to(source).as_posix()
                for name in sorted(dirs + names):
                    local, inside = Path(current) / name, str(base / name)
                    if local.is_symlink():
                        self.files.symlink(inside, os.readlink(local), owner)
                    elif local.is_dir():
                        self.files.make_dirs(inside, owner)
                    else:
                        self._write(local, inside, owner, follow=False)
                dirs[:] = [d for d in dirs if not (Path(current) / d).is_symlink()]

    def read_file(self, path: str, max_bytes: int) -> bytes | None:
        with refusals():
            return self.files.read_file(path, max_bytes)

    def download_file(self, source: str, target: Path) -> None:
        target = Path(target)
        if target.is_dir():
            target = target / PurePosixPath(source).name
        target.parent.mkdir(parents=True, exist_ok=True)
        with refusals():
            if not self._copy_out(source, target):
                raise TransferError(f"{source} is not a file in the sandbox")

    def download_dir(self, source: str, target: Path) -> None:
        target = Path(target)
        with refusals():
            listing = self.files.list(source, recursive=True)
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
                    self._copy_out(str(PurePosixPath(source) / rel), host)
            except (GuestFileError, OSError):
                continue  # oversized, replaced meanwhile, or a name that clashes with one listed before

    def _write(self, local: Path, inside: str, owner: tuple[int, int], *, follow: bool) -> None:
        with open(local, "rb") as data:
            self.files.write_file(inside, data, local.stat().st_mode & 0o7777, owner, follow=follow)

    def _copy_out(self, inside: str, host: Path) -> bool:
        """The guest's file at `inside` into `host`, whole or not at all (a partial copy never replaces it)."""
        partial = host.with_name(f".{host.name}.sprout-partial")
        try:
            with open(partial, "wb") as sink:
                found = self.files.copy_out(inside, sink, settings().max_copy_out_bytes)
            if found:
                os.replace(partial, host)
            return found
        finally:
            partial.unlink(missing_ok=True)


@contextmanager
def refusals() -> Iterator[None]:
    """What the guest refuses, as a TransferError."""
    try:
        yield
    except GuestFileError as e:
        raise TransferError(str(e)) from None


def _inside(root: Path, path: Path) -> bool:
    """Whether a guest-given relative path stays under `root` (no '..', no absolute part)."""
    parts = PurePosixPath(path.relative_to(root)).parts if path.is_relative_to(root) else ("..",)
    return not any(part in ("", "..") for part in parts)
