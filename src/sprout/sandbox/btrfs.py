"""btrfs subvolumes: create, snapshot, delete (nested ones too), flush, sizes, and the loop-file store."""

import ctypes
import errno
import fcntl
import os
import stat
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import rootless
from . import shell
from .errors import CommandError, StoreError

SUBVOLUME_ROOT_INODE = 256  # every btrfs subvolume's top directory has this inode number
# ioctls of linux/btrfs.h: tree search (ROOT_REF items of the root tree), inode lookup, delete by id
IOCTL_ARGS_SIZE = 4096  # btrfs_ioctl_search_args, btrfs_ioctl_ino_lookup_args, btrfs_ioctl_vol_args_v2
IOC_TREE_SEARCH = 0xD0009411  # _IOWR(0x94, 17, 4096)
IOC_INO_LOOKUP = 0xD0009412  # _IOWR(0x94, 18, 4096)
IOC_SNAP_DESTROY_V2 = 0x5000943F  # _IOW(0x94, 63, 4096)
IOC_SNAP_CREATE_V2 = 0x50009417  # _IOW(0x94, 23, 4096): btrfs_ioctl_vol_args_v2, on the new one's parent
SUBVOL_RDONLY = 1 << 1
VOL_ARGS_NAME = 56  # offset of name[] in btrfs_ioctl_vol_args_v2
# and the two a user without CAP_SYS_ADMIN may use: a subvolume's children, and a child's path
IOC_GET_SUBVOL_ROOTREF = 0xD000943D  # _IOWR(0x94, 61, 4096)
IOC_INO_LOOKUP_USER = 0xD000943E  # _IOWR(0x94, 62, 4096)
ROOTREF_MAX_ITEMS = 255  # per call (BTRFS_MAX_ROOTREF_BUFFER_NUM); EOVERFLOW when there are more
LOOKUP_USER_NAME, LOOKUP_USER_PATH = 16, 272  # offsets of name[256] and path[] in the lookup's arguments
IOC_SEND = 0x40489426  # _IOW(0x94, 38, struct btrfs_ioctl_send_args): 72 bytes
SEND_NO_FILE_DATA = 1  # BTRFS_SEND_FLAG_NO_FILE_DATA: the stream names writes without their bytes
SEND_MAGIC = b"btrfs-stream\0"
# send stream commands (linux/btrfs send.h) that change a file's bytes or length, and the attributes that
# hold a path: PATH, PATH_TO (a rename's new name), PATH_LINK (a hard link's target), CLONE_PATH
SEND_DATA_COMMANDS = {15, 16, 17, 22, 23, 25}  # WRITE, CLONE, TRUNCATE, UPDATE_EXTENT, FALLOCATE, ENCODED_WRITE
SEND_SUBVOLUME_COMMANDS = {1, 2}  # SUBVOL, SNAPSHOT: their PATH is the subvolume's name
SEND_PATH_ATTRIBUTES = {15, 16, 17, 22}
SEND_SYMLINK = 8  # its PATH_LINK is the link's target, not a path of the tree
SUBVOL_SPEC_BY_ID = 1 << 4
ROOT_TREE_ID = 1
ROOT_REF_KEY = 156
SEARCH_KEY_SIZE = 104  # struct btrfs_ioctl_search_key, then the result buffer
SEARCH_HEADER_SIZE = 32  # struct btrfs_ioctl_search_header before each item
SEARCH_MAX_ITEMS = 4096
U64_MAX = (1 << 64) - 1
BTRFS_SUPER_MAGIC = 0x9123683E  # statfs's f_type on btrfs
STATFS_SIZE = 256  # more than struct statfs (120 bytes on 64-bit Linux), whose first field is f_type (a long)
_libc = ctypes.CDLL(None, use_errno=True)


def is_btrfs(path: Path) -> bool:
    """Whether `path` is on btrfs: statfs(2) itself, not `stat -f` (a sample asks this about 15 times)."""
    buf = ctypes.create_string_buffer(STATFS_SIZE)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value == BTRFS_SUPER_MAGIC


def is_subvolume(path: Path) -> bool:
    try:
        info = path.lstat()
        return stat.S_ISDIR(info.st_mode) and info.st_ino == SUBVOLUME_ROOT_INODE and is_btrfs(path)
    except FileNotFoundError:
        return False


def mount_options(path: Path) -> set[str]:
    """The options (its superblock's too) of the filesystem mounted where `path` is."""
    found, options = "", set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4]
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) >= len(found):
            found, options = point, set(fields[5].split(",")) | set(fields[-1].split(","))
    return options


def create(path: Path) -> None:
    shell.run(["btrfs", "subvolume", "create", str(path)], what="btrfs subvolume create")


def snapshot(source: Path, dest: Path, *, readonly: bool) -> None:
    """The ioctl `btrfs subvolume snapshot` makes, without starting it (a checkpoint takes one while the
    sandbox is frozen: ~2 ms, against ~5 ms through the command). Raises CommandError as the command would."""
    name = os.fsencode(dest.name)
    args = _ioctl_args(IOCTL_ARGS_SIZE, flags=(16, "=Q", SUBVOL_RDONLY if readonly else 0))
    args[VOL_ARGS_NAME:VOL_ARGS_NAME + len(name)] = name
    try:
        with _directory(source) as source_fd, _directory(dest.parent) as parent_fd:
            struct.pack_into("=q", args, 0, source_fd)
            fcntl.ioctl(parent_fd, IOC_SNAP_CREATE_V2, args)
    except OSError as e:
        raise CommandError(f"btrfs subvolume snapshot {source} {dest} failed: {e.strerror}") from None


def clone_file(source: Path, dest: Path) -> None:
    """An O(1) copy-on-write copy (a reflink); refuses to fall back to copying the bytes."""
    result = shell.run(["cp", "--reflink=always", str(source), str(dest)], check=False)
    if result.returncode != 0:
        reason = result.stderr.decode(errors="replace").strip()
        raise StoreError(f"cannot reflink {source} to {dest}: {reason}")


def set_readonly(path: Path, readonly: bool = True) -> None:
    shell.run(["btrfs", "property", "set", "-ts", str(path), "ro", "true" if readonly else "false"],
              what="btrfs property set ro")


def is_readonly(path: Path) -> bool:
    return shell.output(["btrfs", "property", "get", "-ts", str(path), "ro"]) == "ro=true"


def flush(path: Path) -> None:
    """Writes back the filesystem's dirty data (syncfs), so that a snapshot afterwards has little left to write."""
    with _directory(path) as fd:
        if _libc.syncfs(fd) != 0:
            raise StoreError(f"syncfs {path}: {os.strerror(ctypes.get_errno())}")


@contextmanager
def _directory(path: Path, *, follow: bool = True) -> Iterator[int]:
    """The directory open (read-only) for an ioctl or a system call on its filesystem; `follow` False
    refuses a symlink as its last component (a path inside a sandbox, which the sandbox may have made one)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    try:
        yield fd
    finally:
        os.close(fd)


def _ioctl_args(size: int, **fields: tuple[int, str, int]) -> bytearray:
    """A zeroed ioctl argument buffer with `fields` (offset, struct format, value) packed in."""
    buf = bytearray(size)
    for offset, fmt, value in fields.values():
        struct.pack_into(fmt, buf, offset, value)
    return buf


def _subvolume_id_of_fd(fd: int) -> int:
    """The id of the subvolume that the open directory `fd` is in (INO_LOOKUP of the root inode)."""
    args = _ioctl_args(IOCTL_ARGS_SIZE, objectid=(8, "=Q", SUBVOLUME_ROOT_INODE))
    fcntl.ioctl(fd, IOC_INO_LOOKUP, args)
    return struct.unpack_from("=Q", args, 0)[0]


def _child_ids(fd: int, parent_id: int) -> list[int]:
    """Ids of the subvolumes whose parent is `parent_id`: ROOT_REF items of the root tree, read as
    binary records (never as text a sandbox could forge with newlines in a name)."""
    children: list[int] = []
    min_offset = 0
    while True:
        args = _ioctl_args(IOCTL_ARGS_SIZE, tree=(0, "=Q", ROOT_TREE_ID), min_objectid=(8, "=Q", parent_id),
                           max_objectid=(16, "=Q", parent_id), min_offset=(24, "=Q", min_offset),
                           max_offset=(32, "=Q", U64_MAX), max_transid=(48, "=Q", U64_MAX),
                           min_type=(56, "=I", ROOT_REF_KEY), max_type=(60, "=I", ROOT_REF_KEY),
                           nr_items=(64, "=I", SEARCH_MAX_ITEMS))
        fcntl.ioctl(fd, IOC_TREE_SEARCH, args)
        count = struct.unpack_from("=I", args, 64)[0]
        if count == 0:
            return children
        position = SEARCH_KEY_SIZE
        for _ in range(count):
            _transid, objectid, offset, item_type, length = struct.unpack_from("=QQQII", args, position)
            position += SEARCH_HEADER_SIZE + length
            if objectid == parent_id and item_type == ROOT_REF_KEY:
                children.append(offset)
            min_offset = offset + 1
        if min_offset > U64_MAX:
            return children


def nested_subvolume_ids(path: Path) -> list[int]:
    """Ids of the subvolumes below `path` (e.g. made inside a sandbox), deepest first. Iterative, so
    any depth of nesting works."""
    with _directory(path, follow=False) as fd:
        found: list[int] = []
        pending = [_subvolume_id_of_fd(fd)]
        while pending:
            children = _child_ids(fd, pending.pop())
            found.extend(children)
            pending.extend(children)
        return found[::-1]  # every child after its parent in `found`: reversed, children come first


def _delete_by_id(mount_fd: int, subvolume_id: int) -> None:
    args = _ioctl_args(IOCTL_ARGS_SIZE, flags=(16, "=Q", SUBVOL_SPEC_BY_ID), subvolid=(56, "=Q", subvolume_id))
    try:
        fcntl.ioctl(mount_fd, IOC_SNAP_DESTROY_V2, args)
    except OSError as e:
        if e.errno != errno.ENOENT:  # already gone
            raise StoreError(f"cannot delete nested subvolume {subvolume_id}: {e.strerror}") from None


def delete(path: Path) -> None:
    """Deletes a subvolume and any subvolumes nested in it (btrfs-progs 6.2 cannot recurse). Nested
    ones are found and deleted by id, so the names a sandbox gives them never matter; rootless, where
    deleting by id is not allowed, by the paths the kernel gives for them (nothing runs in the tree then)."""
    if not is_subvolume(path):
        if path.is_symlink() or path.exists():
            raise StoreError(f"{path} is not a btrfs subvolume; refusing to delete it")
        return
    (_delete_as_owner if rootless.entered() else _delete_as_root)(path)


def _delete_as_root(path: Path) -> None:
    nested = nested_subvolume_ids(path)
    if nested:
        with _directory(path, follow=False) as fd:
            for subvolume_id in nested:
                _delete_by_id(fd, subvolume_id)
    shell.run(["btrfs", "subvolume", "delete", str(path)], what="btrfs subvolume delete")


def _delete_as_owner(path: Path) -> None:
    """Rootless: the store is mounted user_subvol_rm_allowed, and its owner deletes a subvolume once it is
    writable and holds no other, and none inside a read-only one."""
    nested = nested_subvolume_paths(path)
    for subvolume in [path, *nested[::-1]]:  # parents first
        if is_readonly(subvolume):
            set_readonly(subvolume, False)
    for subvolume in [*nested, path]:
        shell.run(["btrfs", "subvolume", "delete", str(subvolume)], what="btrfs subvolume delete")


def _child_paths(fd: int) -> list[bytes]:
    """The paths, relative to the subvolume open as `fd`, of the subvolumes directly below it."""
    refs: list[tuple[int, int]] = []
    while True:
        args = _ioctl_args(IOCTL_ARGS_SIZE, min_treeid=(0, "=Q", refs[-1][0] + 1 if refs else 0))
        try:
            fcntl.ioctl(fd, IOC_GET_SUBVOL_ROOTREF, args)
            more = False
        except OSError as e:
            if e.errno != errno.EOVERFLOW:
                raise
            more = True
        count = args[8 + ROOTREF_MAX_ITEMS * 16]
        refs += [struct.unpack_from("=QQ", args, 8 + 16 * i) for i in range(count)]
        if not more or not count:
            break
    paths = []
    for tree_id, dir_id in refs:
        args = _ioctl_args(IOCTL_ARGS_SIZE, dirid=(0, "=Q", dir_id), treeid=(8, "=Q", tree_id))
        fcntl.ioctl(fd, IOC_INO_LOOKUP_USER, args)
        name = bytes(args[LOOKUP_USER_NAME:LOOKUP_USER_PATH]).split(b"\0")[0]
        paths.append(bytes(args[LOOKUP_USER_PATH:]).split(b"\0")[0] + name)
    return paths


def nested_subvolume_paths(path: Path) -> list[Path]:
    """The subvolumes below `path`, deepest first, as the kernel names them (no privilege needed)."""
    found, pending = [], [path]
    while pending:
        top = pending.pop()
        with _directory(top, follow=False) as fd:
            children = [top / os.fsdecode(child) for child in _child_paths(fd)]
        found += children
        pending += children
    return found[::-1]


def changed_paths(parent: Path, target: Path) -> dict[bytes, bool]:
    """Every path an incremental send from the read-only subvolume `parent` to the read-only `target` names
    (relative to the subvolume, in either tree or a temporary name of the stream), each with whether the
    stream changes a file's bytes there. The kernel compares the two trees and skips the blocks they share,
    so this costs what changed, not the tree's size. Needs CAP_SYS_ADMIN (an OSError otherwise)."""
    with _directory(parent, follow=False) as parent_fd, _directory(target, follow=False) as target_fd:
        parent_id = _subvolume_id_of_fd(parent_fd)
        sources = ctypes.c_uint64(parent_id)
        with tempfile.TemporaryFile(dir="/dev/shm") as stream:
            args = bytearray(72)
            struct.pack_into("=qQQQQI", args, 0, stream.fileno(), 1, ctypes.addressof(sources), parent_id,
                             SEND_NO_FILE_DATA, 0)
            fcntl.ioctl(target_fd, IOC_SEND, args)
            stream.seek(0)
            return _stream_paths(stream.read())


def _stream_paths(stream: bytes) -> dict[bytes, bool]:
    """The paths of a send stream (v1 framing: a command header, then type-length-value attributes)."""
    if not stream.startswith(SEND_MAGIC):
        raise StoreError("btrfs send wrote no stream")
    paths: dict[bytes, bool] = {}
    position = len(SEND_MAGIC) + 4  # the magic, then a u32 version
    while position + 10 <= len(stream):
        length, command, _crc = struct.unpack_from("<IHI", stream, position)
        body, position = stream[position + 10:position + 10 + length], position + 10 + length
        if command in SEND_SUBVOLUME_COMMANDS:
            continue
        names = SEND_PATH_ATTRIBUTES - {17} if command == SEND_SYMLINK else SEND_PATH_ATTRIBUTES
        offset = 0
        while offset + 4 <= len(body):
            kind, size = struct.unpack_from("<HH", body, offset)
            if kind in names and size:
                name = body[offset + 4:offset + 4 + size]
                paths[name] = paths.get(name, False) or command in SEND_DATA_COMMANDS
            offset += 4 + size
    return paths


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
