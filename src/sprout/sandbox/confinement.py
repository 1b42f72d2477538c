"""The exec profile: how a command must be confined to run in a sandbox exactly as `podman exec` would.

It is read off the container's init process, which runc started with the same OCI process spec that
`podman exec` applies (capability sets, no_new_privs, seccomp, user, env, rlimits), plus the
container's cgroups from runc's state. The seccomp filter is dumped as BPF with ptrace
(PTRACE_SECCOMP_GET_FILTER), so the runtime loads the container's own filter, byte for byte; rootless,
where that needs CAP_SYS_ADMIN, it is compiled from runc's state (sprout.sandbox.seccomp). The compiled
runtime (runtime.c) reads it on every command, so it is written as plain lines (`write`, `read`).
"""

import ctypes
import json
import os
import re
import resource
import time
from pathlib import Path

from .. import rootless
from . import seccomp
from .errors import SandboxStateError

RUNC_STATE_DIRS = (Path("/run/runc"), Path("/run/runc-ctrs"))
PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_DETACH, PTRACE_SECCOMP_GET_FILTER = 0x4206, 0x4207, 17, 0x420C
WALL = 0x40000000
STOP_TIMEOUT_S = 60.0  # a tracee in uninterruptible sleep (I/O on a busy store) stops only once it wakes
EXEC_TIMEOUT_S = 30.0  # how long the container's init may take to become the container's process
_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def runc_state(container_id: str) -> dict | None:
    for root in (rootless.runtime_dir() / "runc",) if rootless.entered() else RUNC_STATE_DIRS:
        path = root / container_id / "state.json"
        if path.exists():
            return json.loads(path.read_text())
    return None


def stat_fields(pid: int | str) -> list[bytes]:
    """/proc/PID/stat's fields from the third on (after the command name, which may hold spaces); `pid`
    may also be PID/task/TID, one thread's."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rindex(b")") + 2:].split()


def proc_starttime(pid: int) -> int:
    return int(stat_fields(pid)[19])


def wait_for_exec(pid: int, timeout_s: float = EXEC_TIMEOUT_S) -> None:
    """Returns once the container's init has finished its execve. `runc start` (and so `podman run`)
    returns as runc's own init is about to exec the container's process: until it is done, the
    process's name is runc's (`runc:[2:INIT]`) or its environment is not there yet (env_end, field
    51 of /proc/PID/stat, is 0 until the new program's stack is set up), and a profile read then would
    give commands runc's environment, or none."""
    deadline, pause = time.monotonic() + timeout_s, 0.0005
    while Path(f"/proc/{pid}/comm").read_text().startswith("runc:[") or int(stat_fields(pid)[48]) == 0:
        if time.monotonic() > deadline:
            raise SandboxStateError(f"the sandbox init {pid} did not start its program in {timeout_s:g}s")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _status_fields(pid: int) -> dict[str, str]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def read_rlimits(pid: int) -> list[list[int]]:
    """[resource, soft, hard] for each limit; /proc/PID/limits lists them in resource-number order
    (prlimit on another user's process would need CAP_SYS_RESOURCE, which these hosts lack)."""
    limits = []
    for number, line in enumerate(Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]):
        soft, hard = (resource.RLIM_INFINITY if v == "unlimited" else int(v) for v in line[26:68].split()[:2])
        limits.append([number, soft, hard])
    return limits


def dump_seccomp(pid: int, stop_timeout_s: float = STOP_TIMEOUT_S) -> list[bytes]:
    """The process's seccomp filters as BPF programs, oldest first (the order to load them in). The wait
    for the tracing stop is bounded: a stop that never comes fails the sandbox's start, never hangs it."""
    if _libc.ptrace(PTRACE_SEIZE, pid, None, None) != 0:
        raise SandboxStateError(f"cannot trace the sandbox init {pid}: {os.strerror(ctypes.get_errno())}")
    try:
        _libc.ptrace(PTRACE_INTERRUPT, pid, None, None)
        deadline, pause = time.monotonic() + stop_timeout_s, 0.0005
        while os.waitpid(pid, WALL | os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                raise SandboxStateError(f"the sandbox init {pid} did not stop for tracing in {stop_timeout_s:g}s")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        filters: list[bytes] = []
        if _libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, ctypes.c_void_p(0), None) < 0:  # never run without it
            raise SandboxStateError(f"cannot read the seccomp filter of the sandbox init {pid}: "
                                    f"{os.strerror(ctypes.get_errno())}")
        while (count := _libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, ctypes.c_void_p(len(filters)), None)) > 0:
            buf = ctypes.create_string_buffer(count * 8)
            _libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, ctypes.c_void_p(len(filters)), buf)
            filters.append(buf.raw)
    finally:
        _libc.ptrace(PTRACE_DETACH, pid, None, None)
    return filters[::-1]


def _filters(pid: int, status: dict[str, str], state: dict) -> list[bytes] | None:
    """The seccomp filters a command must load, None when they cannot be had: as root, read off the init;
    rootless, where that read needs CAP_SYS_ADMIN, compiled from runc's state when that is exact."""
    if status.get("Seccomp") != "2":
        return []
    if not rootless.entered():
        return dump_seccomp(pid)
    program = seccomp.reproduce(state["config"].get("seccomp")) if status.get("Seccomp_filters") == "1" else None
    return [program] if program is not None else None


def capture(container_id: str) -> dict:
    """The exec profile of a running container (see sprout/sandbox/runtime.c for how it is applied)."""
    state = runc_state(container_id)
    if state is None:
        raise SandboxStateError(f"container {container_id[:12]} is not running (no runc state)")
    pid = state["init_process_pid"]
    wait_for_exec(pid)
    status = _status_fields(pid)
    uid = int(status["Uid"].split()[0])
    gid = int(status["Gid"].split()[0])
    groups = [int(g) for g in status["Groups"].split()]
    env = {}
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        key, sep, value = item.decode(errors="surrogateescape").partition("=")
        if sep:
            env[key] = value
    filters = _filters(pid, status, state)
    cgroup_procs = []  # none rootless: the paths there are the user's own cgroups, not the sandbox's
    for path in sorted(set(state["cgroup_paths"].values()) if not rootless.entered() else ()):
        procs = Path(path) / "cgroup.procs"
        if procs.exists():
            cgroup_procs.append(str(procs))
    return {
        "container_id": container_id,
        "init_pid": pid,
        "init_starttime": proc_starttime(pid),
        "cgroup_procs": cgroup_procs,
        "uid": uid,
        "gid": gid,
        "groups": groups,
        "caps": {key: int(status[f"Cap{name}"], 16) for key, name in
                 (("bnd", "Bnd"), ("eff", "Eff"), ("prm", "Prm"), ("inh", "Inh"), ("amb", "Amb"))},
        "no_new_privs": status.get("NoNewPrivs") == "1",
        "umask": int(status.get("Umask", "0022"), 8),
        "seccomp": filters or [],
        "seccomp_unread": filters is None,  # the runtime refuses such a profile; podman exec runs its commands
        "env": env,
        "rlimits": read_rlimits(pid),
    }


PROFILE_HEADER = "sprout-exec-profile 1"
_BOOLS = {"no_new_privs", "seccomp_unread"}
_SCALARS = ("container_id", "init_pid", "init_starttime", "uid", "gid", *sorted(_BOOLS), "umask", "freeze_lock")
_INTS = {"init_pid", "init_starttime", "uid", "gid", "umask"}
CAP_SETS = ("bnd", "eff", "prm", "inh", "amb")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def write(profile: dict, path: Path) -> None:
    """The profile as lines `key value` (values escape backslash and newline), read by the compiled runtime
    (runtime.c) on every command and by `read` here."""
    lines = [PROFILE_HEADER]
    lines += [f"{key} {_escape(str(int(profile[key]) if key in _BOOLS else profile[key]))}"
              for key in _SCALARS if key in profile]
    lines.append("groups " + " ".join(map(str, profile["groups"])))
    lines.append("caps " + " ".join(f"{profile['caps'][name]:x}" for name in CAP_SETS))
    lines += [f"cgroup_procs {_escape(procs)}" for procs in profile["cgroup_procs"]]
    lines += [f"rlimit {res} {soft} {hard}" for res, soft, hard in profile["rlimits"]]
    lines += [f"seccomp {program.hex()}" for program in profile["seccomp"]]
    lines += [f"env {_escape(f'{key}={value}')}" for key, value in profile["env"].items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes("\n".join(lines).encode(errors="surrogateescape") + b"\n")
    os.replace(tmp, path)


def read(path: Path) -> dict:
    """A profile `write` wrote; ValueError if the file is not one."""
    lines = path.read_bytes().decode(errors="surrogateescape").split("\n")  # as runtime.c: \n ends a line
    if not lines or lines[0] != PROFILE_HEADER:
        raise ValueError(f"{path} is not an exec profile")
    profile: dict = {"cgroup_procs": [], "rlimits": [], "seccomp": [], "env": {}, "groups": []}
    for line in filter(None, lines[1:]):
        key, _, value = line.partition(" ")
        if key in _INTS:
            profile[key] = int(value)
        elif key in _BOOLS:
            profile[key] = value == "1"
        elif key in _SCALARS:
            profile[key] = _unescape(value)
        elif key == "groups":
            profile[key] = [int(g) for g in value.split()]
        elif key == "caps":
            profile[key] = {name: int(v, 16) for name, v in zip(CAP_SETS, value.split(), strict=True)}
        elif key == "cgroup_procs":
            profile[key].append(_unescape(value))
        elif key == "rlimit":
            profile["rlimits"].append([int(v) for v in value.split()])
        elif key == "seccomp":
            profile[key].append(bytes.fromhex(value))
        elif key == "env":
            name, _, text = _unescape(value).partition("=")
            profile[key][name] = text
    return profile
