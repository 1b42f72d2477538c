"""Shipping checkpoints between two btrfs stores on one machine: with btrfs send/receive as root, and
with tar streams, which a rootless host sends and receives (and a root one takes from it)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sprout import rootless
from sprout.sandbox import Store, btrfs, tarstream
from sprout.sandbox.errors import CommandError
from sprout.sandbox.ship import StoreSource, receive
from tests.conftest import DEBIAN_IMAGE, REPO, RUNTIME_BIN

FORMATS = [pytest.param("btrfs", marks=pytest.mark.skipif(rootless.active(), reason="btrfs send needs root")),
           pytest.param("tar", marks=pytest.mark.rootless)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_ship_full_then_incremental_and_branch_there(base_store, other_store, fmt):
    src = Store(base_store.root, runtime_bin=RUNTIME_BIN)
    source = StoreSource(src, formats=(fmt,))
    sandbox = src.create_sandbox(DEBIAN_IMAGE)
    try:
        sandbox.exec("head -c 1048576 /dev/urandom > /root/one && echo first > /root/f")
        cp1 = sandbox.checkpoint()
        sandbox.exec("head -c 1048576 /dev/urandom > /root/two && echo second > /root/f")
        cp2 = sandbox.checkpoint()
        first = receive(other_store, source, cp1.id)
        assert first.shipped == [cp1.image_key, cp1.id] and first.parent == cp1.image_key
        second = receive(other_store, source, cp2.id)
        assert second.shipped == [cp2.id] and second.parent == cp1.id
        assert second.bytes_sent < 3 * 1024 * 1024  # the delta, not the rootfs
        assert receive(other_store, source, cp2.id).shipped == []  # idempotent
        shipped = other_store.checkpoint(cp2.id)
        assert shipped.parent == cp1.id and btrfs.is_readonly(shipped.path)
        branch = shipped.branch()
        assert branch.exec("cat /root/f; ls /root").output.split() == ["second", "f", "one", "two"]
        assert (Path(shipped.path) / "root/two").read_bytes() == (cp2.path / "root/two").read_bytes()
        assert branch.exec("stat -c %u:%g:%a /etc/shadow").output.strip() == "0:42:640"  # owners kept
    finally:
        sandbox.destroy()
        for checkpoint in src.checkpoints(sandbox.id):
            checkpoint.delete(force=True)


RECEIVE = """import sys
from sprout.sandbox import Store
from sprout.sandbox.ship import StoreSource, receive
src, dst, checkpoint, fmt = sys.argv[1:]
print(receive(Store(dst), StoreSource(Store(src), formats=(fmt,)), checkpoint).shipped)"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_processes_receiving_one_checkpoint_at_once_both_get_it(base_store, other_store, fmt):
    """Two branches of one checkpoint that land on one host at once: its image and the checkpoint are
    received once, the other receiver waits and finds them, and neither removes what the other made."""
    src = Store(base_store.root, runtime_bin=RUNTIME_BIN)
    sandbox = src.create_sandbox(DEBIAN_IMAGE)
    try:
        sandbox.exec("head -c 4194304 /dev/urandom > /root/data")
        checkpoint = sandbox.checkpoint()
        receivers = [subprocess.Popen([sys.executable, "-c", RECEIVE, str(src.root), str(other_store.root),
                                       checkpoint.id, fmt], cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        outputs = [receiver.communicate(timeout=300)[0] for receiver in receivers]
        assert [receiver.returncode for receiver in receivers] == [0, 0], outputs
        shipped = sorted(output.strip() for output in outputs)
        assert shipped == sorted(["[]", str([checkpoint.image_key, checkpoint.id])]), outputs  # once, by one
        branch = other_store.checkpoint(checkpoint.id).branch()
        assert branch.exec("md5sum < /root/data").output == sandbox.exec("md5sum < /root/data").output
        branch.destroy()
    finally:
        sandbox.destroy()
        for made in src.checkpoints(sandbox.id):
            made.delete(force=True)


def _tree(root: Path) -> dict[str, tuple]:
    """Every entry below `root`: type and permission bits, owner, size, link target, bytes, xattrs."""
    entries = {}
    for directory, names, files in os.walk(root):
        for name in names + files:
            path = Path(directory, name)
            info = path.lstat()
            link = os.readlink(path) if path.is_symlink() else None
            data = path.read_bytes() if path.is_file() and not path.is_symlink() else None
            xattrs = {} if link else {key: os.getxattr(path, key) for key in os.listxattr(path)}
            entries[str(path.relative_to(root))] = (info.st_mode, info.st_uid, info.st_gid, info.st_size, link,
                                                    data, info.st_nlink, xattrs)
    return entries


@pytest.mark.rootless
def test_a_tar_delta_makes_the_same_tree_and_follows_no_link_the_agent_left(base_store, other_store, tmp_path):
    """Each kind of change between two checkpoints (added, removed and retyped entries, owners, modes,
    hard links, extended attributes, odd names) arrives as it is in the sender's checkpoint; where the
    parent held a link to a host directory and the child a directory of that name, the files land in the
    directory, not through the link."""
    src = Store(base_store.root, runtime_bin=RUNTIME_BIN)
    source = StoreSource(src, formats=("tar",))
    outside = tmp_path / "host-dir"
    outside.mkdir()
    sandbox = src.create_sandbox(DEBIAN_IMAGE)
    try:
        sandbox.exec(f"mkdir -p /w/gone/deep /w/keep && echo a > /w/gone/deep/f && echo k > /w/keep/k && "
                     f"echo x > /w/retyped && mkdir /w/dir-to-file && ln -s {outside} /w/link-to-dir && "
                     f"echo same > /w/linked && chown 1000:1000 /w/keep/k")
        cp1 = sandbox.checkpoint()
        sandbox.exec("rm -r /w/gone && rm /w/retyped && mkdir /w/retyped && echo in > /w/retyped/in && "
                     "rmdir /w/dir-to-file && echo f > /w/dir-to-file && rm /w/link-to-dir && "
                     "mkdir /w/link-to-dir && echo planted > /w/link-to-dir/passwd && chmod 600 /w/keep/k && "
                     "ln /w/linked /w/hardlink && printf 'n' > '/w/-name with\nnewline' && "
                     "mkdir -p /w/new/a/b && echo deep > /w/new/a/b/c && chown 7:7 /w/new/a")
        os.setxattr(sandbox.rootfs / "w/keep/k", "user.sprout", b"kept")
        cp2 = sandbox.checkpoint()
        receive(other_store, source, cp1.id)
        report = receive(other_store, source, cp2.id)
        assert report.parent == cp1.id
        assert list(outside.iterdir()) == []  # nothing went through the link the parent held
        shipped = other_store.checkpoint(cp2.id)
        assert _tree(Path(shipped.path) / "w") == _tree(cp2.path / "w")
        assert (Path(shipped.path) / "w/link-to-dir/passwd").read_text() == "planted\n"
        assert os.getxattr(Path(shipped.path) / "w/keep/k", "user.sprout") == b"kept"
    finally:
        sandbox.destroy()
        for checkpoint in src.checkpoints(sandbox.id):
            checkpoint.delete(force=True)


@pytest.mark.rootless
@pytest.mark.parametrize("stream, refusal", [
    (tarstream.MAGIC + b'{"remove": ["../images"]}\n', "only paths below the subvolume"),
    (tarstream.MAGIC + b'{"remove": ["a/./b"]}\n', "only paths below the subvolume"),
    (tarstream.MAGIC + b'{"gone": []}\n', "malformed remove list"),
    (b"btrfs-stream\0\x01\0\0\0", "not a sprout tar stream")])
def test_a_tar_stream_that_would_remove_outside_its_subvolume_is_refused(other_store, stream, refusal):
    target = other_store.root / "checkpoints" / "cp-crafted"
    with pytest.raises(CommandError, match=refusal):
        tarstream.receive(target, None, iter([stream]))
    assert not target.exists() and (other_store.root / "images").is_dir()
