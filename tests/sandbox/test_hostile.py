"""What an agent does from inside its sandbox must not hurt the host, other sandboxes or their checkpoints.

Each test does the hostile thing for real, from inside a real sandbox (podman + btrfs)."""

import hashlib
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sprout.sandbox import SandboxStateError, Store, btrfs, processes
from tests.conftest import (
    MAIN_THREAD_EXITS,
    PYTHON_IMAGE,
    RUNTIME_BIN,
    VFORK_CHILD_STOPS,
    every_backend,
    removing_what_is_made,
    running_thread_names,
)

SUBVOL_CREATE = 0x5000940E  # BTRFS_IOC_SUBVOL_CREATE: a default container (no CAP_SYS_ADMIN) may call it

MAKE_SUBVOLUME = textwrap.dedent("""\
    import fcntl, os, struct, sys
    def subvolume(directory, name):
        fd = os.open(directory, os.O_RDONLY)
        fcntl.ioctl(fd, 0x5000940E, bytearray(struct.pack('q4088s', 0, name.encode())))
        os.close(fd)
""")


@pytest.fixture
def rt_store(base_store: Store):
    """Commands through sprout-runtime; every sandbox and checkpoint a test makes is removed afterwards."""
    with removing_what_is_made(Store(base_store.root, runtime_bin=RUNTIME_BIN)) as st:
        yield st


def run_python(sandbox, code: str, timeout: float = 120):
    sandbox.exec(["python3", "-c", "import sys; open('/root/s.py', 'w').write(sys.argv[1])", code])
    return sandbox.exec(["python3", "/root/s.py"], timeout=timeout)


@pytest.mark.rootless
def test_crafted_nested_subvolume_names_cannot_make_destroy_delete_another_checkpoint(rt_store):
    victim = rt_store.create_sandbox(PYTHON_IMAGE)
    victim.exec("echo precious > /root/data")
    precious = victim.checkpoint(label="victim")
    attacker = rt_store.create_sandbox(PYTHON_IMAGE)
    # `btrfs subvolume list` prints names raw: a newline and " path " in a directory name forge a line whose
    # path, once the sandbox's own prefix is cut off, is the victim checkpoint's absolute path
    mount = subprocess.run(["findmnt", "-n", "-o", "TARGET", "--target", str(attacker.path)], capture_output=True,
                           text=True, check=True).stdout.strip()
    own = str(attacker.path.relative_to(mount))  # its path from the filesystem's top
    forged = "a\nX path " + "P" * (len(own) + 1)
    target_dir = f"/{forged}{rt_store.root}/checkpoints"  # its first line names the real subvolume /a
    code = MAKE_SUBVOLUME + textwrap.dedent(f"""
        subvolume('/', 'a')
        os.makedirs({target_dir!r})
        subvolume({target_dir!r}, {precious.id!r})
        print('made')
    """)
    assert "made" in run_python(attacker, code).output
    assert len(btrfs.nested_subvolume_paths(attacker.path)) == 2  # rootless, they are deleted by these paths
    attacker.destroy()
    assert precious.exists and (precious.path / "root/data").read_text() == "precious\n"
    assert not attacker.path.exists()
    assert precious.branch().exec("cat /root/data").output == "precious\n"


def test_a_thousand_nested_subvolumes_are_deleted_without_recursion(rt_store):
    attacker = rt_store.create_sandbox(PYTHON_IMAGE)
    code = MAKE_SUBVOLUME + textwrap.dedent("""
        sys.setrecursionlimit(100)
        path = '/root'
        for _ in range(1100):
            subvolume(path, 'n')
            path += '/n'
        print('made')
    """)
    assert "made" in run_python(attacker, code, timeout=300).output
    assert len(btrfs.nested_subvolume_ids(attacker.path)) == 1100
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # deletion must not depend on the depth of the nesting
    try:
        attacker.destroy()
    finally:
        sys.setrecursionlimit(before)
    assert not attacker.path.exists()
    listed = subprocess.run(["btrfs", "subvolume", "list", str(rt_store.root)], capture_output=True,
                            text=True)
    assert attacker.id not in listed.stdout


def test_exec_as_a_user_never_reads_host_files_through_sandbox_links(rt_store, tmp_path):
    secret = tmp_path / "passwd"
    secret.write_text("root:x:4242:4242:host file:/:/bin/sh\n")
    sb = rt_store.create_sandbox(PYTHON_IMAGE)
    sb.exec(f"ln -sf {secret} /etc/passwd")
    assert sb.exec("id -u", user="root").output.strip() == "0"  # the link points nowhere inside the sandbox
    sb.exec("ln -sf /dev/zero /etc/passwd; ln -sf /dev/zero /etc/group")
    started = time.monotonic()  # a host-side read of /dev/zero would never end: the exec's own deadline bounds it
    result = sb.exec("id -u", user="root", timeout=30)
    assert result.output.strip() == "0" and not result.timed_out
    assert time.monotonic() - started < 30


@pytest.mark.rootless
def test_a_fifo_as_etc_passwd_blocks_nothing_on_the_host(rt_store):
    sb = rt_store.create_sandbox(PYTHON_IMAGE)
    assert sb.exec("rm /etc/passwd && mkfifo /etc/passwd && echo made").output.strip() == "made"
    started = time.monotonic()
    if rt_store.runtime_bin is None:  # rootless: commands go through `podman exec`, whose runc would read it
        with pytest.raises(SandboxStateError, match="/etc/passwd in the sandbox is not a regular file"):
            sb.exec(["/bin/echo", "ran"], user="root", timeout=30)
    else:  # the runtime resolves users itself, reading regular files only
        result = sb.exec(["/bin/echo", "ran"], user="root", timeout=30)  # bash itself would read the FIFO
        assert result.output.strip() == "ran" and not result.timed_out
    assert time.monotonic() - started < 30
    checkpoint = sb.checkpoint()
    started = time.monotonic()
    with pytest.raises(SandboxStateError, match="/etc/passwd in the sandbox is not a regular file"):
        checkpoint.branch()  # runc would block on the FIFO (or read the device) for ever
    assert time.monotonic() - started < 10
    assert not any(s.base_checkpoint == checkpoint.id for s in rt_store.sandboxes())


@every_backend
def test_timeout_kills_what_escaped_the_session_and_the_environment(store):
    sb = store.create_sandbox(PYTHON_IMAGE)
    sb.exec("nohup sleep 999 >/dev/null 2>&1 &")  # started before: must survive
    command = ("setsid sleep 1002 >/dev/null 2>&1 & "
               "env -i /bin/sh -c 'setsid /bin/sh -c \"sleep 1003 & sleep 1004\" &' >/dev/null 2>&1; "
               "sleep 1000")
    result = sb.exec(command, timeout=2)
    assert result.timed_out and result.exit_code == 124  # and what it killed is gone: no wait here
    running = sb.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").output
    assert "sleep 999" in running
    for leftover in ("sleep 1000", "sleep 1002", "sleep 1003", "sleep 1004"):
        assert leftover not in running, running


@every_backend
def test_timeout_kills_a_process_whose_main_thread_exited(store):
    """A process whose main thread exited reads as a zombie while its other threads run on: a timeout must
    kill it too (the microVM agent, and rootless sandboxes (tests/rootless), find processes in /proc, where
    zombies are skipped)."""
    sb = store.create_sandbox(PYTHON_IMAGE)
    sb.exec(["python3", "-c", "import sys; open('/root/t.py', 'w').write(sys.argv[1])", MAIN_THREAD_EXITS])
    result = sb.exec("(setsid python3 /root/t.py &) ; sleep 1 ; sleep 1000", timeout=3)
    assert result.timed_out and result.exit_code == 124
    assert "python3" not in running_thread_names(sb)


WRITER = textwrap.dedent("""\
    import os
    line = b"x" * 99 + b"\\n"
    n = 0
    with open('/root/log', 'ab', buffering=0) as log:
        while True:
            log.write(line * 8)
            n += 1
            with open('/root/data.tmp', 'wb') as f:
                f.write(str(n).encode() * 20000)
            os.rename('/root/data.tmp', '/root/data')
""")


@pytest.mark.rootless
def test_a_checkpoint_does_not_wait_for_a_parent_whose_vfork_child_stopped_before_its_exec(rt_store):
    """A vfork parent cannot stop until its child execs or exits. A child stopped before its exec (by itself,
    as here, or by a rootless freeze's SIGSTOP landing between posix_spawn's clone and exec) must not make
    every checkpoint wait for the parent, time out and fail."""
    sb = rt_store.create_sandbox(PYTHON_IMAGE)
    sb.exec(["python3", "-c", "import sys; open('/root/v.py', 'w').write(sys.argv[1])", VFORK_CHILD_STOPS])
    sb.exec("(setsid python3 /root/v.py >/dev/null 2>&1 &); sleep 1")
    states = sb.exec("for s in /proc/[0-9]*/stat; do read -r _ comm state _ < $s; echo $comm $state; done").output
    assert sorted(line for line in states.splitlines() if "python3" in line) == ["(python3) D", "(python3) T"]
    started = time.monotonic()
    sb.checkpoint()
    assert time.monotonic() - started < processes.FREEZE_TIMEOUT_S


@pytest.mark.rootless
def test_checkpoints_under_a_writer_are_point_in_time(rt_store):
    sb = rt_store.create_sandbox(PYTHON_IMAGE)
    sb.exec(["python3", "-c", "import sys; open('/root/w.py', 'w').write(sys.argv[1])", WRITER])
    sb.exec("nohup python3 /root/w.py >/dev/null 2>&1 &")
    time.sleep(0.5)
    bad = []
    for i in range(15):
        checkpoint = sb.checkpoint(label=f"under write {i}")
        log = (checkpoint.path / "root/log").read_bytes()
        data = (checkpoint.path / "root/data").read_bytes()
        if len(log) % 800 or b"\0" in log or not data or len(set(data)) > 10 or len(data) % 20000:
            bad.append((i, len(log), log.count(b"\0"), len(data)))
        time.sleep(0.05)
    assert bad == [], f"checkpoints that are not point-in-time: {bad}"


def test_a_checkpoint_right_after_a_big_write_holds_all_of_it(rt_store):
    """The writeback runs before the freeze now; what the agent wrote just before still lands whole."""
    sb = rt_store.create_sandbox(PYTHON_IMAGE)
    digest = sb.exec("head -c 96M /dev/urandom > /root/big && sha256sum /root/big").output.split()[0]
    checkpoint = sb.checkpoint()
    assert hashlib.sha256((checkpoint.path / "root/big").read_bytes()).hexdigest() == digest


def test_gc_racing_creation_in_another_process_removes_nothing_being_made(rt_store, tmp_path):
    maker = tmp_path / "maker.py"
    maker.write_text(textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from sprout.sandbox import Store
        store = Store({str(rt_store.root)!r}, runtime_bin=Path({str(RUNTIME_BIN)!r}))
        for i in range(6):
            sb = store.create_sandbox({PYTHON_IMAGE!r}, label="race")
            cp = sb.checkpoint()
            print(sb.id, cp.id, sb.exec("echo alive").output.strip(), flush=True)
    """))
    rt_store.gc()  # only what gc removes while the maker runs is in question here
    proc = subprocess.Popen([sys.executable, str(maker)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[2])
    removed = []
    while proc.poll() is None:
        removed += rt_store.gc()
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    made = [line.split() for line in out.splitlines()]
    assert len(made) == 6 and all(alive == "alive" for _, _, alive in made)
    for sandbox_id, checkpoint_id, _ in made:
        assert rt_store.sandbox(sandbox_id).exec("echo still").output.strip() == "still"
        assert rt_store.checkpoint(checkpoint_id).exists
    assert removed == []


def test_gc_drops_rows_whose_subvolume_is_gone(rt_store):
    sb = rt_store.create_sandbox(PYTHON_IMAGE)
    checkpoint = sb.checkpoint()
    sb.stop()
    btrfs.delete(sb.path)
    btrfs.delete(checkpoint.path)
    removed = rt_store.gc()
    assert f"sandbox {sb.id} whose subvolume is gone" in removed
    assert f"checkpoint {checkpoint.id} whose subvolume is gone" in removed
    assert sb.id not in {s.id for s in rt_store.sandboxes()}
    assert checkpoint.id not in {c.id for c in rt_store.checkpoints()}


def test_gc_reaps_what_a_killed_owner_left_running(rt_store, tmp_path):
    owner = tmp_path / "owner.py"
    owner.write_text(textwrap.dedent(f"""
        import time
        from pathlib import Path
        from sprout.sandbox import Store
        store = Store({str(rt_store.root)!r}, runtime_bin=Path({str(RUNTIME_BIN)!r}), owner={{"job": 7}})
        sb = store.create_sandbox({PYTHON_IMAGE!r})
        kept = sb.checkpoint()
        store.adopt([kept.id])
        dropped = sb.checkpoint()
        print(sb.id, kept.id, dropped.id, flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(owner)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    sandbox_id, kept, dropped = proc.stdout.readline().split()
    assert rt_store.sandbox(sandbox_id).running
    assert not any(sandbox_id in line for line in rt_store.gc())  # its owner is alive
    proc.kill()
    proc.wait()
    removed = rt_store.gc()
    assert f"sandbox {sandbox_id} of dead owner job 7, pid {proc.pid}" in removed
    assert sandbox_id not in {s.id for s in rt_store.sandboxes()}
    assert not (rt_store.root / "sandboxes" / sandbox_id).exists()
    assert f"sprout-{sandbox_id}" not in subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"],
                                                         capture_output=True, text=True).stdout
    remaining = {c.id for c in rt_store.checkpoints()}
    assert kept in remaining and dropped not in remaining
    rt_store.remove_checkpoint(kept)


def test_copying_files_out_never_follows_links_out_or_blocks_on_special_files(rt_store, tmp_path):
    from sprout.sandbox import TransferError
    from sprout.sandbox.host_files import HostFiles

    secret = tmp_path / "host-secret"
    secret.write_text("host only\n")
    sb = rt_store.create_sandbox(PYTHON_IMAGE)
    sb.exec(f"mkdir -p /logs && echo 1 > /logs/reward.txt && mkfifo /logs/fifo && ln -s {secret} /logs/leak "
            "&& ln -s /logs/reward.txt /logs/inside")
    out = tmp_path / "out"
    started = time.monotonic()
    files = HostFiles(sb.path)
    files.download_dir("/logs", out)
    assert time.monotonic() - started < 30  # a read of the FIFO would block for ever
    assert sorted(p.name for p in out.iterdir()) == ["inside", "reward.txt"]
    assert (out / "inside").read_text() == "1\n"
    for name in ("fifo", "leak"):
        with pytest.raises(TransferError):
            files.download_file(f"/logs/{name}", tmp_path / name)
