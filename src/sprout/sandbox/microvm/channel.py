"""Frames to and from the guest agent (sprout/sandbox/microvm/agent.c) over its unix socket:
4-byte big-endian length, a type byte, the payload."""

import socket
import time
from collections.abc import Callable
from contextlib import suppress

from ..errors import SproutError

MAX_FRAME = 16 << 20  # the agent's frames are far smaller: a longer one is a guest misbehaving
SEND_TIMEOUT_S = 60.0  # for the guest to take a request in (it reads as it goes: this is a wedged guest)


class ChannelError(SproutError):
    """The agent did not answer in time, the channel closed, or the guest sent garbage."""


class ChannelTimeout(ChannelError):
    """The agent did not answer by the deadline."""


class Channel:
    """One connection to the agent. `alive` tells a slow guest from a dead QEMU while waiting."""

    def __init__(self, sock: socket.socket, alive: Callable[[], bool]):
        self.sock, self.alive = sock, alive

    def send(self, kind: str, payload: bytes = b"", deadline: float | None = None) -> None:
        """Sends one frame whole by `deadline` (default: SEND_TIMEOUT_S from now). A frame cut short
        leaves the connection unusable: the agent drops it when the host hangs up."""
        if len(payload) > MAX_FRAME:
            raise ChannelError(f"a request of {len(payload):,} bytes is more than the agent takes "
                               f"({MAX_FRAME:,}): a shorter command or environment, please")
        left = (deadline if deadline is not None else time.monotonic() + SEND_TIMEOUT_S) - time.monotonic()
        self.sock.settimeout(max(left, 0.001))
        try:
            self.sock.sendall(frame(kind, payload))
        except TimeoutError:
            raise ChannelTimeout("the VM did not take a request in time") from None
        except OSError as e:
            raise ChannelError(f"the agent's channel failed: {e}") from None

    def interrupt(self, kind: str) -> None:
        """Sends an empty frame from another thread while this one receives (the socket's timeout,
        which the receiving thread sets, is left alone; five bytes never wait). Best effort."""
        with suppress(OSError):
            self.sock.sendall(frame(kind))

    def receive(self, deadline: float, doing: str) -> tuple[str, bytes]:
        head = self.read(5, deadline, doing)
        size = int.from_bytes(head[:4], "big")
        if size > MAX_FRAME:
            raise ChannelError(f"the guest sent a frame of {size:,} bytes ({doing}): it misbehaves")
        return chr(head[4]), self.read(size, deadline, doing)

    def skip_to(self, expected: bytes, deadline: float, doing: str) -> None:
        """Reads until the stream ends with `expected`: whatever a previous client left unread (its
        command outlived it, perhaps cut mid-frame) is dropped."""
        window = b""
        while not window.endswith(expected):
            window = (window + self.read(1, deadline, doing))[-len(expected):]

    def read(self, size: int, deadline: float, doing: str) -> bytes:
        data = bytearray()
        while len(data) < size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout(f"the VM did not answer in time ({doing})")
            self.sock.settimeout(min(left, 1.0))
            try:
                chunk = self.sock.recv(size - len(data))
            except TimeoutError:
                if not self.alive():
                    raise ChannelError(f"QEMU exited ({doing})") from None
                continue
            except OSError as e:
                raise ChannelError(f"the agent's channel failed ({doing}): {e}") from None
            if not chunk:
                raise ChannelError(f"the agent's channel closed ({doing})")
            data += chunk
        return bytes(data)


def frame(kind: str, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(4, "big") + kind.encode() + payload
