"""An image's WORKDIR that its rootfs lacks is created at import, as podman and docker create it at start."""

import subprocess
import tarfile
from contextlib import suppress

import pytest

from sprout.sandbox import ImageNotFound, StoreError
from sprout.sandbox.podman import command as podman_command
from sprout.sandbox.podman import inspect_image
from sprout.sandbox.rootfs import makedirs_in_root
from tests.conftest import DEBIAN_IMAGE


def forget_image(store, tag: str) -> None:
    """Removes the image from the store and from podman."""
    with suppress(ImageNotFound):
        store.remove_image(store.image(tag).key)
    subprocess.run([*podman_command(), "rmi", "-f", tag], capture_output=True)


def test_a_missing_workdir_is_created_and_the_image_user_applies(store, tmp_path):
    tag = "localhost/sprout-test/bare-workdir:1"
    (tmp_path / "Containerfile").write_text(f"FROM {DEBIAN_IMAGE}\nWORKDIR /app/sub\nUSER 1000\n")
    subprocess.run([*podman_command(), "build", "-q", "--pull=never", "-t", tag, str(tmp_path)], check=True,
                   capture_output=True)
    try:
        sandbox = store.create_sandbox(store.import_image(tag))
        try:
            result = sandbox.exec("pwd; id -u; stat -c '%u:%g %a' /app /app/sub")
            assert result.output.splitlines() == ["/app/sub", "1000", "0:0 755", "0:0 755"], result
        finally:
            sandbox.destroy()
    finally:
        forget_image(store, tag)


def test_a_workdir_that_is_a_file_in_the_image_is_a_clear_error(base_store, tmp_path):
    tag = "localhost/sprout-test/workdir-is-a-file:1"
    (tmp_path / "app").write_text("not a directory")
    with tarfile.open(tmp_path / "rootfs.tar", "w") as tar:
        tar.add(tmp_path / "app", arcname="app")
    subprocess.run([*podman_command(), "import", "--change", "WORKDIR=/app/sub", str(tmp_path / "rootfs.tar"), tag],
                   check=True, capture_output=True)
    try:
        with pytest.raises(StoreError, match=f"image {tag}: its WORKDIR /app/sub exists but is not a dir"):
            base_store.import_image(tag)
        key = f"im-{inspect_image(tag).image_id.removeprefix('sha256:')[:12]}"
        assert not (base_store.root / "images" / f".partial-{key}").exists()
        assert not (base_store.root / "images" / key).exists()
    finally:
        forget_image(base_store, tag)


def test_makedirs_resolves_links_inside_the_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "etc").mkdir(parents=True)
    outside.mkdir()
    (root / "app").symlink_to("/etc")
    (root / "escape").symlink_to("../../outside")
    makedirs_in_root(root, "/app/sub")
    assert (root / "etc/sub").is_dir()
    with pytest.raises(FileExistsError):  # resolved in the root, the link dangles: nothing made outside
        makedirs_in_root(root, "/escape/x")
    assert list(outside.iterdir()) == []
