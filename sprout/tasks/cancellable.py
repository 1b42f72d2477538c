"""Sandbox.exec for asyncio: awaitable, and when the awaiting coroutine is cancelled (Harbor's
timeouts cancel it) the command's processes inside the sandbox are killed.

The SDK's exec blocks, so it runs in a worker thread. Each command carries a unique marker in its
environment, inherited by everything it starts; on cancellation every process with that marker is
SIGKILLed, which ends the blocking exec (both transports return once their child dies).
"""

import asyncio
import uuid

from ..sandbox import ExecResult, Sandbox
from ..sandbox.execution import kill_marked

CANCEL_MARKER = "SPROUT_CANCEL_ID"
DRAIN_TIMEOUT_S = 30.0  # how long a cancelled exec may take to return after its processes are killed


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
        await asyncio.to_thread(kill_marked, marker, CANCEL_MARKER)
        try:
            await asyncio.wait_for(future, DRAIN_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the command is being abandoned; its result does not matter
            pass
        raise
