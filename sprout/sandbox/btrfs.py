"""btrfs subvolumes: create, snapshot, delete (nested ones too), flush, sizes, and the loop-file store."""

import ctypes
import os
from pathlib import Path

from . import shell
from .errors import StoreError

SUBVOLUME_ROOT_INODE = 256  # every btrfs subvolume's top directory has this inode number
_libc = ctypes.CDLL(None, use_errno=True)


def is_btrfs(path: Path) -> bool:
    try:
        return shell.output(["stat", "-f", "-c", "%T", str(path)]) == "btrfs"
    except Exception:
        return False


def is_subvolume(path: Path) -> bool:
    try:
        return path.stat().st_ino == SUBVOLUME_ROOT_INODE and is_btrfs(path)
    except FileNotFoundError:
        return False


def create(path: Path) -> None:
    shell.run(["btrfs", "subvolume", "create", str(path)], what="btrfs subvolume create")


def snapshot(source: Path, dest: Path, *, readonly: bool) -> None:
    cmd = ["btrfs", "subvolume", "snapshot", *(["-r"] if readonly else []), str(source), str(dest)]
    shell.run(cmd, what="btrfs subvolume snapshot")


def set_readonly(path: Path, readonly: bool = True) -> None:
    shell.run(["btrfs", "property", "set", "-ts", str(path), "ro", "true" if readonly else "false"],
              what="btrfs property set ro")


def is_readonly(path: Path) -> bool:
    return shell.output(["btrfs", "property", "get", "-ts", str(path), "ro"]) == "ro=true"


def flush(path: Path) -> None:
    """Writes back the filesystem's dirty data so that a snapshot afterwards is fast and complete."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            raise StoreError(f"syncfs {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def nested_subvolumes(path: Path) -> list[Path]:
    """Subvolumes below `path` (e.g. made inside a sandbox), deepest first."""
    children = [line.split(" path ", 1)[1] for line in
                shell.output(["btrfs", "subvolume", "list", "-o", str(path)]).splitlines() if " path " in line]
    if not children:
        return []
    own = shell.output(["btrfs", "subvolume", "show", str(path)]).splitlines()[0].strip()  # path from fs top
    found = []
    for child in children:
        child_path = path / child[len(own) + 1:] if own != "/" else path / child
        found = nested_subvolumes(child_path) + [child_path] + found
    return found


def delete(path: Path) -> None:
    """Deletes a subvolume and any subvolumes nested in it (btrfs-progs 6.2 cannot recurse)."""
    if not path.exists():
        return
    doomed = [*nested_subvolumes(path), path]
    shell.run(["btrfs", "subvolume", "delete", *map(str, doomed)], what="btrfs subvolume delete")


def exclusive_sizes(mount: Path) -> dict[int, int] | None:
    """Exclusive bytes per subvolume id, or None when quotas are off (we keep them off: slow snapshots)."""
    proc = shell.run(["btrfs", "qgroup", "show", "--raw", "-re", str(mount)], check=False)
    if proc.returncode != 0:
        return None
    sizes = {}
    for line in proc.stdout.decode().splitlines():
        parts = line.split()
        if parts and parts[0].startswith("0/"):
            sizes[int(parts[0][2:])] = int(parts[2])
    return sizes


def subvolume_id(path: Path) -> int:
    for line in shell.output(["btrfs", "subvolume", "show", str(path)]).splitlines():
        key, _, value = line.strip().partition(":")
        if key == "Subvolume ID":
            return int(value)
    raise StoreError(f"cannot read the subvolume id of {path}")


def disk_usage(paths: list[Path]) -> int:
    """Bytes exclusively held by the given subvolumes together (shared extents counted once)."""
    if not paths:
        return 0
    out = shell.output(["btrfs", "filesystem", "du", "-s", "--raw", *map(str, paths)])
    total = 0
    for line in out.splitlines()[1:]:
        parts = line.split()
        if parts and parts[0].isdigit():
            total += int(parts[1])  # Exclusive column
    return total


def find_loop_mount(image: Path) -> str | None:
    """The mount point of an existing loop mount of `image`, if any."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        source = fields[fields.index("-") + 2]
        if source.startswith("/dev/loop"):
            backing = Path(f"/sys/block/{Path(source).name}/loop/backing_file")
            if backing.exists() and backing.read_text().strip() == str(image):
                return fields[4]
    return None
