"""sprout-runtime: run one command inside a running sandbox, confined exactly like `podman exec`.

This file is executed directly (`python -I -S runtime.py ...`) on the hot path of every agent
command, so it imports nothing but the standard library and nothing from Sprout.

How a command is entered (each step reproduces part of what runc applies to a `podman exec`):
  parent: setns(pid) so that the child is born in the container's PID namespace, fork, wait
  child:  setsid, join every cgroup of the container (memory/pids limits hold), setns into
          ipc/uts/net/mnt, chdir (resolved inside the sandbox), the container's umask and rlimits, drop the
          capability bounding set, load the container's own seccomp filter (dumped from its init
          process when the sandbox started), become the image's user with the container's
          capability sets, no_new_privs, then execve with an explicit environment.
Everything the child applies comes from the sandbox's exec profile (marshal, fast to load), written by the SDK
from the container's init process, which runc confined with the same spec `podman exec` uses.

Exit status: the command's own; 124 when it timed out (every process it started is killed); 125 when the
runtime itself failed. `--status-fd N` also writes a marshalled dict {"exit_code", "timed_out", "killed", ...}.
"""

import _signal as signal  # the enum-free core of `signal`: this runs on every command
import ctypes
import fcntl
import marshal
import os
import resource
import select
import sys
import time
import warnings  # noqa: F401  (os.execvpe imports it lazily: after setns(mnt) the host stdlib is gone)

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_RAISE = 2
SECCOMP_MODE_FILTER = 2
CAP_LAST = 40
NAMESPACES = ("ipc", "uts", "net", "mnt")
EXIT_TIMEOUT = 124
EXIT_RUNTIME_ERROR = 125
FREEZE_TIMEOUT_S = 5.0
KILL_ROUNDS = 5

_libc = ctypes.CDLL(None, use_errno=True)


class RuntimeFailure(Exception):
    """The runtime could not enter the sandbox (not the command failing)."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise RuntimeFailure(f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), 0, 0), f"prctl({option})")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _capset(effective: int, permitted: int, inheritable: int) -> None:
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    for i in range(2):
        shift = 32 * i
        data[i].effective = (effective >> shift) & 0xFFFFFFFF
        data[i].permitted = (permitted >> shift) & 0xFFFFFFFF
        data[i].inheritable = (inheritable >> shift) & 0xFFFFFFFF
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def _load_seccomp(program: bytes) -> None:
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def _proc_starttime(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _enter_and_exec(profile: dict, ns_fds: dict, cwd: str, env: dict, argv: list[str]) -> None:
    """Runs in the forked child; never returns."""
    os.setsid()
    for procs in profile["cgroup_procs"]:
        with open(procs, "w") as f:
            f.write("0")
    for name in NAMESPACES:
        os.setns(ns_fds[name], 0)
    try:
        os.chdir(cwd)
    except OSError as e:
        raise RuntimeFailure(f"cannot change directory to {cwd!r} inside the sandbox: {e.strerror}") from None
    os.umask(profile["umask"])
    for res, soft, hard in profile["rlimits"]:
        resource.setrlimit(res, (soft, hard))
    caps = profile["caps"]
    for cap in range(CAP_LAST + 1):
        if not caps["bnd"] >> cap & 1:
            try:
                _prctl(PR_CAPBSET_DROP, cap)
            except RuntimeFailure:
                if cap <= 37:  # caps the kernel knows must drop; unknown high caps give EINVAL
                    raise
    for program in profile["seccomp"]:
        _load_seccomp(program)
    os.setgroups(profile["groups"])
    os.setresgid(profile["gid"], profile["gid"], profile["gid"])
    os.setresuid(profile["uid"], profile["uid"], profile["uid"])
    _capset(caps["eff"], caps["prm"], caps["inh"])
    for cap in range(CAP_LAST + 1):
        if caps["amb"] >> cap & 1:
            _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if profile["no_new_privs"]:
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        sys.stderr.write(f"sprout-runtime: cannot execute {argv[0]!r}: {e.strerror}\n")
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)


def _cgroup_pids(cgroup_procs: list[str]) -> set[int]:
    pids: set[int] = set()
    for procs in cgroup_procs:
        try:
            with open(procs) as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return pids


def processes(cgroup_procs: list[str]) -> set[tuple[int, int]]:
    """(pid, start time) of every process in the sandbox's cgroups: who is there, pid reuse aside."""
    found = set()
    for pid in _cgroup_pids(cgroup_procs):
        try:
            found.add((pid, _proc_starttime(pid)))
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


class frozen:  # noqa: N801 - used like contextlib's lowercase context managers
    """`with frozen(profile) as ok:` freezes every process of the sandbox (the cgroup freezer: they stop
    between system calls) and thaws them on exit; `ok` is False when the sandbox has no freezer or it
    did not settle in time. Freezes of one sandbox are serialized by the profile's lock file (a
    checkpoint and a command's timeout in another process never thaw each other's freeze)."""

    def __init__(self, profile: dict, timeout_s: float = FREEZE_TIMEOUT_S):
        self.procs, self.lock, self.timeout_s = profile["cgroup_procs"], profile.get("freeze_lock"), timeout_s
        self.lock_fd: int | None = None
        self.ok = False

    def __enter__(self) -> bool:
        if self.lock:
            self.lock_fd = os.open(self.lock, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        self.ok = _freeze(self.procs, self.timeout_s)
        return self.ok

    def __exit__(self, *_exc) -> None:
        if self.ok:
            _thaw(self.procs)
        if self.lock_fd is not None:
            os.close(self.lock_fd)


def kill_new_processes(profile: dict, before: set[tuple[int, int]]) -> int:
    """SIGKILLs every process of the sandbox that is not in `before` (what ran before a command began):
    the command's whole tree, whatever it did to escape it (setsid, double fork, a cleared environment).
    The sandbox is frozen meanwhile, so nothing forks between the scan and the kill."""
    killed: set[tuple[int, int]] = set()
    with frozen(profile):
        for _ in range(KILL_ROUNDS):  # without a freezer, a process may fork while we scan
            new = processes(profile["cgroup_procs"]) - before - killed
            if not new:
                break
            for pid, _start in new:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed |= new
    return len(killed)


def as_user(profile: dict, user: str) -> dict:
    """The profile for another user ("UID:GID[:G1,G2...]"), with the capability sets podman exec gives
    it: the container's set for root, none for anyone else."""
    uid, gid, *rest = user.split(":")
    groups = [int(g) for g in rest[0].split(",") if g] if rest else []
    bnd = profile["caps"]["bnd"]
    caps = {"bnd": bnd, "eff": bnd, "prm": bnd, "inh": 0, "amb": 0} if int(uid) == 0 else dict.fromkeys(
        ("eff", "prm", "inh", "amb"), 0) | {"bnd": bnd}
    return profile | {"uid": int(uid), "gid": int(gid), "groups": groups, "caps": caps}


def run(profile: dict, cwd: str, extra_env: dict, argv: list[str], timeout: float | None,
        status_fd: int | None) -> int:
    pid = profile["init_pid"]
    try:
        if _proc_starttime(pid) != profile["init_starttime"]:
            raise RuntimeFailure("sandbox is not running (its init process is gone)")
        ns_fds = {name: os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY) for name in NAMESPACES}
        pid_ns = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY)
    except FileNotFoundError:
        raise RuntimeFailure("sandbox is not running (its init process is gone)") from None
    os.setns(pid_ns, os.CLONE_NEWPID)
    env = dict(profile["env"]) | extra_env
    before = processes(profile["cgroup_procs"])
    started = time.monotonic()
    err_r, err_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(err_r)
        try:
            _enter_and_exec(profile, ns_fds, cwd, env, argv)
        except BaseException as e:  # report to the parent, never run Python code of the parent
            os.write(err_w, str(e).encode() or type(e).__name__.encode())
        os._exit(EXIT_RUNTIME_ERROR)
    os.close(err_w)
    for fd in (*ns_fds.values(), pid_ns):
        os.close(fd)

    def on_signal(signum, _frame):
        kill_new_processes(profile, before)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    pidfd = os.pidfd_open(child)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    timed_out = not poller.poll(None if timeout is None else max(timeout, 0) * 1000)
    killed = kill_new_processes(profile, before) if timed_out else 0
    _, status = os.waitpid(child, 0)
    setup_error = os.read(err_r, 65536).decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        code = 128 - code
    if timed_out:
        code = EXIT_TIMEOUT
        sys.stderr.write(f"sprout-runtime: timed out after {timeout:g}s; killed {killed} process(es)\n")
    elif setup_error:
        sys.stderr.write(f"sprout-runtime: {setup_error}\n")
    if status_fd is not None:
        report = {"exit_code": code, "timed_out": timed_out, "killed": killed,
                  "setup_error": setup_error or None, "duration_s": time.monotonic() - started}
        os.write(status_fd, marshal.dumps(report))
    return code


USAGE = """usage: sprout-runtime exec --profile FILE [--cwd DIR] [--env K=V]... [--timeout S]
                      [--user UID:GID[:GROUPS]] [--status-fd N] -- COMMAND [ARG]...

Runs COMMAND inside a running Sprout sandbox, confined like `podman exec`: the sandbox's cgroups,
namespaces, capability sets, seccomp filter, user and image environment (never this shell's).
FILE is the sandbox's exec profile (`sprout sandbox inspect SANDBOX` shows its path).
Exit status: the command's; 124 on timeout (its whole process tree is killed); 125 on a runtime error.
"""


def parse_args(args: list[str]) -> tuple[dict, list[str]]:
    if not args or args[0] in ("-h", "--help") or args[0] != "exec":
        raise SystemExit(USAGE if args and args[0] in ("-h", "--help") else "sprout-runtime: " + USAGE)
    opts: dict = {"env": {}, "cwd": "/", "timeout": None, "status_fd": None, "profile": None, "user": None}
    i = 1
    while i < len(args) and args[i] != "--":
        flag = args[i]
        if flag in ("-h", "--help"):
            raise SystemExit(USAGE)
        if i + 1 >= len(args):
            raise SystemExit(f"sprout-runtime: {flag} needs a value")
        value = args[i + 1]
        if flag == "--env":
            key, sep, val = value.partition("=")
            if not sep:
                raise SystemExit(f"sprout-runtime: --env wants KEY=VALUE, got {value!r}")
            opts["env"][key] = val
        elif flag == "--cwd":
            opts["cwd"] = value
        elif flag == "--timeout":
            opts["timeout"] = float(value)
        elif flag == "--status-fd":
            opts["status_fd"] = int(value)
        elif flag == "--profile":
            opts["profile"] = value
        elif flag == "--user":
            opts["user"] = value
        else:
            raise SystemExit(f"sprout-runtime: unknown option {flag}\n" + USAGE)
        i += 2
    argv = args[i + 1:]
    if not argv or not opts["profile"]:
        raise SystemExit("sprout-runtime: " + USAGE)
    return opts, argv


def main(args: list[str]) -> int:
    opts, argv = parse_args(args)
    if opts["status_fd"] is not None:
        os.set_inheritable(opts["status_fd"], False)  # the command must not inherit it
    try:
        with open(opts["profile"], "rb") as f:
            profile = marshal.loads(f.read())
    except OSError as e:
        sys.stderr.write(f"sprout-runtime: cannot read exec profile {opts['profile']}: {e.strerror}\n")
        return EXIT_RUNTIME_ERROR
    if opts["user"]:
        profile = as_user(profile, opts["user"])
    try:
        return run(profile, opts["cwd"], opts["env"], argv, opts["timeout"], opts["status_fd"])
    except RuntimeFailure as e:
        sys.stderr.write(f"sprout-runtime: {e}\n")
        return EXIT_RUNTIME_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
