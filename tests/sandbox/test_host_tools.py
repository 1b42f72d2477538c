"""What Sprout asks of btrfs and podman without running their commands each time: snapshots by ioctl, the
filesystem by statfs(2), podman's answers asked once when threads ask at once."""

import subprocess
import threading
import uuid
from pathlib import Path

import pytest

from sprout.sandbox import CommandError, Store, btrfs, podman, shell
from tests.conftest import PYTHON_IMAGE


@pytest.fixture
def scratch(base_store: Store):
    """A plain directory in the store's btrfs, with whatever subvolumes a test made in it deleted after."""
    path = base_store.root / "sandboxes" / f"test-host-tools-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    for child in path.iterdir():
        btrfs.delete(child)
    path.rmdir()


def test_snapshots_by_ioctl_are_read_only_or_writable_and_fail_with_the_reason(scratch: Path):
    btrfs.create(scratch / "source")
    (scratch / "source" / "f").write_text("one")
    btrfs.snapshot(scratch / "source", scratch / "frozen", readonly=True)
    btrfs.snapshot(scratch / "source", scratch / "open", readonly=False)
    (scratch / "source" / "f").write_text("two")
    assert btrfs.is_subvolume(scratch / "frozen") and btrfs.is_readonly(scratch / "frozen")
    assert (scratch / "frozen" / "f").read_text() == "one"
    with pytest.raises(OSError):
        (scratch / "frozen" / "f").write_text("tamper")
    assert not btrfs.is_readonly(scratch / "open")
    (scratch / "open" / "f").write_text("mine")
    assert (scratch / "source" / "f").read_text() == "two"
    with pytest.raises(CommandError, match=r"btrfs subvolume snapshot .*/source .*/open failed: File exists"):
        btrfs.snapshot(scratch / "source", scratch / "open", readonly=False)
    with pytest.raises(CommandError, match="No such file or directory"):
        btrfs.snapshot(scratch / "missing", scratch / "other", readonly=False)


def test_is_btrfs_tells_the_store_from_other_filesystems(scratch: Path, tmp_path: Path):
    btrfs.create(scratch / "sub")
    assert btrfs.is_btrfs(scratch) and btrfs.is_subvolume(scratch / "sub") and not btrfs.is_subvolume(scratch)
    assert not btrfs.is_btrfs(Path("/proc")) and not btrfs.is_btrfs(scratch / "missing")
    assert btrfs.is_btrfs(tmp_path) == (subprocess.run(["stat", "-f", "-c", "%T", tmp_path], capture_output=True,
                                                       text=True).stdout.strip() == "btrfs")


def test_threads_asking_podman_about_one_image_at_once_ask_it_once(base_store: Store, monkeypatch):
    """Each `podman image inspect` is for an images file version no thread had asked about (other tests
    may tag and remove images meanwhile, which is a new version: then podman is asked again)."""
    name = f"localhost/sprout-test-asked-once:{uuid.uuid4().hex[:8]}"
    subprocess.run([*podman.command(), "tag", PYTHON_IMAGE, name], check=True, capture_output=True)
    seen = threading.local()
    inspected: list[tuple[int, int] | None] = []  # the version each inspect was made for
    real_version, real_run = podman._images_version, shell.run

    def version_seen() -> tuple[int, int] | None:
        seen.version = real_version()
        return seen.version

    def counting_run(cmd, **kwargs):
        if cmd[len(podman.command()):][:2] == ["image", "inspect"]:
            inspected.append(seen.version)
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(podman, "_images_version", version_seen)
    monkeypatch.setattr(shell, "run", counting_run)
    try:
        start = threading.Barrier(16)
        answers: list[dict | None] = []

        def ask() -> None:
            start.wait()
            answers.append(podman.image_info(name))

        threads = [threading.Thread(target=ask) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(answers) == 16 and all(a is not None and name in a["RepoTags"] for a in answers)
        assert inspected and None not in inspected and len(set(inspected)) == len(inspected), inspected
    finally:
        subprocess.run([*podman.command(), "untag", PYTHON_IMAGE, name], check=True, capture_output=True)
    assert podman.image_info(name) is None and len(set(inspected)) == len(inspected)
