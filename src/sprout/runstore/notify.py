"""In-process wake-ups for the API's long-polls.

Handlers that change the store call ``notify``; a long-poll takes a ``ticket``
before reading the store and then ``wait``s on it, so a change made between its
read and its wait is not missed. Changes made by other processes are only seen
when the wait times out, so waits are kept short and repeated.
"""

from __future__ import annotations

import asyncio


class Changes:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def ticket(self) -> asyncio.Event:
        return self._event

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    @staticmethod
    async def wait(ticket: asyncio.Event, timeout_s: float) -> None:
        """Return when a change happened after ``ticket`` was taken, or after ``timeout_s``."""
        try:
            await asyncio.wait_for(ticket.wait(), timeout_s)
        except TimeoutError:
            pass
