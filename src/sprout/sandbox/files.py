"""Copying files into and out of a running sandbox, as `docker cp` does, whatever runs it: a container's
files are a host directory (sprout.sandbox.host_files), a microVM's are reached through its guest agent
(sprout.sandbox.microvm.files). Both follow the sandbox's own links inside the sandbox only, refuse to
write through a link where a directory's contents go, and give the host only regular files.
"""

from pathlib import Path
from typing import Protocol


class SandboxFiles(Protocol):
    def ensure_dirs(self, paths: list[str], owner: tuple[int, int]) -> None:
        """Creates the directories (mkdir -p) and makes them world-writable (Harbor's mount targets)."""
        ...

    def upload_file(self, source: Path, target: str, owner: tuple[int, int]) -> None:
        """`docker cp FILE main:TARGET`: into TARGET, or inside it when it is a directory (a link there is
        followed, inside the sandbox)."""
        ...

    def upload_dir(self, source: Path, target: str, owner: tuple[int, int]) -> None:
        """`docker cp DIR/. main:TARGET`: merges DIR's contents into TARGET (symlinks copied as links; a
        link in TARGET where a file goes is refused)."""
        ...

    def read_file(self, path: str, max_bytes: int) -> bytes | None:
        """The bytes of a regular file (None when absent); TransferError for anything else there, or a
        larger file."""
        ...

    def download_file(self, source: str, target: Path) -> None:
        """An in-sandbox file to the host (into `target`, or inside it when it is a directory)."""
        ...

    def download_dir(self, source: str, target: Path) -> None:
        """An in-sandbox directory's contents into `target` on the host, overwriting. Links are copied as
        the files they point to; links to directories, special and oversized files are skipped."""
        ...
