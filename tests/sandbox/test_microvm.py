"""The microVM backend's engine: real QEMU microVMs (KVM where it runs Debian's kernel, else TCG) booted
from a store image, with commands over the guest agent and disk / memory checkpoints on the btrfs store."""

import hashlib
import time
from collections.abc import Iterator

import pytest

from sprout.sandbox import Store
from sprout.sandbox.microvm import vm as vm_module
from sprout.sandbox.microvm.vm import MicroVM, VMError
from sprout.sandbox.microvm.vmstore import VMStore
from tests.conftest import PYTHON_IMAGE

SERVER = ("cd /srv && echo served-from-turn-2 > index.html && "
          "nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 & sleep 1")
FETCH = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/').read().decode(), end='')\""


def sh(vm: MicroVM, command: str, **kwargs):
    return vm.exec(["bash", "-c", command], env={"PATH": "/usr/local/bin:/usr/bin:/bin"}, **kwargs)


def head_digest(disk) -> str:
    """The digest of the disk's first 16 MiB, which the hostile `dd` below overwrites in its copy."""
    with open(disk, "rb") as handle:
        return hashlib.sha256(handle.read(16 << 20)).hexdigest()


class Made:
    """Every VM and checkpoint a test makes, removed at its end."""

    def __init__(self, vms: VMStore):
        self.vms, self.machines, self.checkpoints = vms, [], []

    def boot(self) -> MicroVM:
        self.machines.append(self.vms.boot(self.vms.store.resolve_image(PYTHON_IMAGE)))
        return self.machines[-1]

    def branch(self, checkpoint) -> MicroVM:
        self.machines.append(self.vms.branch(checkpoint))
        return self.machines[-1]

    def checkpoint(self, vm: MicroVM, *, memory: bool):
        self.checkpoints.append(self.vms.checkpoint(vm, memory=memory))
        return self.checkpoints[-1]

    def remove_all(self) -> None:
        for machine in self.machines:
            self.vms.destroy(machine)
        for checkpoint in self.checkpoints:
            self.vms.remove_checkpoint(checkpoint)


@pytest.fixture(scope="module")
def made() -> Iterator[Made]:
    made = Made(VMStore(Store()))
    try:
        yield made
    finally:
        made.remove_all()
    assert not any(m.run_dir.exists() or m.process.poll() is None for m in made.machines)
    assert not any(c.exists() for c in made.checkpoints)


@pytest.fixture(scope="module")
def machine(made: Made) -> MicroVM:
    return made.boot()


@pytest.fixture(scope="module")
def with_server(made: Made) -> tuple[MicroVM, object]:
    """A VM that started a server in turn 2 and wrote a file in turn 3, checkpointed with its memory."""
    vm = made.boot()
    assert sh(vm, "mkdir -p /srv && echo turn-1 > /srv/turn").exit_code == 0
    assert sh(vm, SERVER).exit_code == 0
    assert sh(vm, "echo turn-3 > /srv/turn").exit_code == 0
    return vm, made.checkpoint(vm, memory=True)


def test_commands_get_their_cwd_env_user_and_exit_code(machine):
    result = machine.exec(["bash", "-c", "pwd; echo $GREETING; id -un; exit 3"], cwd="/tmp",
                          env={"GREETING": "hello vm"}, user="nobody")
    assert (result.output, result.exit_code, result.timed_out) == ("/tmp\nhello vm\nnobody\n", 3, False)
    assert sh(machine, "cat /etc/hostname").output.strip() == machine.run_dir.name


def test_an_unknown_user_is_refused_clearly(machine):
    with pytest.raises(VMError, match="unknown user no-such-user"):
        sh(machine, "true", user="no-such-user")
    assert sh(machine, "echo still-serving").output == "still-serving\n"


def test_a_timeout_kills_the_commands_whole_tree(machine):
    result = sh(machine, "sleep 300 & sleep 301; echo never", timeout=1)
    assert result.timed_out and result.exit_code == 124 and "never" not in result.output
    time.sleep(0.2)
    assert sh(machine, "ps -eo args | grep -c '^sleep 30[01]' || true").output.strip() == "0"


def test_output_keeps_its_head_and_tail_past_the_cap(machine):
    result = sh(machine, "seq 1 200000", max_output=4000)
    assert result.truncated and result.output.startswith("1\n2\n") and result.output.endswith("199999\n200000\n")
    assert "bytes of output omitted" in result.output and len(result.output) < 4200


def test_a_disk_checkpoint_boots_its_files_and_branches_stay_apart(made, machine):
    assert sh(machine, "echo at-checkpoint > /root/state").exit_code == 0
    checkpoint = made.checkpoint(machine, memory=False)
    assert sh(machine, "echo after-checkpoint > /root/state").exit_code == 0
    branch = made.branch(checkpoint)
    assert sh(branch, "cat /root/state").output == "at-checkpoint\n"
    assert sh(branch, "echo branch > /root/state").exit_code == 0
    assert sh(machine, "cat /root/state").output == "after-checkpoint\n"
    assert not (checkpoint / "memory.bin").exists()


def test_a_server_from_turn_2_answers_in_a_branch_of_turn_3(made, with_server):
    parent, checkpoint = with_server
    branch = made.branch(checkpoint)
    assert sh(branch, FETCH).output == "served-from-turn-2\n"
    assert sh(branch, "cat /srv/turn").output == "turn-3\n"
    assert sh(parent, FETCH).output == "served-from-turn-2\n"  # the checkpointed VM runs on


def test_branches_of_one_memory_image_get_their_own_identity(made, with_server):
    _, checkpoint = with_server
    seen = []
    for _ in range(2):
        branch = made.branch(checkpoint)
        seen.append(sh(branch, "hostname; cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1").output)
    first, second = (s.splitlines() for s in seen)
    assert len(first) == 3 and all(a != b for a, b in zip(first, second)), seen


def test_root_in_a_guest_cannot_reach_the_store_or_its_checkpoint(made, with_server):
    _, checkpoint = with_server
    before = head_digest(checkpoint / "disk.img")
    hostile = made.branch(checkpoint)
    probe = sh(hostile, "ls /root/sprout-btrfs 2>&1; ls /sys/block; "
                        "dd if=/dev/zero of=/dev/vda bs=1M count=8 conv=fsync 2>&1 | tail -1")
    assert "No such file" in probe.output and "vda" in probe.output and "copied" in probe.output
    assert head_digest(checkpoint / "disk.img") == before
    assert sh(made.branch(checkpoint), "cat /srv/turn").output == "turn-3\n"


def test_a_hung_vm_is_killed_when_its_command_overruns(made, with_server, monkeypatch):
    _, checkpoint = with_server
    hung = made.branch(checkpoint)
    monkeypatch.setattr(vm_module, "ANSWER_GRACE_S", 1.0)
    hung.qmp.cmd("stop")  # the guest stops answering, as a wedged kernel would
    with pytest.raises(VMError, match="did not answer in time"):
        sh(hung, "true", timeout=1)
    assert hung.process.poll() is not None
