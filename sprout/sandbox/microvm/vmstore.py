"""MicroVMs on the btrfs store: one disk file per image, reflinked per VM and per checkpoint.

Layout under `<store>/microvm/`: `kits/` (kernel + initramfs), `images/<image key>.img`,
`vms/<vm id>/` (a running VM's disk, sockets and console), `checkpoints/<id>/` (disk.img, and
memory.bin when the memory was saved).
"""

import fcntl
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..store import Image, Store
from .guest import GuestKit, clone_file, guest_kit, make_disk
from .vm import DISK_FILE, MEMORY_FILE, MicroVM, VMLimits


class VMStore:
    def __init__(self, store: Store, *, accel: str = "auto", limits: VMLimits = VMLimits()):
        self.store, self.accel, self.limits = store, accel, limits
        self.root = store.root / "microvm"
        self._kit: GuestKit | None = None

    @property
    def kit(self) -> GuestKit:
        if self._kit is None:
            self._kit = guest_kit(self.store.root)
        return self._kit

    @contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f".{name}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def image_disk(self, image: Image) -> Path:
        """The image's rootfs as a disk file, written on first use."""
        disk = self.root / "images" / f"{image.key}.img"
        with self._lock(f"image-{image.key}"):
            if not disk.exists():
                disk.parent.mkdir(parents=True, exist_ok=True)
                make_disk(image.path, disk)
        return disk

    def _run_dir(self, disk: Path) -> Path:
        run_dir = self.root / "vms" / f"vm-{uuid.uuid4().hex[:12]}"
        run_dir.mkdir(parents=True)
        clone_file(disk, run_dir / DISK_FILE)
        return run_dir

    def boot(self, image: Image) -> MicroVM:
        """A fresh VM of `image`, booted."""
        return self._start(self._run_dir(self.image_disk(image)), incoming=None)

    def checkpoint(self, vm: MicroVM, *, memory: bool) -> Path:
        """Saves the VM (its disk; with `memory`, its running processes too) as a new checkpoint."""
        dest = self.root / "checkpoints" / f"vmck-{uuid.uuid4().hex[:12]}"
        partial = dest.with_name(dest.name + ".partial")
        partial.mkdir(parents=True)
        try:
            vm.save(partial, memory=memory)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        partial.rename(dest)
        return dest

    def branch(self, checkpoint: Path) -> MicroVM:
        """A new VM from a checkpoint: it resumes the saved memory when there is one, otherwise it
        boots the saved disk."""
        run_dir = self._run_dir(checkpoint / DISK_FILE)
        memory = checkpoint / MEMORY_FILE
        return self._start(run_dir, incoming=memory if memory.exists() else None)

    def _start(self, run_dir: Path, incoming: Path | None) -> MicroVM:
        """Boots or resumes the VM in `run_dir` and gives it its own hostname (its id), machine id and
        entropy: restored memory would otherwise repeat its parent's."""
        vm = None
        try:
            vm = MicroVM.boot(self.kit, run_dir, limits=self.limits, accel=self.accel, incoming=incoming)
            vm.set_identity(run_dir.name)
            return vm
        except BaseException:
            if vm is not None:
                vm.kill()
            shutil.rmtree(run_dir, ignore_errors=True)
            raise

    def destroy(self, vm: MicroVM) -> None:
        vm.kill()
        shutil.rmtree(vm.run_dir, ignore_errors=True)

    def remove_checkpoint(self, checkpoint: Path) -> None:
        shutil.rmtree(checkpoint)
