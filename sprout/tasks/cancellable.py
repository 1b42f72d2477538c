"""Sandbox.exec for asyncio: awaitable, and when the awaiting coroutine is cancelled (Harbor's
timeouts cancel it) the command's processes inside the sandbox are killed.

The SDK's exec blocks, so it runs in a worker thread. Each command carries a unique marker in its
environment, inherited by everything it starts; on cancellation every process with that marker is
SIGKILLed, which ends the blocking exec (both transports return once their child dies).
"""

import asyncio
import os
import uuid
from pathlib import Path

from ..sandbox import ExecResult, Sandbox

CANCEL_MARKER = "SPROUT_CANCEL_ID"
KILL_ROUNDS = 5  # rescans: a process may fork while it is being killed
DRAIN_TIMEOUT_S = 30.0  # how long a cancelled exec may take to return after its processes are killed


def kill_marked(marker: str) -> int:
    """SIGKILLs every process whose environment carries `CANCEL_MARKER=marker`; returns how many."""
    needle = f"{CANCEL_MARKER}={marker}".encode()
    killed: set[int] = set()
    for _ in range(KILL_ROUNDS):
        found = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in killed:
                continue
            try:
                if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    os.kill(int(entry), 9)
                    killed.add(int(entry))
                    found += 1
            except OSError:
                continue
        if not found:
            break
    return len(killed)


async def exec_async(sandbox: Sandbox, command: str | list[str], *, cwd: str | None = None,
                     env: dict[str, str] | None = None, timeout: float | None = None,
                     user: str | int | None = None) -> ExecResult:
    """`sandbox.exec(...)` without blocking the event loop, killed inside the sandbox when cancelled."""
    marker = uuid.uuid4().hex
    env = {**(env or {}), CANCEL_MARKER: marker}
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, lambda: sandbox.exec(command, cwd=cwd, env=env, timeout=timeout,
                                                                      user=user))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.to_thread(kill_marked, marker)
        try:
            await asyncio.wait_for(future, DRAIN_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the command is being abandoned; its result does not matter
            pass
        raise
