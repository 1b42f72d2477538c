"""Running one command in a sandbox: through sprout-runtime (setns, fast) or `podman exec` (fallback).

Both give the same result: merged stdout+stderr capped with a marker, the exit code, the duration,
and on timeout or cancellation the command's whole process tree killed inside the sandbox.
"""

import marshal
import os
import selectors
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .podman import PODMAN

DEFAULT_MAX_OUTPUT = 1 << 20
EXEC_MARKER = "SPROUT_EXEC_ID"  # set on podman-exec commands so their processes can be found and killed
TIMEOUT_EXIT_CODE = 124
KILL_ROUNDS = 5  # rescans when killing marked processes: one may fork while being killed
EXIT_GRACE_S = 0.05  # output still buffered when the command exits is read within this


@dataclass
class ExecResult:
    output: str
    exit_code: int
    duration: float
    timed_out: bool = False
    truncated: bool = False


class _CappedReader:
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


def _drain(proc: subprocess.Popen, limit: int, deadline: float | None) -> tuple[_CappedReader, bool]:
    """Reads the merged output until EOF, or until shortly after the process exits (a background
    job of the command may hold the pipe open forever); returns (reader, deadline_passed)."""
    reader = _CappedReader(limit)
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


def run_via_runtime(runtime_bin: Path, profile: Path, argv: list[str], cwd: str, env: dict[str, str],
                    timeout: float | None, max_output: int, user: tuple[int, int, list[int]] | None = None
                    ) -> ExecResult:
    started = time.monotonic()
    status_r, status_w = os.pipe()
    cmd = [str(runtime_bin), "exec", "--profile", str(profile), "--cwd", cwd, "--status-fd", str(status_w)]
    if user is not None:
        uid, gid, groups = user
        cmd += ["--user", f"{uid}:{gid}:{','.join(map(str, groups))}"]
    for key, value in env.items():
        cmd += ["--env", f"{key}={value}"]
    if timeout is not None:
        cmd += ["--timeout", str(timeout)]
    try:
        proc = subprocess.Popen([*cmd, "--", *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, pass_fds=(status_w,))
    finally:
        os.close(status_w)
    try:
        reader, _ = _drain(proc, max_output, None)  # the runtime enforces the timeout itself
        proc.wait()
        raw = os.read(status_r, 65536)
    except BaseException:  # cancelled (e.g. Harbor's verifier timeout): the runtime kills the tree
        proc.terminate()
        proc.wait()
        raise
    finally:
        os.close(status_r)
        proc.stdout.close()
    status = marshal.loads(raw) if raw else {"exit_code": proc.returncode, "timed_out": False}
    output, truncated = reader.text()
    return ExecResult(output, status["exit_code"], time.monotonic() - started, status["timed_out"], truncated)


def kill_marked(marker: str, key: str = EXEC_MARKER, cgroup_procs: list[str] | None = None) -> int:
    """SIGKILLs every process whose environment carries `key=marker` (among the sandbox's processes when
    `cgroup_procs` is given, else all of /proc), rescanning while a process may still be forking;
    returns how many it killed."""
    needle = f"{key}={marker}".encode()
    killed: set[int] = set()
    for _ in range(KILL_ROUNDS):
        found = 0
        for pid in _candidate_pids(cgroup_procs) - killed:
            try:
                if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    os.kill(pid, 9)
                    killed.add(pid)
                    found += 1
            except OSError:
                continue
        if not found:
            break
    return len(killed)


def _candidate_pids(cgroup_procs: list[str] | None) -> set[int]:
    if cgroup_procs is None:
        return {int(entry) for entry in os.listdir("/proc") if entry.isdigit()}
    pids: set[int] = set()
    for procs in cgroup_procs:
        try:
            pids.update(int(p) for p in Path(procs).read_text().split())
        except OSError:
            continue
    return pids


def run_via_podman(container: str, cgroup_procs: list[str], argv: list[str], cwd: str, user: str,
                   env: dict[str, str], timeout: float | None, max_output: int) -> ExecResult:
    started = time.monotonic()
    marker = uuid.uuid4().hex
    cmd = [*PODMAN, "exec", "--workdir", cwd, "--env", f"{EXEC_MARKER}={marker}"]
    if user:
        cmd += ["--user", user]
    for key, value in env.items():
        cmd += ["--env", f"{key}={value}"]
    proc = subprocess.Popen([*cmd, container, *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = None if timeout is None else started + timeout
    try:
        reader, timed_out = _drain(proc, max_output, deadline)
        if timed_out:
            kill_marked(marker, cgroup_procs=cgroup_procs)
        proc.wait()
    except BaseException:
        kill_marked(marker, cgroup_procs=cgroup_procs)
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stdout.close()
    output, truncated = reader.text()
    code = TIMEOUT_EXIT_CODE if timed_out else proc.returncode
    if timed_out:
        output += f"\nsprout: timed out after {timeout:g}s; the command's processes were killed\n"
    return ExecResult(output, code, time.monotonic() - started, timed_out, truncated)
