"""Sandbox.exec for asyncio: awaitable, and when the awaiting coroutine is cancelled (Harbor's
timeouts cancel it) the command's processes inside the sandbox are killed.

The SDK's exec blocks, so it runs in a worker thread. On cancellation every process the sandbox
started since the command began is SIGKILLed (Sandbox.kill_processes_since; in a microVM its agent
does it, told through exec's `cancel`), which ends the blocking exec.
"""

import asyncio
import threading

from ..sandbox import ExecResult, Sandbox

DRAIN_TIMEOUT_S = 30.0  # how long a cancelled exec may take to return after its processes are killed


async def exec_async(sandbox: Sandbox, command: str | list[str], *, cwd: str | None = None,
                     env: dict[str, str] | None = None, timeout: float | None = None,
                     user: str | int | None = None) -> ExecResult:
    """`sandbox.exec(...)` without blocking the event loop, killed inside the sandbox when cancelled."""
    vm = sandbox.backend == "microvm"
    cancel = threading.Event() if vm else None
    before = None if vm else sandbox.processes()
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, lambda: sandbox.exec(command, cwd=cwd, env=env, timeout=timeout,
                                                                      user=user, cancel=cancel))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if cancel is not None:
            cancel.set()
        else:
            await asyncio.to_thread(sandbox.kill_processes_since, before)
        try:
            await asyncio.wait_for(future, DRAIN_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the command is being abandoned; its result does not matter
            pass
        raise
