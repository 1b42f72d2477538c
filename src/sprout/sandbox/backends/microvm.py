"""The microVM backend: a QEMU microvm machine boots the sandbox's disk; what its subvolume holds and how
its VM starts and saves.

A microVM sandbox's subvolume holds `disk.img` (its filesystem, an ext4 file), so the store's own
snapshots do the work: a checkpoint is a read-only snapshot of that subvolume (O(1)), with
`memory.bin` beside the disk when the memory was saved; a branch is a writable snapshot of the
checkpoint. The VM's sockets, console and pid live in the sandbox's state directory.

A VM with network runs its QEMU inside the network namespace of a "holder": a podman container of
nothing but busybox, named as a container sandbox would be, on the network container sandboxes use.
QEMU's user-mode network then reaches out exactly as a container does (same bridge, same firewall),
its host alias (10.0.2.2) is the holder's own empty loopback, not the host's, and switching the
network is switching the holder's (plus the guest's link).
"""

import fcntl
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

from ...settings import settings
from .. import btrfs, podman
from .. import trust as host_trust
from ..diff import Tree
from ..errors import SandboxStateError, StoreError
from ..execution import ExecResult
from ..microvm.guest import BUSYBOX, guest_kernel, guest_kit, make_disk
from ..microvm.inspect import disk_trees
from ..microvm.transfer import GuestTransfer, refusals
from ..microvm.vm import QEMU, MicroVM, VMLimits, choose_accel
from ..trust import CONTAINER_BUNDLE, HostTrust, container_env
from . import Check, Smoke

if TYPE_CHECKING:
    from ..store import Checkpoint, Image, Sandbox, Store

DISK_FILE, MEMORY_FILE = "disk.img", "memory.bin"
DEFAULT_MEMORY_MB = 1024
MAX_SOCKET_PATH = 107


def accelerator() -> tuple[str, str]:
    """(kvm or tcg, why): $SPROUT_MICROVM_ACCEL, else what this host runs (vm.choose_accel)."""
    return choose_accel(settings().microvm_accel)


def _image_disk_path(store_root: Path, image_key: str) -> Path:
    return store_root / "microvm" / "images" / f"{image_key}.img"


def image_disk(store_root: Path, image_key: str, rootfs: Path) -> Path:
    """The image's rootfs as a disk file, written on first use (under a lock: one writer)."""
    disk = _image_disk_path(store_root, image_key)
    disk.parent.mkdir(parents=True, exist_ok=True)
    with open(disk.with_name(f".{image_key}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not disk.exists():
            make_disk(rootfs, disk)
    return disk


def remove_image_disk(store_root: Path, image_key: str) -> None:
    """With its image (sandboxes and checkpoints hold their own reflinks of it)."""
    disk = _image_disk_path(store_root, image_key)
    disk.unlink(missing_ok=True)
    disk.with_name(f".{image_key}.lock").unlink(missing_ok=True)


def create_subvolume(store_root: Path, image_key: str, rootfs: Path, dest: Path) -> None:
    """A new sandbox's subvolume, holding a reflink of its image's disk."""
    disk = image_disk(store_root, image_key, rootfs)
    btrfs.create(dest)
    try:
        btrfs.clone_file(disk, dest / DISK_FILE)
    except BaseException:
        btrfs.delete(dest)
        raise


def vm_limits(limits: dict) -> VMLimits:
    """vCPUs and memory from the sandbox's limits (`cpus`, `memory` as podman spells them)."""
    cpus, memory = limits.get("cpus"), limits.get("memory")
    return VMLimits(vcpus=max(1, int(-(-float(cpus) // 1))) if cpus else 1,
                    memory_mb=_megabytes(memory) if memory else DEFAULT_MEMORY_MB,
                    network=bool(limits.get("network")))


def _megabytes(size: str | int) -> int:
    match = re.fullmatch(r"(\d+)([kmgt]?)b?", str(size).strip().lower())
    if not match:
        raise StoreError(f"cannot read the memory limit {size!r} (use e.g. 512m or 2g)")
    number, unit = int(match.group(1)), match.group(2)
    return max(64, number * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit] >> 20)


def has_memory(checkpoint: Path) -> bool:
    return (checkpoint / MEMORY_FILE).exists()


def check_resumable(saved: dict, asked: dict) -> None:
    """A memory image resumes only in a VM of its own size: refuses other vCPUs or memory clearly."""
    if vm_limits(saved) != vm_limits(asked):
        raise StoreError(f"a branch of a checkpoint with memory keeps its VM's size ({vm_limits(saved)}); "
                         f"it cannot resume with {vm_limits(asked)}")


def start(store_root: Path, subvolume: Path, run_dir: Path, limits: dict, hostname: str, *, holder: str,
          labels: dict[str, str], trust: HostTrust) -> MicroVM:
    """Boots the sandbox's disk, or resumes its saved memory when its subvolume holds some (a branch
    of a memory checkpoint; used once, then removed), and gives the VM its own identity, its network
    as last switched (through `holder`, a container named so) and the host's CA bundle."""
    for name in ("qmp.sock", "agent.sock"):
        if len(str(run_dir / name)) > MAX_SOCKET_PATH:
            raise StoreError(f"the store's path is too long for the VM's sockets ({run_dir / name}); "
                             "use a store at a shorter path")
    memory = subvolume / MEMORY_FILE
    netns, resolv_conf = _start_holder(store_root, holder, labels) if limits.get("network") else (None, None)
    try:
        vm = MicroVM.boot(guest_kit(store_root), subvolume / DISK_FILE, run_dir, limits=vm_limits(limits),
                          accel=accelerator()[0], incoming=memory if memory.exists() else None, netns=netns,
                          env=container_env(trust))
    except BaseException:
        podman.remove_container(holder)
        raise
    try:
        memory.unlink(missing_ok=True)
        vm.set_identity(hostname)
        if netns and limits.get("network_connected") is False:  # as it was switched last
            set_network(vm, holder, False)
        with vm.files() as files:
            if trust.ca_bundle:
                files.write_file(CONTAINER_BUNDLE, Path(trust.ca_bundle).read_bytes(), 0o644, (0, 0))
            if resolv_conf:  # the name servers podman gives the holder, as it gives a container
                files.write_file("/etc/resolv.conf", resolv_conf, 0o644, (0, 0))
    except BaseException:
        stop(vm, holder if netns else None)
        raise
    return vm


def stop(vm: MicroVM | None, holder: str | None) -> None:
    """Kills the VM (its disk stays as it is) and removes its network's holder, if it has one."""
    if vm is not None:
        vm.kill()
    if holder is not None:
        podman.remove_container(holder)


def set_network(vm: MicroVM, holder: str, enabled: bool) -> None:
    """Connects the VM's way out or cuts it: the holder on or off podman's network, and the guest's
    link up or down with it."""
    if podman.connected(vm.pid) != enabled:
        podman.set_network(holder, enabled)
    vm.set_link(enabled)


def _start_holder(store_root: Path, name: str, labels: dict[str, str]) -> tuple[str, bytes | None]:
    """A fresh holder container (replacing a stale one): the path of its network namespace, and the
    resolv.conf podman made for it (None when it names no name server)."""
    podman.remove_container(name)
    podman.run_container(podman.ContainerSpec(name=name, rootfs=str(_holder_root(store_root)), env={},
                                              workdir="/", user="", pids=16, labels=labels))
    try:
        template = "{{.NetworkSettings.SandboxKey}}\n{{.ResolvConfPath}}"
        netns, resolv_path = podman.podman("inspect", "-f", template, name, what="podman inspect").splitlines()
        resolv_conf = Path(resolv_path).read_bytes()
    except BaseException:
        podman.remove_container(name)
        raise
    return netns, resolv_conf if b"nameserver" in resolv_conf else None


def _holder_root(store_root: Path) -> Path:
    """The holders' rootfs: busybox, for `sleep`."""
    root = store_root / "microvm" / "holder"
    if not (root / "bin" / "sleep").is_symlink():
        (root / "bin").mkdir(parents=True, exist_ok=True)
        if not BUSYBOX.exists():
            raise StoreError("no static busybox: install Debian's busybox-static (ops/setup_podman.sh --microvm does)")
        partial = root / "bin" / f"busybox.{os.getpid()}.{threading.get_ident()}.partial"  # one per thread
        shutil.copy2(BUSYBOX, partial)
        os.replace(partial, root / "bin" / "busybox")
        with suppress(FileExistsError):
            (root / "bin" / "sleep").symlink_to("busybox")
    return root


def snapshot(vm: MicroVM | None, subvolume: Path, dest: Path, *, memory: bool) -> None:
    """A checkpoint of the sandbox: its disk with the guest's filesystem frozen, or, with `memory`,
    its disk and memory as of one pause."""
    if vm is None:  # stopped: nothing writes
        if memory:
            raise StoreError("a stopped VM has no memory to save; checkpoint without memory")
        btrfs.snapshot(subvolume, dest, readonly=True)
        return
    if not memory:
        vm.flush()  # the guest's and then the host's writeback ahead of the freeze, as a container's
        btrfs.flush(subvolume)
        with vm.frozen():
            btrfs.snapshot(subvolume, dest, readonly=True)
        return
    try:
        vm.save_memory(dest / MEMORY_FILE, lambda: btrfs.snapshot(subvolume, dest, readonly=False))
        btrfs.set_readonly(dest)
    except BaseException:
        if btrfs.is_subvolume(dest):
            btrfs.delete(dest)
        raise


class MicroVMBackend:
    name = "microvm"
    summary = "QEMU microVMs, each with its own kernel"
    host_files = False
    # what the VM's start writes on its disk: its identity, the host's CA bundle, the holder's name servers
    start_made = frozenset({"/etc/hostname", "/etc/machine-id", "/etc/resolv.conf", CONTAINER_BUNDLE})

    @property
    def smoke(self) -> Smoke:
        """A VM booted, checkpointed with its memory and resumed in a branch."""
        return Smoke(first="boot", save_memory=True, create={"backend": self.name, "memory": "512m"},
                     detail=accelerator()[0])

    def limits(self, limits: dict, *, network: bool | None, checkpoint: "Checkpoint | None") -> dict:
        """No network unless asked for (or its checkpoint's sandbox had it); a branch of a memory
        checkpoint keeps its VM's size."""
        inherited = bool(checkpoint and checkpoint.limits.get("network"))
        limits = limits | {"backend": self.name, "network": bool(network if network is not None else inherited)}
        if checkpoint is not None and has_memory(checkpoint.path):
            check_resumable(checkpoint.limits, limits)
        return limits

    def make_subvolume(self, store: "Store", image: "Image", dest: Path) -> None:
        create_subvolume(store.root, image.key, image.path, dest)

    def file_trees(self, store: "Store", sources: "Sequence[Checkpoint | Image]") -> AbstractContextManager[list[Tree]]:
        """Each disk read by a VM of its own (sprout.sandbox.microvm.inspect): a checkpoint's, or the image's."""
        from ..store import Checkpoint  # the store imports the backends

        disks = [source.path / DISK_FILE if isinstance(source, Checkpoint) else
                 image_disk(store.root, source.key, source.path) for source in sources]
        return disk_trees(guest_kit(store.root), disks, store.root / "state" / "sandboxes", accelerator()[0])

    def start(self, store: "Store", sandbox: "Sandbox", *, restart: bool = False) -> None:
        """Boots its disk; the memory of a resumed branch is gone after a restart."""
        start(store.root, sandbox.path, sandbox.profile_path.parent, sandbox.limits, sandbox.id,
              holder=sandbox.container, labels=store.labels(sandbox.id),
              trust=host_trust.host_trust(sandbox.limits.get("host_trust")))

    def stop(self, sandbox: "Sandbox") -> None:
        stop(_vm(sandbox), sandbox.container if sandbox.limits.get("network") else None)

    def running(self, sandbox: "Sandbox") -> bool:
        return _vm(sandbox) is not None

    def network_enabled(self, sandbox: "Sandbox") -> bool:
        vm = _vm(sandbox)  # QEMU runs in its holder's network namespace
        return vm is not None and bool(sandbox.limits.get("network")) and podman.connected(vm.pid)

    def set_network(self, sandbox: "Sandbox", enabled: bool) -> None:
        if sandbox.limits.get("network") and (vm := _vm(sandbox)) is not None:
            set_network(vm, sandbox.container, enabled)

    def exec(self, sandbox: "Sandbox", argv: list[str], *, cwd: str, env: dict[str, str], user: str | int | None,
             timeout: float | None, max_output: int, cancel: threading.Event | None) -> ExecResult:
        """In the guest, by its agent; setting `cancel` kills what the command started, as its timeout would."""
        config = sandbox.image.config
        return _running_vm(sandbox).exec(argv, cwd=cwd, env=config.env | sandbox.limits.get("env", {}) | env,
                                         user=str(user if user is not None else config.user or "0"),
                                         timeout=timeout, max_output=max_output, cancel=cancel)

    def snapshot(self, sandbox: "Sandbox", dest: Path, *, memory: bool) -> None:
        snapshot(_vm(sandbox), sandbox.path, dest, memory=memory)

    @contextmanager
    def files(self, sandbox: "Sandbox") -> Iterator[GuestTransfer]:
        vm = _vm(sandbox)
        if vm is None:
            raise SandboxStateError(f"sandbox {sandbox.id} is not running, so its files cannot be reached")
        with refusals(), vm.files() as files:
            yield GuestTransfer(files)

    def reap(self, store: "Store", sandbox_ids: set[str], dry_run: bool) -> list[str]:
        removed = []
        for run_dir in sorted((store.root / "state" / "sandboxes").iterdir()):
            if run_dir.name not in sandbox_ids and (vm := MicroVM.attach(run_dir)) is not None:
                removed.append(f"orphan microVM of {run_dir.name}")
                if not dry_run:
                    vm.kill()
        return removed

    def forget_image(self, store: "Store", image_key: str) -> None:
        remove_image_disk(store.root, image_key)

    def checks(self, store: "Store | None") -> list[Check]:
        accel, why = accelerator()
        checks = [Check("kvm", True, f"{accel}: {why}" + ("" if accel == "kvm" else
                                                            " (boots and commands run several times slower)"))]
        if shutil.which(QEMU) is None:
            checks.append(Check("qemu", False, f"{QEMU} is not installed (ops/setup_podman.sh --microvm installs "
                                               "qemu-system-x86)"))
        else:
            version = subprocess.run([QEMU, "--version"], capture_output=True, text=True).stdout.splitlines()
            checks.append(Check("qemu", True, version[0] if version else QEMU))
        try:
            kernel, modules = guest_kernel(store.root if store else None)
        except StoreError as e:
            return checks + [Check("guest kernel", False, str(e))]
        return checks + [Check("guest kernel", True, f"{kernel} with modules {modules}")]


def _vm(sandbox: "Sandbox") -> MicroVM | None:
    return MicroVM.attach(sandbox.profile_path.parent)


def _running_vm(sandbox: "Sandbox") -> MicroVM:
    vm = _vm(sandbox)
    if vm is None:
        raise SandboxStateError(f"sandbox {sandbox.id} is not running (start it: sprout sandbox start {sandbox.id})")
    return vm
