"""The microVM backend of the store: what a sandbox's subvolume holds and how its VM starts and saves.

A microVM sandbox's subvolume holds `disk.img` (its filesystem, an ext4 file), so the store's own
snapshots do the work: a checkpoint is a read-only snapshot of that subvolume (O(1)), with
`memory.bin` beside the disk when the memory was saved; a branch is a writable snapshot of the
checkpoint. The VM's sockets, console and pid live in the sandbox's state directory.
"""

import fcntl
import os
import re
from pathlib import Path

from .. import btrfs
from ..errors import StoreError
from .guest import clone_file, guest_kit, make_disk
from .vm import MicroVM, VMLimits, choose_accel

DISK_FILE, MEMORY_FILE = "disk.img", "memory.bin"
DEFAULT_MEMORY_MB = 1024
ACCEL_VARIABLE = "SPROUT_MICROVM_ACCEL"  # kvm, tcg or auto (the default)
MAX_SOCKET_PATH = 107


def accelerator() -> tuple[str, str]:
    """(kvm or tcg, why): $SPROUT_MICROVM_ACCEL, else what this host runs (vm.choose_accel)."""
    return choose_accel(os.environ.get(ACCEL_VARIABLE, "auto"))


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
        clone_file(disk, dest / DISK_FILE)
    except BaseException:
        btrfs.delete(dest)
        raise


def vm_limits(limits: dict) -> VMLimits:
    """vCPUs and memory from the sandbox's limits (`cpus`, `memory` as podman spells them)."""
    cpus, memory = limits.get("cpus"), limits.get("memory")
    return VMLimits(vcpus=max(1, int(-(-float(cpus) // 1))) if cpus else 1,
                    memory_mb=_megabytes(memory) if memory else DEFAULT_MEMORY_MB)


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


def start(store_root: Path, subvolume: Path, run_dir: Path, limits: dict, hostname: str) -> MicroVM:
    """Boots the sandbox's disk, or resumes its saved memory when its subvolume holds some (a branch
    of a memory checkpoint; used once, then removed), and gives the VM its own identity."""
    for name in ("qmp.sock", "agent.sock"):
        if len(str(run_dir / name)) > MAX_SOCKET_PATH:
            raise StoreError(f"the store's path is too long for the VM's sockets ({run_dir / name}); "
                             "use a store at a shorter path")
    memory = subvolume / MEMORY_FILE
    vm = MicroVM.boot(guest_kit(store_root), subvolume / DISK_FILE, run_dir, limits=vm_limits(limits),
                      accel=accelerator()[0], incoming=memory if memory.exists() else None)
    try:
        memory.unlink(missing_ok=True)
        vm.set_identity(hostname)
    except BaseException:
        vm.kill()
        raise
    return vm


def snapshot(vm: MicroVM | None, subvolume: Path, dest: Path, *, memory: bool) -> None:
    """A checkpoint of the sandbox: its disk with the guest's filesystem frozen, or, with `memory`,
    its disk and memory as of one pause."""
    if vm is None:  # stopped: nothing writes
        if memory:
            raise StoreError("a stopped VM has no memory to save; checkpoint without memory")
        btrfs.snapshot(subvolume, dest, readonly=True)
        return
    if not memory:
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
