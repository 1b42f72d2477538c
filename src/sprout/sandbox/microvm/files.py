"""Files in a running microVM, through its agent (the host cannot see inside the guest's disk while it
runs): make directories, write files and links, read files, list trees. The guest resolves every path
in its own root, so a link it made cannot point the host anywhere. One Channel serves a whole transfer.
"""

import io
import stat
import time
from typing import BinaryIO, Literal, Protocol

from ..diff import Entry
from ..errors import SproutError
from .channel import Channel, ChannelError

REQUEST_TIMEOUT_S = 60.0
CHUNK = 1 << 20  # bytes of a file per request: well under the channel's 16 MiB frames

Kind = Literal["file", "dir", "other"]
KINDS: dict[str, Kind] = {"f": "file", "d": "dir", "o": "other"}


class Sink(Protocol):
    """Where copy_out puts a file's bytes: a binary file, or anything with `write(bytes)` (a digest's)."""

    def write(self, data: bytes, /) -> object: ...


class GuestFileError(SproutError):
    """The guest refused a file operation (no such directory, not a regular file, too large, ...)."""


def _fields(*fields: str) -> bytes:
    if any("\0" in field for field in fields):
        raise GuestFileError("a path contains a NUL byte")
    return b"".join(field.encode("utf-8", "surrogateescape") + b"\0" for field in fields)


def _decode(path: bytes) -> str:
    return path.decode("utf-8", "surrogateescape")


class GuestFiles:
    def __init__(self, channel: Channel):
        self.channel = channel

    def _answer(self, doing: str) -> tuple[str, bytes]:
        kind, body = self.channel.receive(time.monotonic() + REQUEST_TIMEOUT_S, doing)
        if kind == "!":
            raise GuestFileError(body.decode(errors="replace")[:500])
        return kind, body

    def _ask(self, request: str, payload: bytes, doing: str) -> None:
        self.channel.send(request, payload)
        kind, body = self._answer(doing)
        if kind != "k":
            raise GuestFileError(f"the guest agent answered {kind!r} {body[:100]!r} ({doing})")

    def make_dirs(self, path: str, owner: tuple[int, int], mode: int | None = None) -> None:
        """mkdir -p: directories it makes belong to `owner`; with `mode`, they and `path` get it."""
        mode_field = "" if mode is None else f"{mode:o}"
        self._ask("M", _fields(path, mode_field, str(owner[0]), str(owner[1])), f"making {path}")

    def write_file(self, path: str, data: bytes | BinaryIO, mode: int, owner: tuple[int, int], *,
                   follow: bool = True) -> None:
        """A regular file with `data` (bytes, or a file read in chunks); its parent must exist. A link
        at `path` is written through (`follow`) or refused; anything else but a file is refused."""
        source = io.BytesIO(data) if isinstance(data, bytes) else data
        kind = "f" if follow else "n"
        while True:
            chunk = source.read(CHUNK)
            head = _fields(kind, path, f"{mode:o}", str(owner[0]), str(owner[1]))
            self._ask("W", head + chunk, f"writing {path}")
            if len(chunk) < CHUNK:
                return
            kind = "a"

    def symlink(self, path: str, target: str, owner: tuple[int, int]) -> None:
        """A symlink at `path` to `target`, replacing a link or file there."""
        self._ask("W", _fields("l", path, "", str(owner[0]), str(owner[1])) + _fields(target)[:-1],
                  f"linking {path}")

    def read_file(self, path: str, max_bytes: int) -> bytes | None:
        """The bytes of the regular file at `path` (links followed), None when nothing is there.
        Raises GuestFileError for a special file, a directory, or one larger than `max_bytes`."""
        sink = io.BytesIO()
        return sink.getvalue() if self.copy_out(path, sink, max_bytes) else None

    def copy_out(self, path: str, sink: "Sink", max_bytes: int) -> bool:
        """Streams the regular file at `path` into `sink`; False when nothing is there (as read_file)."""
        self.channel.send("G", _fields(path, str(max_bytes)))
        written = 0
        while (answer := self._answer(f"reading {path}"))[0] == "d":
            written += len(answer[1])
            if written > max_bytes:  # the agent stops at max_bytes itself: this guest misbehaves
                raise ChannelError(f"the guest sent more of {path} than the {max_bytes} bytes asked for")
            sink.write(answer[1])
        return answer[0] != "n"

    def list(self, path: str, recursive: bool = False) -> dict[str, Kind] | None:
        """{relative path: kind} of `path` ("." for itself) and, recursively, what is under it; links
        are followed to files, but a link to a directory is "other" and not entered. None when absent."""
        self.channel.send("L", _fields(path, "1" if recursive else "0"))
        records = bytearray()
        while (answer := self._answer(f"listing {path}"))[0] == "l":
            records += answer[1]
        if answer[0] == "n":
            return None
        return {_decode(record[1:]): KINDS.get(chr(record[0]), "other")
                for record in bytes(records).split(b"\0") if record}

    def kind(self, path: str) -> Kind | None:
        listing = self.list(path)
        return listing["."] if listing else None

    def inventory(self, path: str) -> dict[bytes, Entry] | None:
        """{path relative to `path` (b"" for itself): its entry} of everything under `path` on its filesystem,
        links not followed. None when nothing is there."""
        self.channel.send("N", _fields(path))
        records = bytearray()
        while (answer := self._answer(f"listing {path}"))[0] == "l":
            records += answer[1]
        if answer[0] == "n":
            return None
        fields = bytes(records).split(b"\0")
        if len(fields) % 3 != 1:
            raise GuestFileError(f"the guest's inventory of {path} is malformed")
        entries = {}
        for at in range(0, len(fields) - 1, 3):
            head, rel, target = fields[at:at + 3]
            try:
                mode, uid, gid, size, mtime_ns, ctime_ns, ino = (int(v, 8 if i == 0 else 10)
                                                                 for i, v in enumerate(head.split()))
            except ValueError:
                raise GuestFileError(f"the guest's inventory of {path} is malformed: {head[:80]!r}") from None
            entries[b"" if rel == b"." else rel] = Entry(
                mode=mode, uid=uid, gid=gid, size=size, mtime_ns=mtime_ns, ctime_ns=ctime_ns, ino=ino,
                target=_decode(target) if stat.S_ISLNK(mode) else None)
        return entries
