"""Running one command in a sandbox: through sprout-runtime (setns, fast) or `podman exec` (fallback).

Either is only the client that enters the sandbox; everything else is here, so both give the same
result: merged stdout+stderr capped with a marker, the exit code, the duration, and on timeout or
cancellation every process the sandbox started while the command ran killed
(processes.kill_new_processes: setsid, double forks or a cleared environment do not escape it; a command
running at the same time in the same sandbox loses what it started meanwhile too).
"""

import os
import selectors
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .podman import command as podman_command
from .processes import kill_new_processes, processes

DEFAULT_MAX_OUTPUT = 1 << 20
TIMEOUT_EXIT_CODE = 124
EXIT_GRACE_S = 0.05  # output still buffered when the command exits is read within this
CLIENT_EXIT_S = 5.0  # how long `podman exec` may take to return once its command's processes are killed
CANCEL_POLL_S = 0.05  # how often a command's cancel watcher looks at its event
KILL_AGAIN_S = 0.05  # after a timeout, how often what the command started is killed again while its client runs


@dataclass
class ExecResult:
    output: str
    exit_code: int
    duration: float
    timed_out: bool = False
    truncated: bool = False

    @classmethod
    def cancelled_before_start(cls) -> "ExecResult":
        """An exec whose cancel was set before it began (it waited for a thread): nothing ran."""
        return cls(output="", exit_code=TIMEOUT_EXIT_CODE, duration=0.0, timed_out=True)


class CappedReader:
    """Keeps the head and the tail of a stream, dropping the middle past `limit` bytes."""

    def __init__(self, limit: int):
        self.limit, self.head, self.tail, self.total = limit, bytearray(), bytearray(), 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit // 2 - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail = (self.tail + chunk)[-(self.limit - self.limit // 2):]

    def text(self) -> tuple[str, bool]:
        omitted = self.total - len(self.head) - len(self.tail)
        body = bytes(self.head)
        if omitted > 0:
            body += f"\n[... sprout: {omitted} bytes of output omitted ...]\n".encode()
        return (body + bytes(self.tail)).decode(errors="replace"), omitted > 0


def _drain(proc: subprocess.Popen, limit: int, deadline: float | None) -> tuple[CappedReader, bool]:
    """Reads the merged output until EOF, or until shortly after the process exits (a background
    job of the command may hold the pipe open forever); returns (reader, deadline_passed)."""
    reader = CappedReader(limit)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    pidfd = os.pidfd_open(proc.pid)
    exited_at = None
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ, "output")
            sel.register(pidfd, selectors.EVENT_READ, "exit")
            while True:
                now = time.monotonic()
                if exited_at is not None and now >= exited_at + EXIT_GRACE_S:
                    return reader, False
                if exited_at is None and deadline is not None and now >= deadline:
                    return reader, True
                ends = [t for t in (deadline if exited_at is None else None,
                                    None if exited_at is None else exited_at + EXIT_GRACE_S) if t is not None]
                for key, _ in sel.select(min(ends) - now if ends else None):
                    if key.data == "exit":
                        sel.unregister(pidfd)
                        exited_at = time.monotonic()
                        continue
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        return reader, False
                    reader.feed(chunk)
    finally:
        os.close(pidfd)


def run_via_runtime(runtime_bin: Path, profile_path: Path, profile: dict, argv: list[str], cwd: str,
                    env: dict[str, str], user: tuple[int, int, list[int]] | None, timeout: float | None,
                    max_output: int) -> ExecResult:
    """Through the compiled runtime (runtime.c): it enters the sandbox and execs, nothing more."""
    cmd = [str(runtime_bin), "exec", "--profile", str(profile_path), "--cwd", cwd]
    if user is not None:
        uid, gid, groups = user
        cmd += ["--user", f"{uid}:{gid}:{','.join(map(str, groups))}"]
    for key, value in env.items():
        cmd += ["--env", f"{key}={value}"]
    return _run_client([*cmd, "--", *argv], profile, timeout, max_output)


def run_via_podman(container: str, profile: dict, argv: list[str], cwd: str, user: str,
                   env: dict[str, str], timeout: float | None, max_output: int) -> ExecResult:
    cmd = [*podman_command(), "exec", "--workdir", cwd]
    if user:
        cmd += ["--user", user]
    for key, value in env.items():
        cmd += ["--env", f"{key}={value}"]
    return _run_client([*cmd, container, *argv], profile, timeout, max_output)


def _run_client(cmd: list[str], profile: dict, timeout: float | None, max_output: int) -> ExecResult:
    """Runs the client that enters the sandbox (the runtime or `podman exec`) and reads its output; at the
    timeout, or if the caller is interrupted, every process the sandbox started meanwhile is killed."""
    started = time.monotonic()
    before = processes(profile)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = None if timeout is None else started + timeout
    try:
        reader, timed_out = _drain(proc, max_output, deadline)
        timed_out = timed_out or not _exits_by(proc, deadline)
        if timed_out:
            _kill_until_exited(proc, profile, before)
        proc.wait()
    except BaseException:
        kill_new_processes(profile, before)
        proc.kill()
        proc.wait()
        raise
    finally:
        if proc.stdout:
            proc.stdout.close()
    output, truncated = reader.text()
    code = TIMEOUT_EXIT_CODE if timed_out else proc.returncode
    if timed_out:
        output += f"\nsprout: timed out after {timeout:g}s; the command's processes were killed\n"
    return ExecResult(output, code, time.monotonic() - started, timed_out, truncated)


@contextmanager
def on_cancel(cancel: threading.Event | None, action: Callable[[], object], name: str, *,
              repeat: bool = False) -> Iterator[None]:
    """While the body runs, `action` runs (in a thread called `name`) once `cancel` is set: it ends a
    command blocked in the sandbox. With `repeat` it runs again every CANCEL_POLL_S until the body ends
    (a command still entering the sandbox when it first ran starts after it). Leaving waits for an action
    under way, never for the watcher's next look (a join would add up to one poll interval to every command)."""
    if cancel is None:
        yield
        return
    done, acting = threading.Event(), threading.Lock()

    def watch() -> None:
        while not done.is_set():
            if cancel.wait(CANCEL_POLL_S):
                with acting:
                    if not done.is_set():
                        action()
                if not repeat or done.wait(CANCEL_POLL_S):
                    return

    threading.Thread(target=watch, name=name, daemon=True).start()
    try:
        yield
    finally:
        with acting:  # an action under way finishes first; none starts after
            done.set()


def _kill_until_exited(proc: subprocess.Popen, profile: dict, before: set[tuple[int, int]]) -> None:
    """Kills what the command started, again until its client exits: a client still entering the sandbox
    at the timeout (`podman exec` takes 0.1 s, seconds under load) starts the command after a kill that
    found nothing. A client still there after CLIENT_EXIT_S is killed itself (`podman exec` blocked, e.g.
    reading a FIFO the agent left as /etc/passwd), and what it started once more."""
    end = time.monotonic() + CLIENT_EXIT_S
    while True:
        kill_new_processes(profile, before)
        if _exits_by(proc, min(end, time.monotonic() + KILL_AGAIN_S)):
            return
        if time.monotonic() >= end:
            proc.kill()
            proc.wait()
            kill_new_processes(profile, before)
            return


def _exits_by(proc: subprocess.Popen, deadline: float | None) -> bool:
    try:
        proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    return True
