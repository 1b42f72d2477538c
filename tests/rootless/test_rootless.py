"""Sprout as a user without root (issue 29): what only a rootless run shows. .ci/rootless runs these, with
the other tests marked `rootless` (an agent run and its resume, the gate and an evaluation over a Run Store,
hostile sandboxes), as a throwaway user that ops/setup_podman.sh set up with sudo, inside that user's podman
namespace (the conftest enters it, as the `sprout` command does). As root, these are deselected.

    .venv/bin/python -m pytest -m rootless      # as that user
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sprout import rootless
from sprout.sandbox import Store, btrfs, confinement, processes
from sprout.sandbox.errors import TransferError
from tests.conftest import (
    DEBIAN_IMAGE,
    MAIN_THREAD_EXITS,
    PYTHON_IMAGE,
    REPO,
    RUNTIME_BIN,
    running_thread_names,
)

pytestmark = pytest.mark.rootless


@pytest.fixture(autouse=True)
def _rootless() -> None:
    assert rootless.entered(), "run these tests as a user without root (.ci/rootless does), not as root"


def _uid_map() -> list[list[int]]:
    return [[int(n) for n in line.split()] for line in Path("/proc/self/uid_map").read_text().splitlines()]


def test_files_keep_the_images_owners_and_map_onto_the_users_ids(store: Store):
    sandbox = store.create_sandbox(DEBIAN_IMAGE)
    assert sandbox.exec("stat -c %u:%g /etc/shadow && id -u").output.split() == ["0:42", "0"]
    shadow = (sandbox.rootfs / "etc" / "shadow").stat()
    assert (shadow.st_uid, shadow.st_gid) == (0, 42)  # seen from Sprout's side of the namespace too
    user, subordinate = _uid_map()
    assert user == [0, rootless.user_id(), 1] and subordinate[0] == 1 and subordinate[2] >= 65536
    assert os.stat(store.root).st_uid == 0  # the store is the user's: uid 0 here


CONFINEMENT = ("grep -E '^(Cap(Eff|Prm|Bnd|Inh)|NoNewPrivs|Seccomp|Seccomp_filters):' /proc/self/status && "
               "python3 -c 'import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
               "[(libc.syscall(n, -1, 0, 0, 0), print(n, ctypes.get_errno())) for n in (278, 1000)]'")


def test_the_runtime_confines_as_podman_exec_does_with_a_filter_compiled_from_runcs_state(base_store: Store):
    """Rootless, the container's seccomp filter cannot be read (ptrace's SECCOMP_GET_FILTER needs
    CAP_SYS_ADMIN): sprout-runtime loads the one compiled from runc's state instead. A command through it
    has podman exec's capabilities, no_new_privs and one filter, which answers as podman exec's does:
    EPERM for vmsplice (the profile denies it), ENOSYS for a syscall number no kernel has."""
    fast, slow = Store(base_store.root, runtime_bin=RUNTIME_BIN), Store(base_store.root, runtime_bin=None)
    sandbox = fast.create_sandbox(PYTHON_IMAGE)
    try:
        profile = confinement.read(sandbox.profile_path)
        assert not profile["seccomp_unread"] and len(profile["seccomp"]) == 1
        via_runtime = sandbox.exec(CONFINEMENT)
        via_podman = slow.sandbox(sandbox.id).exec(CONFINEMENT)
        assert via_runtime.exit_code == via_podman.exit_code == 0, via_runtime.output + via_podman.output
        assert via_runtime.output == via_podman.output
        assert "Seccomp:\t2\nSeccomp_filters:\t1\n278 1\n1000 38\n" in via_runtime.output, via_runtime.output
        assert "NoNewPrivs:\t1" in via_runtime.output
    finally:
        sandbox.destroy()


def test_checkpoint_freezes_and_continues_and_a_branch_has_its_files(store: Store):
    sandbox = store.create_sandbox(PYTHON_IMAGE)
    sandbox.exec("echo one > /tmp/file && (setsid sleep 300 >/dev/null 2>&1 &)")
    profile = confinement.read(sandbox.profile_path)
    assert profile["cgroup_procs"] == []  # rootless on cgroup v1: none of its own, found by PID namespace
    deadline = time.monotonic() + 10
    while not (sleeper := [pid for pid, _ in processes.processes(profile) if _cmdline(pid) == b"sleep\x00300\x00"]):
        assert time.monotonic() < deadline, "the background sleep never started"
        time.sleep(0.05)
    checkpoint = sandbox.checkpoint()
    assert _state(sleeper[0]) in "RS"  # stopped for the snapshot, continued after it
    sandbox.exec("echo two > /tmp/file")
    branch = checkpoint.branch()
    assert branch.exec("cat /tmp/file").output == "one\n"
    assert sandbox.exec("cat /tmp/file").output == "two\n"
    with processes.frozen(profile) as ok:
        assert ok and _state(sleeper[0]) == "T"
    assert _state(sleeper[0]) in "RS"


def test_a_timeout_kills_what_the_command_left_behind(store: Store):
    sandbox = store.create_sandbox(DEBIAN_IMAGE)
    profile = confinement.read(sandbox.profile_path)
    before = processes.processes(profile)
    started = time.monotonic()
    result = sandbox.exec("(setsid sh -c 'sleep 1000' &) ; (nohup sleep 1001 &) ; sleep 1002", timeout=2)
    assert result.exit_code == 124 and time.monotonic() - started < 30
    assert processes.processes(profile) == before
    assert sandbox.exec("echo still here").output == "still here\n"


def test_a_process_whose_main_thread_exited_is_killed_at_a_timeout_and_stopped_by_a_freeze(store: Store):
    """Rootless, a sandbox's processes are found in /proc by PID namespace, and zombies are left out. A
    process whose main thread exited reads as one there while its other threads run on: a timeout must
    still kill it and a freeze (a checkpoint's) stop it."""
    sandbox = store.create_sandbox(PYTHON_IMAGE)
    profile = confinement.read(sandbox.profile_path)
    sandbox.exec(["python3", "-c", "import sys; open('/root/t.py', 'w').write(sys.argv[1])", MAIN_THREAD_EXITS])
    before = processes.processes(profile)
    assert sandbox.exec("(setsid python3 /root/t.py &) ; sleep 1 ; sleep 1000", timeout=3).timed_out
    assert processes.processes(profile) == before
    assert "python3" not in running_thread_names(sandbox)
    sandbox.exec("(setsid python3 /root/t.py &) ; sleep 1")
    [(escaped, _start)] = processes.processes(profile) - before  # its running thread keeps it in the list
    with processes.frozen(profile) as ok:
        assert ok and _thread_states(escaped) == "TZ"
    assert _thread_states(escaped) in ("RZ", "SZ")


def _thread_states(pid: int) -> str:
    """The state letters of the process's threads, sorted."""
    return "".join(sorted(_state(f"{pid}/task/{tid}") for tid in os.listdir(f"/proc/{pid}/task")))


def test_host_side_reads_resolve_links_inside_the_sandbox_and_refuse_fifos(store: Store):
    sandbox = store.create_sandbox(DEBIAN_IMAGE)
    sandbox.exec("ln -s /../../../../../etc/passwd /tmp/up && mkfifo /tmp/fifo")
    with sandbox.files() as files:
        passwd = files.read_file("/tmp/up", 1 << 20)
        assert passwd is not None and passwd.startswith(b"root:x:0:0") and os.environ["USER"].encode() not in passwd
        with pytest.raises(TransferError):
            files.read_file("/tmp/fifo", 1 << 20)


def test_subvolumes_nested_and_read_only_are_deleted_by_their_owner(base_store: Store):
    top = base_store.root / "cache" / f"nested-{os.getpid()}"
    btrfs.create(top)
    (top / "a" / "b").mkdir(parents=True)
    btrfs.create(top / "a" / "b" / "inner")
    btrfs.create(top / "a" / "b" / "inner" / "deeper")
    btrfs.snapshot(top / "a" / "b" / "inner", top / "frozen", readonly=True)
    btrfs.set_readonly(top)
    btrfs.delete(top)
    assert not top.exists()


def test_doctor_passes_and_says_what_differs_rootless():
    done = subprocess.run([str(REPO / ".venv" / "bin" / "sprout"), "doctor", "--json"], capture_output=True,
                          text=True, timeout=300)
    report = json.loads(done.stdout)
    checks = {check["name"]: check for check in report["checks"]}
    assert report["ok"] and done.returncode == 0, done.stdout + done.stderr
    assert f"uid {rootless.user_id()}, in podman's user namespace" in checks["rootless"]["detail"]
    assert "user_subvol_rm_allowed" in checks["store mount"]["detail"]
    assert "sets no memory, pids or CPU limit" in checks["rootless limits"]["detail"]
    assert "SIGSTOP" in checks["rootless freeze"]["detail"] and "smoke test" in checks


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _state(pid: int | str) -> str:
    """The state letter in /proc/PID/stat (or PID/task/TID, a thread's)."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return chr(stat[stat.rindex(b")") + 2])


def test_a_signal_to_the_store_owner_namespace_never_reaches_other_processes(store: Store):
    """Stopping a sandbox's processes (SIGSTOP by PID namespace) leaves the user's own processes alone."""
    outside = subprocess.Popen(["sleep", "300"])
    try:
        sandbox = store.create_sandbox(DEBIAN_IMAGE)
        with processes.frozen(confinement.read(sandbox.profile_path)) as ok:
            assert ok and _state(outside.pid) in "RS"
    finally:
        outside.send_signal(signal.SIGKILL)
        outside.wait()
