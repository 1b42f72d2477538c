"""The host's slots: how many attempts (a sandbox, its agent, its grade) run at once on this host, across
every process that uses the store: an evaluation's --parallel branches, a benchmark's --workers
evaluations, the gate's --workers tasks and the RL driver's local samples share them, so together they
never oversubscribe the host.

A slot is a lock file in the store (`<store>/slots/<n>.lock`) held with flock for the attempt's
duration; the kernel drops it when its holder exits, so a killed process never leaks a slot. The
count is $SPROUT_HOST_SLOTS, else twice the CPUs and at least 4 (an agent mostly waits on its model).
Run Store workers keep to their own --slots.
"""

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..settings import settings
from .errors import SproutError

SLOTS_ENV = "SPROUT_HOST_SLOTS"
POLL_S = 0.1


class SlotWaitStopped(SproutError):
    """The attempt was stopped while it waited for a slot."""


def host_slot_count() -> int:
    """$SPROUT_HOST_SLOTS, else max(4, 2 x CPUs)."""
    return settings().host_slots or max(4, 2 * (os.cpu_count() or 1))


class HostSlots:
    def __init__(self, store_root: Path, count: int | None = None):
        self.directory = Path(store_root) / "slots"
        self.count = count or host_slot_count()

    @contextmanager
    def hold(self, stop: threading.Event | None = None, on_wait=None) -> Iterator[int]:
        """Holds a free slot (its number) until the block ends, waiting for one while all are held;
        `on_wait` is called once if it has to wait; a set `stop` ends the wait (SlotWaitStopped)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        waited = False
        while True:
            for number in range(self.count):
                fd = os.open(self.directory / f"{number}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                try:
                    yield number
                finally:
                    os.close(fd)  # closing the descriptor releases the lock
                return
            if not waited and on_wait is not None:
                on_wait()
            waited = True
            if stop is not None and stop.wait(POLL_S):
                raise SlotWaitStopped("stopped while waiting for a free slot on this host")
            if stop is None:
                time.sleep(POLL_S)
