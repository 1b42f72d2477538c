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
CANCEL_POLL_S = 0.05  # how often a running command's cancel event is looked at
KILL_AGAIN_S = 0.05  # after a timeout or cancel, how often what the command started is killed again while its client runs


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


def _drain(proc: subprocess.Popen, limit: int, deadline: float | None,
           cancel: threading.Event | None) -> tuple[CappedReader, bool]:
    """Reads the merged output until EOF, or until shortly after the process exits (a background
    job of the command may hold the pipe open forever); returns (reader, stopped): whether the deadline
    passed or `cancel` was set (looked at every CANCEL_POLL_S) before the command was done."""
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
                if exited_at is None and _stop_due(deadline, cancel, now):
                    return reader, True
                ends = [t for t in (deadline if exited_at is None else None,
                                    None if exited_at is None else exited_at + EXIT_GRACE_S,
                                    None if cancel is None else now + CANCEL_POLL_S) if t is not None]
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


def _stop_due(deadline: float | None, cancel: threading.Event | None, now: float) -> bool:
    return (deadline is not None and now >= deadline) or (cancel is not None and cancel.is_set())


def run_via_runtime(runtime_bin: Path, profile_path: Path, profile: dict, argv: list[str], cwd: str,
                    env: dict[str, str], user: tuple[int, int, list[int]] | None, timeout: float | None,
                    max_output: int, cancel: threading.Event | None) -> ExecResult:
    """Through the compiled runtime (runtime.c): it enters the sandbox and execs, nothing more."""
    cmd = [str(runtime_bin), "exec", "--profile", str(profile_path), "--cwd", cwd]
    if user is not None:
        uid, gid, groups = user
        cmd += ["--user", f"{uid}:{gid}:{','.join(map(str, groups))}"]
    for key, value in env.items():
        cmd += ["--env", f"{key}={value}"]
    return _run_client([*cmd, "--", *argv], profile, timeout, max_output, cancel)


def run_via_podman(container: str, profile: dict, argv: list[str], cwd: str, user: str, env: dict[str, str],
                   timeout: float | None, max_output: int, cancel: threading.Event | None) -> ExecResult:
    cmd = [*podman_command(), "exec", "--workdir", cwd]
    if user:
        cmd += ["--user", user]
    for key, value in env.items():
        cmd += ["--env", f"{key}={value}"]
    return _run_client([*cmd, container, *argv], profile, timeout, max_output, cancel)


def _run_client(cmd: list[str], profile: dict, timeout: float | None, max_output: int,
                cancel: threading.Event | None) -> ExecResult:
    """Runs the client that enters the sandbox (the runtime or `podman exec`) and reads its output; at the
    timeout, once `cancel` is set, or if the caller is interrupted, every process the sandbox started
    meanwhile is killed. A cancelled command reports a timeout, as one cancelled before it began does."""
    started = time.monotonic()
    before = processes(profile)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = None if timeout is None else started + timeout
    try:
        reader, stopped = _drain(proc, max_output, deadline, cancel)
        stopped = stopped or not _exits_by(proc, deadline, cancel)
        if stopped:
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
    if stopped:
        why = "was cancelled" if cancel is not None and cancel.is_set() else f"timed out after {timeout:g}s"
        output += f"\nsprout: the command {why}; its processes were killed\n"
    code = TIMEOUT_EXIT_CODE if stopped else proc.returncode
    return ExecResult(output, code, time.monotonic() - started, stopped, truncated)


@contextmanager
def on_cancel(cancel: threading.Event | None, action: Callable[[], object], name: str) -> Iterator[None]:
    """While the body runs, `action` runs (in a thread called `name`) once `cancel` is set: it ends a
    command blocked in the sandbox. Leaving waits for an action under way, never for the watcher's next
    look (a join would add up to one poll interval to every command)."""
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
                return

    threading.Thread(target=watch, name=name, daemon=True).start()
    try:
        yield
    finally:
        with acting:  # an action under way finishes first; none starts after
            done.set()


def _kill_until_exited(proc: subprocess.Popen, profile: dict, before: set[tuple[int, int]]) -> None:
    """Kills what the command started, again until its client exits: a client still entering the sandbox
    at the timeout or cancel (`podman exec` takes 0.1 s, seconds under load) starts the command after a
    kill that found nothing. A client still there after CLIENT_EXIT_S is killed itself (`podman exec`
    blocked), and what it started once more."""
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


def _exits_by(proc: subprocess.Popen, deadline: float | None, cancel: threading.Event | None = None) -> bool:
    """Whether the process exits before `deadline` (None: no deadline) and before `cancel` is set."""
    while True:
        now = time.monotonic()
        if _stop_due(deadline, cancel, now):
            return proc.poll() is not None
        wait = None if deadline is None else deadline - now
        if cancel is not None:
            wait = CANCEL_POLL_S if wait is None else min(wait, CANCEL_POLL_S)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        return True
