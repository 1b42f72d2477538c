"""The guest a microVM boots: Debian's kernel, an initramfs that mounts the sandbox's disk and starts
the agent (sprout-agent, compiled here from agent.c), and the disk itself (an image's rootfs as an
ext4 file on the btrfs store, copied O(1) per sandbox with a reflink).

The kit (kernel + initramfs) is built once per kernel and agent source, in `<store>/microvm/kits/`.
"""

import gzip
import hashlib
import lzma
import os
import shutil
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from .. import shell
from ..errors import StoreError
from ..trust import CONTAINER_BUNDLE

AGENT_SOURCE = Path(__file__).with_name("agent.c")
BUSYBOX = Path("/usr/bin/busybox")
GUEST_ROOT = "/newroot"
# Loaded in this order: each needs the ones before it (Debian builds them as modules).
MODULES = ["virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "virtio_console", "failover", "net_failover",
           "virtio_net", "crc16", "mbcache", "jbd2", "crc32c_generic", "ext4"]
# QEMU's user-mode network (slirp): the guest's address, its gateway and its DNS forwarder.
GUEST_ADDRESS, GATEWAY, NAMESERVER = "10.0.2.15/24", "10.0.2.2", "10.0.2.3"
DISK_HEADROOM_BYTES = 1 << 30  # free space a new sandbox's disk gets beyond its image's files

INIT_SCRIPT = f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc && mount -t sysfs sys /sys && mount -t devtmpfs dev /dev
fail() {{ echo "sprout-init: $*"; poweroff -f; }}
for module in {" ".join(MODULES)}; do insmod /modules/$module.ko || fail "cannot load $module"; done
ip link set lo up || fail "cannot bring up the loopback interface"
mount -t ext4 -o rw /dev/vda {GUEST_ROOT} || fail "cannot mount the sandbox's disk"
# over a file of the disk, as podman mounts over a container's (a link there is the guest's own choice)
over() {{ t={GUEST_ROOT}$2; [ -L $t ] && return; mkdir -p ${{t%/*}} && touch $t && mount --bind $1 $t; }}
if [ -e /sys/class/net/eth0 ]; then
  ip link set eth0 up && ip addr add {GUEST_ADDRESS} dev eth0 || fail "cannot configure eth0"
  ip route add default via {GATEWAY} || fail "cannot route through {GATEWAY}"
  echo "nameserver {NAMESERVER}" > /resolv.conf && over /resolv.conf /etc/resolv.conf
fi
# the host writes its CA bundle into this file of the initramfs (RAM): checkpoints never hold it
touch /host-ca.crt && over /host-ca.crt {CONTAINER_BUNDLE}
for dir in proc sys dev tmp; do mkdir -p {GUEST_ROOT}/$dir; done
mount -t proc proc {GUEST_ROOT}/proc && mount -t sysfs sys {GUEST_ROOT}/sys
mount -t devtmpfs dev {GUEST_ROOT}/dev && mkdir -p {GUEST_ROOT}/dev/pts {GUEST_ROOT}/dev/shm
mount -t devpts devpts {GUEST_ROOT}/dev/pts && mount -t tmpfs shm {GUEST_ROOT}/dev/shm
exec /sprout-agent {GUEST_ROOT}
"""


class GuestError(StoreError):
    """The guest cannot be built: a missing kernel, busybox or compiler."""


@dataclass(frozen=True)
class GuestKit:
    kernel: Path  # the ELF kernel unpacked from Debian's vmlinuz (or that vmlinuz, packed otherwise)
    initrd: Path


def guest_kernel(store_root: Path | None = None) -> tuple[Path, Path]:
    """(vmlinuz, its modules directory): the newest kernel that `ops/setup_podman.sh --microvm` took out of
    Debian's kernel package into the store (<store>/microvm/kernel/<package>/), else the newest installed on
    this host."""
    roots = [*sorted((store_root / "microvm" / "kernel").glob("*/"))] if store_root else []
    candidates = [(kernel, root / "lib" / "modules" / kernel.name.removeprefix("vmlinuz-"))
                  for root in [*roots, Path("/")] for kernel in (root / "boot").glob("vmlinuz-*")]
    found = [(kernel, modules) for kernel, modules in candidates if modules.is_dir()]
    if not found:
        raise GuestError("no guest kernel: run ops/setup_podman.sh --microvm (it takes Debian's kernel and the "
                         "modules the guest loads into the store)")
    return max(found, key=lambda pair: pair[0].stat().st_mtime)


def guest_kit(store_root: Path) -> GuestKit:
    """The kernel and initramfs for the guest kernel and the agent's source, built if missing."""
    kernel, modules = guest_kernel(store_root)
    if not BUSYBOX.exists():
        raise GuestError("no static busybox: install Debian's busybox-static (ops/setup_podman.sh --microvm does)")
    digest = hashlib.sha256()
    for part in (_identity(kernel), AGENT_SOURCE.read_bytes(), Path(__file__).read_bytes(), _identity(BUSYBOX)):
        digest.update(hashlib.sha256(part).digest())
    kit_dir = store_root / "microvm" / "kits" / digest.hexdigest()[:16]
    kit = GuestKit(kernel=kit_dir / "vmlinuz", initrd=kit_dir / "initrd.img")
    if not kit.initrd.exists():
        _build_kit(kit_dir, kernel, modules)
        _remove_other_kits(kit_dir)
    return kit


def _identity(path: Path) -> bytes:
    """What tells a file's versions apart without reading it (a package upgrade changes them)."""
    info = path.stat()
    return f"{path}:{info.st_size}:{info.st_mtime_ns}".encode()


def _remove_other_kits(current: Path) -> None:
    """Kits of an older kernel or agent: running VMs loaded theirs at start and no longer need them."""
    for kit in current.parent.iterdir():
        if kit != current and not kit.name.startswith("tmp"):
            shutil.rmtree(kit, ignore_errors=True)


def _build_kit(kit_dir: Path, kernel: Path, modules: Path) -> None:
    kit_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=kit_dir.parent) as work:
        tree = Path(work) / "initramfs"
        for sub in ("bin", "proc", "sys", "dev", "modules", GUEST_ROOT.lstrip("/")):
            (tree / sub).mkdir(parents=True)
        shutil.copy2(BUSYBOX, tree / "bin" / "busybox")
        for module in MODULES:
            found = next(modules.rglob(f"{module}.ko"), None) or next(modules.rglob(f"{module}.ko.xz"), None)
            if found is None:
                raise GuestError(f"the guest kernel's module {module}.ko is missing under {modules}")
            data = found.read_bytes()
            (tree / "modules" / f"{module}.ko").write_bytes(lzma.decompress(data) if found.suffix == ".xz" else data)
        (tree / "init").write_text(INIT_SCRIPT)
        (tree / "init").chmod(0o755)
        _compile_agent(tree / "sprout-agent")
        staged = Path(work) / "kit"
        staged.mkdir()
        (staged / "vmlinuz").write_bytes(_uncompressed(kernel.read_bytes()))
        packed = subprocess.run("find . | LC_ALL=C sort | cpio -o -H newc --quiet", shell=True, cwd=tree,
                                capture_output=True)
        if packed.returncode != 0:
            raise GuestError(f"packing the initramfs failed (is cpio installed?): {packed.stderr.decode().strip()}")
        archive = packed.stdout
        (staged / "initrd.img").write_bytes(gzip.compress(archive, compresslevel=1))
        try:
            staged.rename(kit_dir)
        except OSError:  # another process built the same kit meanwhile
            if not (kit_dir / "initrd.img").exists():
                raise


def _uncompressed(vmlinuz: bytes) -> bytes:
    """The ELF kernel inside a bzImage, which QEMU boots directly (PVH): under emulation, unpacking it
    takes about half of a boot. Kernels packed otherwise than with xz or gzip are booted as they are."""
    for magic, decompress in ((b"\xfd7zXZ\x00", lambda b: lzma.LZMADecompressor().decompress(b)),
                              (b"\x1f\x8b\x08", lambda b: zlib.decompressobj(31).decompress(b))):
        start = vmlinuz.find(magic)
        if start < 0:
            continue
        try:
            elf = decompress(vmlinuz[start:])
        except (lzma.LZMAError, zlib.error):
            continue
        if elf.startswith(b"\x7fELF"):
            return elf
    return vmlinuz


def _compile_agent(dest: Path) -> None:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise GuestError("no C compiler to build the guest agent: install gcc and libc6-dev")
    result = subprocess.run([compiler, "-static", "-O2", "-Wall", "-o", str(dest), str(AGENT_SOURCE)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise GuestError(f"building the guest agent failed:\n{result.stderr.strip()}")


def make_disk(rootfs: Path, dest: Path) -> None:
    """Writes `rootfs` (a directory) as a sparse ext4 file with room to grow; owners, modes and
    links are kept. Done once per image: sandboxes get reflinks of it (`btrfs.clone_file`)."""
    counted = subprocess.run(["du", "-sb", str(rootfs)], capture_output=True, text=True)
    if counted.returncode != 0:
        raise GuestError(f"cannot measure {rootfs}: {counted.stderr.strip()}")
    used = int(counted.stdout.split()[0])
    size_mb = (used * 3 // 2 + DISK_HEADROOM_BYTES) >> 20
    partial = dest.with_name(dest.name + ".partial")
    result = subprocess.run([shell.tool("mkfs.ext4"), "-q", "-F", "-L", "sprout", "-d", str(rootfs), str(partial),
                             f"{size_mb}M"], capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise GuestError(f"writing {rootfs} as a disk failed: {result.stderr.strip()}")
    os.replace(partial, dest)
