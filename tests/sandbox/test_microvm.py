"""MicroVM sandboxes through the store's own API: real QEMU microVMs (KVM where it runs Debian's kernel,
else TCG) booted from a store image, commands over the guest agent, checkpoints of the disk alone and
of disk + memory as store checkpoints, branches that boot or resume them."""

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sprout.sandbox import Sandbox, SandboxStateError, Store, StoreError, podman
from sprout.sandbox.backends.microvm import DISK_FILE, MEMORY_FILE
from sprout.sandbox.microvm import vm as vm_module
from sprout.sandbox.microvm.vm import MicroVM, VMError
from sprout.sandbox.store import LABEL
from sprout.tasks.cancellable import exec_async
from tests.conftest import PYTHON_IMAGE, REPO, bridge_gateway, removing_what_is_made
from tests.sandbox.test_network_switch import greeter

# The server is listening before the command returns (a fixed sleep lost that race under TCG on a
# loaded host, and the memory checkpoint then held a server that had not bound its port yet).
LISTENING = ("import socket, time\n"
             "for _ in range(600):\n"
             "    try:\n"
             "        socket.create_connection(('127.0.0.1', 8000), 1).close()\n"
             "        break\n"
             "    except OSError:\n"
             "        time.sleep(0.1)\n"
             "else:\n"
             "    raise SystemExit('the server never listened')")
SERVER = ("mkdir -p /srv && cd /srv && echo served-from-turn-2 > index.html && "
          "{ nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 & } && "
          f"python3 -c \"{LISTENING}\"")
FETCH = ("python3 -c \"import urllib.request; "
         "print(urllib.request.urlopen('http://127.0.0.1:8000/').read().decode(), end='')\"")


def qemu_processes(store: Store) -> list[int]:
    """Pids of the QEMU processes running VMs of this store (read from /proc, not from its records)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args[0].endswith(b"qemu-system-x86_64") and str(store.root / "state").encode() in b" ".join(args):
            found.append(int(cmdline.parent.name))
    return found


@pytest.fixture(scope="module")
def vms() -> Iterator[Store]:
    """A store whose new sandboxes are microVMs (512 MB each); what the module makes is removed, and
    no QEMU of the store is left running (checked in /proc: the records alone could hide a leak)."""
    with removing_what_is_made(Store(backend="microvm")) as store:
        yield store
    deadline = time.monotonic() + 10
    while qemu_processes(store) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert qemu_processes(store) == []


def new_vm(vms: Store, **kwargs) -> Sandbox:
    return vms.create_sandbox(PYTHON_IMAGE, memory="512m", **kwargs)


@pytest.fixture(scope="module")
def machine(vms: Store) -> Sandbox:
    return new_vm(vms, label="microvm-test", env={"FROM_SANDBOX": "kept"})


@pytest.fixture(scope="module")
def with_server(vms: Store):
    """A VM that started a server in turn 2 and wrote a file in turn 3, checkpointed with its memory."""
    sandbox = new_vm(vms)
    assert sandbox.exec("echo turn-1 > /root/turn").exit_code == 0
    assert sandbox.exec(SERVER).exit_code == 0
    assert sandbox.exec("echo turn-3 > /root/turn").exit_code == 0
    return sandbox, sandbox.checkpoint(label="turn-3", memory=True)


@pytest.mark.rootless
def test_a_microvm_sandbox_runs_commands_as_a_container_does(machine):
    assert machine.backend == "microvm" and machine.running and machine.state == "running"
    result = machine.exec("pwd; echo $GREETING; id -un; exit 3", cwd="/tmp", env={"GREETING": "hello vm"},
                          user="nobody")
    assert (result.output, result.exit_code, result.timed_out) == ("/tmp\nhello vm\nnobody\n", 3, False)
    seen = machine.exec("echo $PATH $FROM_SANDBOX; cat /etc/hostname; uname -r").output.split()
    assert seen[:2] == [machine.image.config.env["PATH"], "kept"]  # the image's ENV and the sandbox's
    assert seen[2] == machine.id and seen[3] != os.uname().release  # its own hostname and kernel
    assert machine.exec(["python3", "-c", "print(6 * 7)"]).output == "42\n"


def test_users_and_groups_resolve_as_for_containers(machine):
    setup = "groupadd -g 2000 team && groupadd -g 2100 other && useradd -m -u 1500 -G team app"
    assert machine.exec(setup).exit_code == 0
    ids = "echo $(id -u) $(id -g) $(id -G)"
    assert machine.exec(ids, user="app").output == "1500 1500 1500 2000\n"  # with its supplementary group
    assert machine.exec(ids, user="app:other").output.split()[:2] == ["1500", "2100"]
    assert machine.exec(ids, user="1500:other").output.split()[:2] == ["1500", "2100"]
    assert machine.exec(ids, user="4242").output.split() == ["4242", "4242", "4242"]  # no entry


def test_an_unknown_user_is_refused_clearly(machine):
    with pytest.raises(VMError, match="unknown user no-such-user"):
        machine.exec("true", user="no-such-user")
    assert machine.exec("echo still-serving").output == "still-serving\n"


def test_a_timeout_kills_the_commands_whole_tree(machine):
    result = machine.exec("sleep 300 & sleep 301; echo never", timeout=1)
    assert result.timed_out and result.exit_code == 124 and "never" not in result.output
    time.sleep(0.2)
    assert machine.exec("ps -eo args | grep -c '^sleep 30[01]' || true").output.strip() == "0"


def test_a_cancelled_command_is_killed_in_the_guest(machine):
    """Harbor cancels a command at its timeout (exec_async): the guest agent kills what it started."""
    async def cancel_after_one_second() -> None:
        await asyncio.wait_for(exec_async(machine, "sleep 302 & sleep 303; echo never"), 1)

    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(cancel_after_one_second())
    assert time.monotonic() - started < 10
    time.sleep(0.2)
    assert machine.exec("ps -eo args | grep -c '^sleep 30[23]' || true").output.strip() == "0"
    assert machine.exec("echo next").output == "next\n"  # the agent serves the next command


def test_a_client_killed_mid_command_takes_its_command_along(vms, machine):
    """A process SIGKILLed while its command runs in the guest: the agent sees its host hang up (or
    the next client's request) and kills the command, which would otherwise hold the agent for 300 s,
    and the next client is served."""
    code = f"from sprout.sandbox import Store; Store({str(vms.root)!r}).sandbox({machine.id!r}).exec('sleep 304')"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    time.sleep(3)  # its command runs in the guest
    child.kill()
    child.wait()
    started = time.monotonic()
    assert machine.exec("echo next").output == "next\n"
    assert time.monotonic() - started < 20 and machine.running
    assert machine.exec("ps -eo args | grep -c '^sleep 304' || true").output.strip() == "0"


def test_output_keeps_its_head_and_tail_past_the_cap(machine):
    result = machine.exec("seq 1 200000", max_output=4000)
    assert result.truncated and result.output.startswith("1\n2\n") and result.output.endswith("199999\n200000\n")
    assert "bytes of output omitted" in result.output and len(result.output) < 4200


@pytest.mark.rootless
def test_a_disk_checkpoint_is_a_store_checkpoint_its_branch_boots(vms, machine):
    assert machine.exec("echo at-checkpoint > /root/state").exit_code == 0
    checkpoint = machine.checkpoint(label="disk-only")
    assert machine.exec("echo after-checkpoint > /root/state").exit_code == 0
    assert checkpoint.exists and (checkpoint.path / DISK_FILE).exists()
    assert not (checkpoint.path / MEMORY_FILE).exists()
    assert vms.checkpoint(checkpoint.id).parent is None and checkpoint in vms.checkpoints(machine.id)
    branch = checkpoint.branch()
    assert branch.backend == "microvm" and branch.base_checkpoint == checkpoint.id
    assert branch.exec("cat /root/state").output == "at-checkpoint\n"
    assert branch.exec("echo branch > /root/state").exit_code == 0
    assert machine.exec("cat /root/state").output == "after-checkpoint\n"
    with pytest.raises(SandboxStateError, match="microVM"):
        _ = checkpoint.rootfs  # host-side readers (grading, task files) refuse it clearly
    branch.destroy()
    assert not branch.path.exists()


def test_a_server_from_turn_2_answers_in_a_branch_of_turn_3(with_server):
    parent, checkpoint = with_server
    assert (checkpoint.path / MEMORY_FILE).stat().st_size > 0
    branch = checkpoint.branch()
    assert branch.exec(FETCH).output == "served-from-turn-2\n"
    assert branch.exec("cat /root/turn").output == "turn-3\n"
    assert not (branch.path / MEMORY_FILE).exists()  # used once, by the resume
    assert parent.exec(FETCH).output == "served-from-turn-2\n"  # the checkpointed VM runs on
    branch.destroy()


@pytest.mark.rootless
def test_a_memory_checkpoint_resumes_only_in_a_vm_of_its_size(vms, with_server):
    _, checkpoint = with_server
    before = {s.id for s in vms.sandboxes()}
    with pytest.raises(StoreError, match="keeps its VM's size"):
        checkpoint.branch(memory="1g")
    assert {s.id for s in vms.sandboxes()} == before


def test_branches_of_one_memory_image_get_their_own_identity(with_server):
    _, checkpoint = with_server
    branches = [checkpoint.branch() for _ in range(2)]
    seen = [b.exec("hostname; cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1").output.splitlines()
            for b in branches]
    assert len(seen[0]) == 3 and all(a != b for a, b in zip(*seen)), seen
    assert [line[0] for line in seen] == [b.id for b in branches]
    for branch in branches:
        branch.destroy()


def head_digest(disk) -> str:
    """The digest of the disk's first 16 MiB, which the hostile `dd` below overwrites in its copy."""
    with open(disk, "rb") as handle:
        return hashlib.sha256(handle.read(16 << 20)).hexdigest()


@pytest.mark.rootless
def test_root_in_a_guest_cannot_reach_the_store_or_its_checkpoint(vms, with_server):
    _, checkpoint = with_server
    before = head_digest(checkpoint.path / DISK_FILE)
    hostile = checkpoint.branch()
    probe = hostile.exec(f"ls {vms.root} 2>&1; ls /sys/block; "
                         "dd if=/dev/zero of=/dev/vda bs=1M count=8 conv=fsync 2>&1 | tail -1")
    assert "No such file" in probe.output and "vda" in probe.output and "copied" in probe.output
    assert head_digest(checkpoint.path / DISK_FILE) == before
    sibling = checkpoint.branch()
    assert sibling.exec("cat /root/turn").output == "turn-3\n"
    hostile.destroy()
    sibling.destroy()


def test_root_in_a_guest_cannot_fill_the_host_through_the_console_or_block_the_agent(vms):
    hostile = new_vm(vms)
    flood = hostile.exec("head -c 20000000 /dev/zero > /dev/ttyS0; echo flooded", timeout=120)
    assert flood.output == "flooded\n"
    assert (hostile.profile_path.parent / "console.log").stat().st_size < 1 << 20
    assert hostile.exec("rm /etc/passwd && mkfifo /etc/passwd").exit_code == 0
    with pytest.raises(VMError, match="unknown user nobody"):  # the FIFO is refused, not read
        hostile.exec("true", user="nobody", timeout=5)
    # the agent still serves (bash itself would block on the FIFO: it looks its user up)
    assert hostile.exec(["echo", "still-serving"], timeout=20).output == "still-serving\n"
    hostile.destroy()


def vm_of(sandbox: Sandbox) -> MicroVM:
    vm = MicroVM.attach(sandbox.profile_path.parent)
    assert vm is not None, f"{sandbox.id} runs no VM"
    return vm


def test_a_hung_vm_is_killed_when_its_command_overruns(with_server, monkeypatch):
    _, checkpoint = with_server
    hung = checkpoint.branch()
    monkeypatch.setattr(vm_module, "ANSWER_GRACE_S", 1.0)
    vm_of(hung).pause()  # the guest stops answering, as a wedged kernel would
    with pytest.raises(VMError, match="did not answer in time"):
        hung.exec("true", timeout=1)
    assert not hung.running and hung.state == "stopped"
    hung.start()  # its disk boots again
    assert hung.exec("cat /root/turn").output == "turn-3\n"
    hung.destroy()


def test_gc_reaps_a_vm_whose_owner_was_killed(vms):
    child = os.fork()
    if child == 0:  # the owner: makes a VM, then dies without cleaning up (as a SIGKILLed worker)
        try:
            owned = Store(vms.root, owner={"worker": "doomed"}, backend="microvm")
            owned.create_sandbox(PYTHON_IMAGE, memory="512m", label="doomed")
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(child, 0)
    doomed = [s for s in vms.sandboxes() if s.label == "doomed"]
    assert len(doomed) == 1 and doomed[0].running
    pid = vm_of(doomed[0]).pid
    removed = vms.gc()
    assert any(doomed[0].id in line and "dead owner" in line for line in removed), removed
    assert not doomed[0].running and not doomed[0].path.exists()
    assert pid not in qemu_processes(vms)


def test_a_microvm_has_no_network_unless_asked(vms, machine):
    assert "eth0" not in machine.exec("cat /proc/net/dev").output and not machine.network_enabled
    with pytest.raises(SandboxStateError, match="created without network"):
        machine.set_network(True)


def test_a_networked_guest_reaches_out_as_a_container_does_but_not_the_hosts_loopback(vms):
    """QEMU's user-mode network maps the guest's 10.0.2.2 to the loopback of QEMU's namespace: that is
    the holder's, empty, so services the host keeps on 127.0.0.1 stay out of the guest's reach."""
    sandbox = new_vm(vms, network=True)  # the bridge exists while a sandbox (here its holder) is on it
    gateway = bridge_gateway()
    with greeter("127.0.0.1") as private, greeter(gateway) as public:
        probe = "timeout 5 bash -c 'exec 3<>/dev/tcp/{}/{} && cat <&3'"
        assert sandbox.exec(probe.format(gateway, public)).output == "hello from the host\n"
        holder_resolv = podman.podman("inspect", "-f", "{{.ResolvConfPath}}", sandbox.container)
        assert sandbox.exec("cat /etc/resolv.conf").output == Path(holder_resolv).read_text()  # a container's DNS
        for host in ("10.0.2.2", "127.0.0.1"):
            refused = sandbox.exec(probe.format(host, private))
            assert refused.exit_code != 0 and "hello" not in refused.output, (host, refused.output)
        holder = sandbox.container
        sandbox.destroy()
    assert holder not in podman.container_names(f"{LABEL}={sandbox.id}")


def test_a_killed_qemu_shows_as_stopped_and_restarts(vms):
    sandbox = new_vm(vms)
    os.kill(vm_of(sandbox).pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while sandbox.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox.state == "stopped"
    with pytest.raises(SandboxStateError, match="not running"):
        sandbox.exec("true")
    sandbox.start()
    assert sandbox.exec("echo back").output == "back\n"
    sandbox.destroy()


def test_the_sandbox_cli_makes_checkpoints_and_branches_of_microvms():
    from tests.sandbox.test_cli_doctor import cli

    sandbox = cli("sprout.sandbox", "create", PYTHON_IMAGE, "--backend", "microvm", "--memory", "512m",
                  "--network").stdout.strip()
    assert sandbox.startswith("sb-"), sandbox
    try:
        assert cli("sprout.sandbox", "exec", sandbox, "echo hi > /root/a; sleep 600 &").returncode == 0
        checkpoint = cli("sprout.sandbox", "checkpoint", "--memory", sandbox).stdout.split()[0]
        branch = cli("sprout.sandbox", "branch", checkpoint).stdout.strip()
        assert cli("sprout.sandbox", "exec", branch, "cat /root/a; pgrep -c -x sleep; grep -c eth0 /proc/net/dev"
                   ).stdout == "hi\n1\n1\n"  # its processes and its network device (--network) resumed
        info = cli("sprout.sandbox", "inspect", branch).stdout
        assert '"backend": "microvm"' in info and '"network": true' in info
        assert cli("sprout.sandbox", "rm", "--force", branch, sandbox, checkpoint).returncode == 0
    finally:
        cli("sprout.sandbox", "rm", "--force", sandbox)


def test_a_checkpoint_diff_of_microvms_reads_their_disks_through_guests(vms):
    """Two checkpoints of a VM compared through guests booted on their disks (the host never mounts one):
    a text edit with its unified diff, a file added, one removed, a mode, a link's target, a binary file;
    against the image, the files the VM's start writes are not the agent's. The checkpoints stay unwritten."""
    sandbox = new_vm(vms)
    setup = ("mkdir -p /work && printf 'one\\ntwo\\nthree\\n' > /work/a.txt && echo gone > /work/old.txt && "
             "ln -s a.txt /work/link && head -c 4096 /dev/urandom > /work/blob && chmod 600 /work/blob")
    assert sandbox.exec(setup).exit_code == 0
    first = sandbox.checkpoint(label="before")
    work = ("sed -i 's/two/TWO/' /work/a.txt && rm /work/old.txt && echo new > /work/new.txt && "
            "ln -sfn new.txt /work/link && chmod 644 /work/blob && head -c 4096 /dev/urandom > /work/blob2")
    assert sandbox.exec(work).exit_code == 0
    second = sandbox.checkpoint(label="after")
    disks = [(c.path / DISK_FILE).read_bytes() for c in (first, second)]
    diff = vms.diff(first.id, second.id)
    assert sorted(c.line() for c in diff.changes) == ["A /work/blob2", "A /work/new.txt", "D /work/old.txt",
                                                      "M /work/a.txt (content)", "M /work/blob (mode)",
                                                      "M /work/link (target)"]
    by_path = {c.path: c for c in diff.changes}
    assert "-two\n+TWO\n" in by_path["/work/a.txt"].diff and by_path["/work/blob2"].binary
    assert (by_path["/work/link"].before.target, by_path["/work/link"].after.target) == ("a.txt", "new.txt")
    assert diff.method == "walk"
    from_image = vms.diff(sandbox.image.key, first.id, content=False)
    paths = {c.path for c in from_image.changes}
    assert {"/work", "/work/a.txt", "/work/old.txt", "/work/link", "/work/blob"} <= paths
    assert not paths & {"/etc/hostname", "/etc/machine-id"}  # the VM's start wrote them, not a command
    assert [(c.path / DISK_FILE).read_bytes() for c in (first, second)] == disks  # read, never written
