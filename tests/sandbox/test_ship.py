"""Shipping checkpoints between two btrfs stores on one machine with btrfs send/receive."""

from pathlib import Path

from sprout.sandbox import Store, btrfs
from sprout.sandbox.ship import ship
from tests.conftest import DEBIAN_IMAGE, RUNTIME_BIN


def test_ship_full_then_incremental_and_branch_there(base_store, other_store):
    src = Store(base_store.root, runtime_bin=RUNTIME_BIN)
    sandbox = src.create_sandbox(DEBIAN_IMAGE)
    try:
        sandbox.exec("head -c 1048576 /dev/urandom > /root/one && echo first > /root/f")
        cp1 = sandbox.checkpoint()
        sandbox.exec("head -c 1048576 /dev/urandom > /root/two && echo second > /root/f")
        cp2 = sandbox.checkpoint()
        first = ship(src, other_store, cp1.id)
        assert first.shipped == [cp1.image_key, cp1.id] and first.parent == cp1.image_key
        second = ship(src, other_store, cp2.id)
        assert second.shipped == [cp2.id] and second.parent == cp1.id
        assert second.bytes_sent < 3 * 1024 * 1024  # the delta, not the rootfs
        assert ship(src, other_store, cp2.id).shipped == []  # idempotent
        shipped = other_store.checkpoint(cp2.id)
        assert shipped.parent == cp1.id and btrfs.is_readonly(shipped.path)
        branch = shipped.branch()
        assert branch.exec("cat /root/f; ls /root").output.split() == ["second", "f", "one", "two"]
        assert (Path(shipped.path) / "root/two").read_bytes() == (cp2.path / "root/two").read_bytes()
    finally:
        sandbox.destroy()
        for checkpoint in src.checkpoints(sandbox.id):
            checkpoint.delete(force=True)
