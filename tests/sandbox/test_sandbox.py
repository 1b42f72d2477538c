"""Sandbox store on real podman + btrfs: files across checkpoints and branches, exec, limits, recovery."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sprout.sandbox import InUseError, SandboxStateError, Store, btrfs, confinement
from tests.conftest import DEBIAN_IMAGE, PYTHON_IMAGE, drop_store, every_backend


def read(sandbox, path: str) -> str:
    result = sandbox.exec(f"cat {path} 2>/dev/null || echo MISSING")
    return result.output.strip()


@every_backend
def test_files_across_checkpoint_branch_and_branch_of_branch(store):
    a = store.create_sandbox(DEBIAN_IMAGE)
    assert a.exec("echo one > /root/f && echo keep > /tmp/t").exit_code == 0
    cp1 = a.checkpoint(label="one")
    a.exec("echo two > /root/f")
    cp2 = a.checkpoint(label="two")
    assert cp2.parent == cp1.id
    b = cp1.branch()
    assert read(b, "/root/f") == "one" and read(b, "/tmp/t") == "keep"
    b.exec("echo bee > /root/f && echo new > /root/only-b")
    cp_b = b.checkpoint()
    assert cp_b.parent == cp1.id
    c = cp_b.branch()
    assert read(c, "/root/f") == "bee" and read(c, "/root/only-b") == "new"
    c.exec("echo see > /root/f")
    # no change in one shows in another
    assert read(a, "/root/f") == "two" and read(a, "/root/only-b") == "MISSING"
    assert read(b, "/root/f") == "bee"
    assert read(cp2.branch(), "/root/f") == "two"
    # checkpoints are read-only and unchanged (a microVM's files are inside the disk file it holds)
    if a.backend == "microvm":
        with pytest.raises(OSError):
            (cp1.path / "disk.img").write_bytes(b"tamper")
        assert read(cp1.branch(), "/root/f") == "one"
        return
    assert (cp1.path / "root/f").read_text() == "one\n"
    with pytest.raises(OSError):
        (cp1.path / "root/f").write_text("tamper")


@every_backend
def test_exec_result_cwd_env_and_no_host_env(store, monkeypatch):
    monkeypatch.setenv("SPROUT_TEST_SECRET", "hunter2")
    sb = store.create_sandbox(PYTHON_IMAGE)
    result = sb.exec("pwd; echo $FOO; env", cwd="/tmp", env={"FOO": "bar"})
    lines = result.output.splitlines()
    assert result.exit_code == 0 and lines[:2] == ["/tmp", "bar"]
    assert "hunter2" not in result.output
    assert "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in lines
    assert result.duration > 0
    assert sb.exec("exit 3").exit_code == 3
    missing = sb.exec("true", cwd="/no/such/dir")
    assert missing.exit_code != 0 and "/no/such/dir" in missing.output


@every_backend
def test_output_is_capped_with_a_marker(store):
    sb = store.create_sandbox(DEBIAN_IMAGE)
    result = sb.exec("head -c 100000 /dev/zero | tr '\\0' x; echo; echo END", max_output=1000)
    assert result.truncated and "bytes of output omitted" in result.output
    assert result.output.startswith("x" * 100) and result.output.rstrip().endswith("END")


@every_backend
def test_timeout_kills_the_whole_process_tree(store):
    sb = store.create_sandbox(DEBIAN_IMAGE)
    started = time.monotonic()
    result = sb.exec("(sleep 301 &) ; sleep 302 & bash -c 'sleep 303'", timeout=1)
    assert result.timed_out and result.exit_code == 124
    assert time.monotonic() - started < 10
    survivors = sb.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").output
    assert "sleep 30" not in survivors, survivors


@every_backend
def test_a_timeout_or_cancel_before_the_command_entered_the_sandbox_still_stops_it(store):
    """A timeout or a cancel that comes while the client is still entering the sandbox (`podman exec` takes
    ~0.1 s, seconds under load) finds nothing to kill yet: the command must still be killed once it is
    there, not run on. A cancel set before the call (an exec that waited for a thread) runs nothing."""
    sb = store.create_sandbox(DEBIAN_IMAGE)
    started = time.monotonic()
    assert sb.exec("sleep 13", timeout=0.001).timed_out
    cancel = threading.Event()
    threading.Timer(0.001, cancel.set).start()
    cancelled = sb.exec("sleep 14", cancel=cancel)
    assert time.monotonic() - started < 10  # the cancelled sleep did not run to its end
    assert cancelled.timed_out and cancelled.exit_code == 124  # reported as a timeout, on every backend
    assert sb.exec("echo ran > /tmp/ran", cancel=cancel).timed_out
    left = sb.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").output
    assert "sleep 13" not in left and "sleep 14" not in left, left
    assert sb.exec("test -e /tmp/ran").exit_code == 1


def _named_then_exec(name: str) -> subprocess.Popen:
    """A process named `name` (as runc's init is) that after 0.5 s execs `sleep 30` with the environment
    MARK=program, as a container's init execs its program."""
    code = (f"import ctypes, os, time; ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0); time.sleep(0.5); "
            "os.execve('/bin/sleep', ['sleep', '30'], {'MARK': 'program'})")
    child = subprocess.Popen([sys.executable, "-c", code])
    while Path(f"/proc/{child.pid}/comm").read_text().strip() != name:
        time.sleep(0.01)
    return child


@pytest.mark.python_only
def test_the_profile_is_read_once_the_init_runs_the_containers_program():
    """podman run returns while runc's init (runc:[2:INIT]) may still be about to exec the container's
    program: what the profile reads off it (the environment commands get) must be the program's."""
    child = _named_then_exec("runc:[2:INIT]")
    try:
        confinement.wait_for_exec(child.pid)
        assert Path(f"/proc/{child.pid}/comm").read_text() == "sleep\n"
        assert Path(f"/proc/{child.pid}/environ").read_bytes() == b"MARK=program\0"
    finally:
        child.kill()
        child.wait()
    stuck = _named_then_exec("runc:[2:INIT]")
    stuck.send_signal(signal.SIGSTOP)  # never gets to its exec
    try:
        with pytest.raises(SandboxStateError, match="did not start its program in 0.3s"):
            confinement.wait_for_exec(stuck.pid, timeout_s=0.3)
    finally:
        stuck.kill()
        stuck.wait()


def test_confinement_matches_podman_exec(base_store, tmp_path):
    """The runtime's commands carry the same capabilities, no_new_privs, seccomp and cgroups as podman exec."""
    from tests.conftest import RUNTIME_BIN

    fast = Store(base_store.root, runtime_bin=RUNTIME_BIN)
    slow = Store(base_store.root, runtime_bin=None)
    sb = fast.create_sandbox(DEBIAN_IMAGE)
    try:
        probe = ("grep -E '^(Cap|NoNewPrivs|Seccomp|Umask|Uid|Gid|Groups)' /proc/self/status; "
                 "cat /proc/self/cgroup | sort; cat /proc/self/limits")
        via_runtime = sb.exec(probe).output
        via_podman = slow.sandbox(sb.id).exec(probe).output
        assert via_runtime == via_podman
        assert "NoNewPrivs:\t1" in via_runtime and "Seccomp:\t2" in via_runtime
        assert "CapEff:\t000001ffffffffff" not in via_runtime and "CapEff:\t00000000800405fb" in via_runtime
        assert sb.container.removeprefix("sprout-") in via_runtime or "libpod" in via_runtime
    finally:
        sb.destroy()


@pytest.mark.parametrize("limit", ["memory", "pids"])
def test_limits_hold(store, limit):
    if limit == "memory":
        sb = store.create_sandbox(PYTHON_IMAGE, memory="64m")
        result = sb.exec("python3 -c 'x = bytearray(300 * 1024 * 1024); print(len(x))'")
        assert result.exit_code == 137, result
    else:
        sb = store.create_sandbox(DEBIAN_IMAGE, pids=20)
        result = sb.exec("for i in $(seq 40); do sleep 5 & done 2>&1; wait", timeout=20)
        assert "retry" in result.output.lower() or "resource temporarily unavailable" in result.output.lower()


def test_no_network_option(store):
    sb = store.create_sandbox(DEBIAN_IMAGE, network=False)
    links = sb.exec("cat /proc/net/dev").output
    assert "lo:" in links and "eth0" not in links
    with_net = store.create_sandbox(DEBIAN_IMAGE)
    assert "eth0" in with_net.exec("cat /proc/net/dev").output


def test_destroy_leaves_nothing_mounted_or_running(store):
    sb = store.create_sandbox(DEBIAN_IMAGE)
    sb.exec("sleep 1000 &")
    path, container = sb.path, sb.container
    sb.destroy()
    assert not path.exists()
    assert str(path) not in Path("/proc/mounts").read_text()
    names = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True).stdout
    assert container not in names.split()


@every_backend
def test_deleting_a_running_sandbox_is_refused(store):
    sb = store.create_sandbox(DEBIAN_IMAGE)
    with pytest.raises(SandboxStateError):
        store.remove_sandbox(sb.id)
    assert sb.running and sb.exec("true").exit_code == 0


def test_nested_subvolume_does_not_break_checkpoint_or_delete(store):
    sb = store.create_sandbox(PYTHON_IMAGE)
    make = ("python3 -c \"import fcntl, os, struct; fd = os.open('/root', os.O_RDONLY); "
            "fcntl.ioctl(fd, 0x5000940e, bytearray(struct.pack('q4088s', 0, b'nested')))\" && touch /root/nested/x && echo made")
    result = sb.exec(make)
    assert "made" in result.output, result  # a default container can make one: the case this test guards
    assert btrfs.nested_subvolume_ids(sb.path)
    cp = sb.checkpoint()
    assert cp.exists
    sb.destroy()
    assert not sb.path.exists()


def test_restart_after_the_container_dies(store):
    sb = store.create_sandbox(DEBIAN_IMAGE)
    sb.exec("echo survived > /root/state")
    cp = sb.checkpoint()
    profile_pid = int(subprocess.run(["podman", "inspect", "-f", "{{.State.Pid}}", sb.container],
                                     capture_output=True, text=True).stdout)
    os.kill(profile_pid, signal.SIGKILL)  # what a host restart does to the sandbox's processes
    for _ in range(50):
        if not sb.running:
            break
        time.sleep(0.1)
    assert store.sandbox(sb.id).state == "stopped"
    with pytest.raises(SandboxStateError):
        sb.exec("true")
    assert cp.exists and store.checkpoint(cp.id).id == cp.id
    sb.start()
    assert sb.state == "running" and read(sb, "/root/state") == "survived"


def test_checkpoint_with_branches_refused_and_gc_keeps_referenced(store, tmp_path_factory):
    # gc with older_than_s=0 collects every unreferenced checkpoint: give it a store of its own
    root = store.root / "test-stores" / tmp_path_factory.mktemp("gc").name
    store = Store(root, runtime_bin=store.runtime_bin)
    a = store.create_sandbox(store.import_image(DEBIAN_IMAGE))
    cp1 = a.checkpoint()
    a.exec("echo x > /root/x")
    cp2 = a.checkpoint()  # child of cp1, nothing branches from it
    branch = cp1.branch()
    with pytest.raises(InUseError):
        cp1.delete()
    stray = store.root / "checkpoints" / "ck-stray000000"
    btrfs.create(stray)  # what a crash between snapshot and metadata leaves
    assert "ck-stray000000" not in {c.id for c in store.checkpoints()}
    removed = store.gc(older_than_s=0)
    assert f"checkpoint {cp2.id}" in removed and "orphan checkpoint subvolume ck-stray000000" in removed
    assert cp1.exists and store.checkpoint(cp1.id)
    assert not stray.exists() and not cp2.exists
    assert any(im.key == a.image_key for im in store.images())
    branch.destroy()
    a.destroy()
    for checkpoint in store.checkpoints():
        checkpoint.delete()
    drop_store(root)


def test_image_config_is_applied(store, tmp_path):
    (tmp_path / "Containerfile").write_text(
        f"FROM {DEBIAN_IMAGE}\nRUN useradd -m agent && mkdir /work && chown agent /work\n"
        "ENV GREETING=hello\nWORKDIR /work\nUSER agent\n")
    tag = "localhost/sprout-test/config:1"
    from sprout.sandbox.podman import command as podman_command

    subprocess.run([*podman_command(), "build", "-q", "--pull=never", "-t", tag, str(tmp_path)], check=True,
                   capture_output=True)
    image = store.import_image(tag)
    assert image.config.user == "agent" and image.config.workdir == "/work"
    sb = store.create_sandbox(image)
    result = sb.exec("id -un; pwd; echo $GREETING; grep CapEff /proc/self/status")
    assert result.output.split("\n")[:4] == ["agent", "/work", "hello", "CapEff:\t0000000000000000"]
    as_root = sb.exec("id -un; grep CapEff /proc/self/status; touch /etc/only-root", user="root")
    assert as_root.output.split("\n")[:2] == ["root", "CapEff:\t00000000800405fb"] and as_root.exit_code == 0
    assert sb.exec("id -u; id -g", user="1000:0").output.split() == ["1000", "0"]


def test_a_command_as_another_user_is_confined_like_podman_exec(base_store):
    from tests.conftest import RUNTIME_BIN

    fast = Store(base_store.root, runtime_bin=RUNTIME_BIN)
    sb = fast.create_sandbox(DEBIAN_IMAGE)
    try:
        sb.exec("useradd -m -G users someone")
        probe = "grep -E '^(Cap|NoNewPrivs|Seccomp|Uid|Gid|Groups)' /proc/self/status"
        for user in ("someone", "root", "nobody"):
            via_runtime = sb.exec(probe, user=user).output
            via_podman = Store(base_store.root, runtime_bin=None).sandbox(sb.id).exec(probe, user=user).output
            assert via_runtime == via_podman, user
    finally:
        sb.destroy()


@every_backend
def test_a_branch_keeps_the_limits_of_its_sandbox_after_that_sandbox_is_gone(store):
    sb = store.create_sandbox(DEBIAN_IMAGE, network=False, memory="256m")
    cp = sb.checkpoint()
    sb.destroy()
    branch = store.checkpoint(cp.id).branch()
    assert branch.limits["network"] is False and branch.limits["memory"] == "256m"
    assert "eth0" not in branch.exec("cat /proc/net/dev").output
    branch.destroy()
    cp.delete()


@every_backend
def test_threads_share_a_store(store):
    from concurrent.futures import ThreadPoolExecutor

    sb = store.create_sandbox(DEBIAN_IMAGE)
    with ThreadPoolExecutor(4) as pool:
        checkpoints = list(pool.map(lambda i: sb.checkpoint(label=f"t{i}"), range(8)))
    assert len({c.id for c in checkpoints}) == 8 and all(store.checkpoint(c.id).exists for c in checkpoints)
    for checkpoint in checkpoints:
        checkpoint.delete()
