"""Importing a podman image into the store: the subvolume holds exactly the image's filesystem, and an
image built on a store image shares that image's files on disk instead of copying them."""

import hashlib
import json
import os
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sprout.sandbox.podman import command as podman_command
from tests.conftest import PYTHON_IMAGE
from tests.sandbox.test_workdir import forget_image

# Every kind of change a layer can make to its base: content with the same size and mtime, metadata only
# (of one name of a hard link too), deletions (whiteouts), a directory replaced whole (opaque), a
# directory by a file and a file by a directory, and new files of every type with owners, setuid, a hard
# link and an extended attribute.
MUTATE = """\
import os, shutil
path = "/etc/debian_version"
before, data = os.stat(path), open(path, "rb").read()
open(path, "wb").write(data[::-1])
os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
os.chmod("/etc/shells", 0o600)
os.chmod("/usr/bin/perl5.36.0", 0o700)  # one name of the base's perl hard link: the layer breaks the link
os.remove("/etc/issue.net")
shutil.rmtree("/etc/apt/apt.conf.d")
os.mkdir("/etc/apt/apt.conf.d")
open("/etc/apt/apt.conf.d/only", "w").write("the only one")
shutil.rmtree("/srv")
open("/srv", "w").write("a file now")
os.remove("/etc/issue")
os.mkdir("/etc/issue")
os.makedirs("/data/sub")
open("/data/a", "w").write("payload")
os.chown("/data/a", 1234, 5678)
os.chmod("/data/a", 0o4755)
os.setxattr("/data/a", "user.sprout", b"kept")
os.link("/data/a", "/data/sub/hard")
os.symlink("../a", "/data/sub/link")
os.mkfifo("/data/fifo")
"""


def manifest(root: Path) -> dict[str, tuple]:
    """Every path under `root` with its type and mode, owner, content (hash, link target or device),
    extended attributes, mtime, and the other names of its inode under `root` (hard links)."""
    entries, names = {}, {}
    for directory, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(directory, name)
            info, relative = path.lstat(), str(path.relative_to(root))
            if stat.S_ISREG(info.st_mode):
                content = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(info.st_mode):
                content = os.readlink(path)
            else:
                content = info.st_rdev
            xattrs = sorted((key, os.getxattr(path, key, follow_symlinks=False))
                            for key in os.listxattr(path, follow_symlinks=False))
            entries[relative] = (info.st_mode, info.st_uid, info.st_gid, content, xattrs, info.st_mtime_ns)
            if not stat.S_ISDIR(info.st_mode):
                names.setdefault(info.st_ino, set()).add(relative)
    inodes = {relative: frozenset(same) for same in names.values() for relative in same}
    return {relative: (*entry, inodes.get(relative)) for relative, entry in entries.items()}


@contextmanager
def mounted(tag: str) -> Iterator[Path]:
    """The podman image's own filesystem, read through `podman image mount`."""
    mountpoint = subprocess.run([*podman_command(), "image", "mount", tag], capture_output=True, text=True,
                                check=True).stdout.strip()
    try:
        yield Path(mountpoint)
    finally:
        subprocess.run([*podman_command(), "image", "unmount", tag], capture_output=True, check=True)


def disk_usage(path: Path) -> tuple[int, int]:
    """The bytes of `path`'s files, and of those the bytes no other subvolume shares."""
    out = subprocess.run(["btrfs", "filesystem", "du", "-s", "--raw", str(path)], capture_output=True,
                         text=True, check=True).stdout
    total, exclusive = out.splitlines()[1].split()[:2]
    return int(total), int(exclusive)


def test_an_image_built_on_a_store_image_shares_its_files_and_holds_exactly_its_own(base_store, tmp_path):
    base = base_store.resolve_image(PYTHON_IMAGE)
    # A store from before layers were recorded: the base's layers are asked of podman when needed.
    base_store.meta.execute("UPDATE images SET layers = NULL WHERE key = ?", base.key)
    (tmp_path / "mutate.py").write_text(MUTATE)
    (tmp_path / "Containerfile").write_text(
        f"FROM {PYTHON_IMAGE}\nCOPY mutate.py /mutate.py\nRUN python3 /mutate.py && rm /mutate.py\n")
    tag = "localhost/sprout-test/on-a-base:1"
    subprocess.run([*podman_command(), "build", "-q", "--pull=never", "-t", tag, str(tmp_path)], check=True,
                   capture_output=True)
    try:
        image = base_store.import_image(tag)
        recorded = base_store.meta.one("SELECT layers FROM images WHERE key = ?", base.key)["layers"]
        assert recorded and json.loads(recorded), "the base's layers were not recorded"
        with mounted(tag) as own:
            expected = manifest(own)
        assert manifest(image.path) == expected
        assert expected["etc/debian_version"][3] != manifest(base.path)["etc/debian_version"][3]
        assert expected["data/a"][4] == [("user.sprout", b"kept")]
        assert expected["data/sub/hard"][6] == {"data/a", "data/sub/hard"}
        perl = expected["usr/bin/perl"]  # the other name of the link the layer broke keeps its mode
        assert perl[6] == {"usr/bin/perl"} and perl[0] & 0o777 == 0o755
        total, exclusive = disk_usage(image.path)
        assert total > 100 * 2**20 and exclusive < 2**20, (total, exclusive)
    finally:
        forget_image(base_store, tag)
