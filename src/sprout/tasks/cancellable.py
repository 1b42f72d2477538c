"""Sandbox.exec for asyncio: awaitable, and when the awaiting coroutine is cancelled (Harbor's
timeouts cancel it) the command's processes inside the sandbox are killed.

The SDK's exec blocks, so it runs in a worker thread; on cancellation its `cancel` event is set, which
kills every process the command started (whatever the backend) and so ends the blocking exec.
"""

import asyncio
import threading

from ..sandbox import ExecResult, Sandbox

DRAIN_TIMEOUT_S = 30.0  # how long a cancelled exec may take to return after its processes are killed


async def exec_async(sandbox: Sandbox, command: str | list[str], *, cwd: str | None = None,
                     env: dict[str, str] | None = None, timeout: float | None = None,
                     user: str | int | None = None) -> ExecResult:
    """`sandbox.exec(...)` without blocking the event loop, killed inside the sandbox when cancelled."""
    cancel = threading.Event()
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, lambda: sandbox.exec(command, cwd=cwd, env=env, timeout=timeout,
                                                                      user=user, cancel=cancel))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        cancel.set()
        try:
            await asyncio.wait_for(future, DRAIN_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the command is being abandoned; its result does not matter
            pass
        raise
