"""Sandbox.exec for asyncio: awaitable, and when the awaiting coroutine is cancelled (Harbor's
timeouts cancel it) the command's processes inside the sandbox are killed.

The SDK's exec blocks, so it runs in a worker thread. On cancellation every process the sandbox
started since the command began is SIGKILLed (Sandbox.kill_processes_since), which ends the blocking
exec (both transports return once their child dies).
"""

import asyncio

from ..sandbox import ExecResult, Sandbox

DRAIN_TIMEOUT_S = 30.0  # how long a cancelled exec may take to return after its processes are killed


async def exec_async(sandbox: Sandbox, command: str | list[str], *, cwd: str | None = None,
                     env: dict[str, str] | None = None, timeout: float | None = None,
                     user: str | int | None = None) -> ExecResult:
    """`sandbox.exec(...)` without blocking the event loop, killed inside the sandbox when cancelled."""
    before = sandbox.processes()
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, lambda: sandbox.exec(command, cwd=cwd, env=env, timeout=timeout,
                                                                      user=user))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.to_thread(sandbox.kill_processes_since, before)
        try:
            await asyncio.wait_for(future, DRAIN_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the command is being abandoned; its result does not matter
            pass
        raise
