"""A sandbox's processes seen from the host: who is there (its cgroups, or rootless, where it has none of
its own, its PID namespace), freezing them all, and killing every process a command started, whatever it
did to escape its parent (setsid, double forks, a cleared environment). Commands are timed out and
cancelled with this, whichever way they entered the sandbox."""

import contextlib
import ctypes
import fcntl
import os
import signal
import time
from collections.abc import Iterable

from .confinement import proc_starttime, stat_fields

FREEZE_TIMEOUT_S = 5.0
KILL_ROUNDS = 5
EXIT_WAIT_S = 5.0  # how long a kill waits for the killed to exit (one in uninterruptible I/O may take long)
KCMP_VM = 1
_SYS_KCMP = {"x86_64": 312, "aarch64": 272}.get(os.uname().machine)
_libc = ctypes.CDLL(None, use_errno=True)


def _cgroup_pids(cgroup_procs: list[str]) -> set[int]:
    pids: set[int] = set()
    for procs in cgroup_procs:
        try:
            with open(procs) as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return pids


def _pid_namespace(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _namespace_pids(init_pid: int) -> set[int]:
    """Every live process in the PID namespace of the sandbox's init (a sandbox without cgroups of its own).
    Zombies are not, as a cgroup's list has none: a killed process stays one until its parent reaps it."""
    namespace = _pid_namespace(init_pid)
    if namespace is None:
        return set()
    return {int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and _pid_namespace(int(entry)) == namespace and _live(int(entry))}


def _pids(profile: dict) -> set[int]:
    return _cgroup_pids(profile["cgroup_procs"]) if profile["cgroup_procs"] else _namespace_pids(profile["init_pid"])


def processes(profile: dict) -> set[tuple[int, int]]:
    """(pid, start time) of every process in the sandbox: who is there, pid reuse aside."""
    found = set()
    for pid in _pids(profile):
        try:
            found.add((pid, proc_starttime(pid)))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _freezer_files(cgroup_procs: list[str]) -> tuple[str, str, bytes, bytes] | None:
    """(control file, state file, frozen value, thawed value) of the sandbox's freezer, v1 or v2."""
    for procs in cgroup_procs:
        directory = os.path.dirname(procs)
        if os.path.exists(directory + "/freezer.state"):
            return directory + "/freezer.state", directory + "/freezer.state", b"FROZEN", b"THAWED"
        if os.path.exists(directory + "/cgroup.freeze"):
            return directory + "/cgroup.freeze", directory + "/cgroup.events", b"1", b"0"
    return None


def _freeze(cgroup_procs: list[str], timeout_s: float) -> bool:
    files = _freezer_files(cgroup_procs)
    if files is None:
        return False
    control, state, frozen_value, _ = files
    with open(control, "wb") as f:
        f.write(frozen_value)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(state, "rb") as f:
            text = f.read()
        if text.strip() == b"FROZEN" or b"frozen 1" in text:
            return True
        time.sleep(0.0002)
    _thaw(cgroup_procs)
    return False


def _thaw(cgroup_procs: list[str]) -> None:
    files = _freezer_files(cgroup_procs)
    if files is not None:
        with open(files[0], "wb") as f:
            f.write(files[3])


class _Stopped:
    """The processes of a sandbox without a freezer (rootless), stopped with SIGSTOP through pidfds: a pid
    a process left, and another took, is never signalled. Processes the sandbox had stopped itself are left
    as they are, stopped."""

    def __init__(self, profile: dict):
        self.init_pid = profile["init_pid"]
        self.pidfds: dict[int, int] = {}  # pid -> pidfd of each process stopped here
        self.seen: set[int] = set()

    def stop(self, timeout_s: float) -> bool:
        namespace, deadline = _pid_namespace(self.init_pid), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # settled is read before the scan: a child forked before its parent stopped is in the scan
            settled = all(_stopped(pid) or _waits_for_stopped_vfork(pid, self.seen) for pid in self.pidfds)
            new = _namespace_pids(self.init_pid) - self.seen
            for pid in new:
                self._stop(pid, namespace)
            self.seen |= new
            if settled and not new:
                return True
            time.sleep(0.0002)
        self.resume()
        return False

    def _stop(self, pid: int, namespace: int | None) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return
        if _pid_namespace(pid) != namespace or _stopped(pid):  # not the sandbox's, or stopped by it
            os.close(pidfd)
            return
        self.pidfds[pid] = pidfd
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGSTOP)

    def resume(self) -> None:
        for pidfd in self.pidfds.values():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGCONT)
            os.close(pidfd)
        self.pidfds, self.seen = {}, set()


def _state(entry: str) -> str:
    """The state letter (R, S, D, T, Z, ...) in /proc/ENTRY/stat, of a process (ENTRY a pid) or of one of
    its threads (PID/task/TID); X when it is gone."""
    try:
        return stat_fields(entry)[0].decode()
    except (OSError, ValueError, IndexError):
        return "X"


def _thread_states(pid: int) -> list[str]:
    """The state letter of each of the process's threads ([] when it is gone)."""
    try:
        return [_state(f"{pid}/task/{tid}") for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _live(pid: int) -> bool:
    """Whether the process runs: not a zombie, unless only its main thread exited (pthread_exit), which
    reads as one in /proc/PID/stat while its other threads run on."""
    state = _state(str(pid))
    return state not in "ZX" or (state == "Z" and any(s not in "ZX" for s in _thread_states(pid)))


def _stopped(pid: int) -> bool:
    """Whether every thread of the process is stopped or gone (a SIGSTOP stops them one by one)."""
    return all(s in "TtZX" for s in _thread_states(pid))


def _waits_for_stopped_vfork(pid: int, pids: Iterable[int]) -> bool:
    """Whether the process waits for a vfork child (posix_spawn's too) that is stopped before its exec: it
    cannot run, nor stop, until that child execs or exits (it reads as D), so it counts as stopped, as the
    kernel's cgroup freezer counts it frozen. Its child shares its memory (kcmp), which no other child does.
    (In a process with threads, the one that vforked reads as D and the others stop.)"""
    unstopped = [state for state in _thread_states(pid) if state not in "TtZX"]
    if not unstopped or any(state != "D" for state in unstopped):
        return False
    return any(child != pid and _parent(child) == pid and _stopped(child) and _shares_memory(pid, child)
               for child in pids)


def _parent(pid: int) -> int:
    try:
        return int(stat_fields(pid)[1])
    except (OSError, ValueError, IndexError):
        return 0


def _shares_memory(a: int, b: int) -> bool:
    """Whether two processes share one address space (kcmp(2) KCMP_VM); False where it cannot be told."""
    if _SYS_KCMP is None:
        return False
    args = (ctypes.c_long(_SYS_KCMP), ctypes.c_long(a), ctypes.c_long(b), ctypes.c_long(KCMP_VM),
            ctypes.c_long(0), ctypes.c_long(0))
    return _libc.syscall(*args) == 0


class frozen:  # noqa: N801 - used like contextlib's lowercase context managers
    """`with frozen(profile) as ok:` freezes every process of the sandbox (the cgroup freezer: they stop
    between system calls; rootless, without one: SIGSTOP until every one has stopped) and thaws them on
    exit; `ok` is False when they did not settle in time. Freezes of one sandbox are serialized by the
    profile's lock file (a checkpoint and a command's timeout in another process never thaw each other's
    freeze)."""

    def __init__(self, profile: dict, timeout_s: float = FREEZE_TIMEOUT_S):
        self.profile, self.lock, self.timeout_s = profile, profile.get("freeze_lock"), timeout_s
        self.stopped = _Stopped(profile) if not profile["cgroup_procs"] else None
        self.lock_fd: int | None = None
        self.ok = False

    def __enter__(self) -> bool:
        if self.lock:
            self.lock_fd = os.open(self.lock, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        if self.stopped is not None:
            self.ok = self.stopped.stop(self.timeout_s)
        else:
            self.ok = _freeze(self.profile["cgroup_procs"], self.timeout_s)
        return self.ok

    def __exit__(self, *_exc) -> None:
        if self.ok and self.stopped is not None:
            self.stopped.resume()
        elif self.ok:
            _thaw(self.profile["cgroup_procs"])
        if self.lock_fd is not None:
            os.close(self.lock_fd)


def kill_new_processes(profile: dict, before: set[tuple[int, int]]) -> int:
    """SIGKILLs every process of the sandbox that is not in `before` (what ran before a command began):
    the command's whole tree, whatever it did to escape it (setsid, double fork, a cleared environment).
    The sandbox is frozen meanwhile, so nothing forks between the scan and the kill; on return they have
    exited (or EXIT_WAIT_S passed)."""
    killed: set[tuple[int, int]] = set()
    with frozen(profile):
        for _ in range(KILL_ROUNDS):  # without a freezer, a process may fork while we scan
            new = processes(profile) - before - killed
            if not new:
                break
            for pid, _start in new:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed |= new
    _wait_gone(profile, killed, time.monotonic() + EXIT_WAIT_S)
    return len(killed)


def _wait_gone(profile: dict, killed: set[tuple[int, int]], deadline: float) -> None:
    """Waits until no killed process is listed: one is until it has exited, and a frozen one (cgroup v1)
    cannot exit before the thaw, so a caller that scans right after the kill would still find it."""
    while killed & processes(profile) and time.monotonic() < deadline:
        time.sleep(0.002)
