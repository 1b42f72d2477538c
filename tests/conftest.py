"""Shared fixtures: a real btrfs store and real podman (set up by ops/setup_podman.sh)."""

import os
import subprocess

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from pathlib import Path

import pytest

from sprout.sandbox import Store

REPO = Path(__file__).resolve().parents[1]
RUNTIME_BIN = REPO / "runtime" / "sprout-runtime"
PYTHON_IMAGE = "docker.io/library/python:3.11-slim"
DEBIAN_IMAGE = "docker.io/library/debian:bookworm"


@pytest.fixture(scope="session")
def base_store() -> Store:
    return Store()


@pytest.fixture(params=["runtime", "podman-exec"])
def store(request, base_store: Store):
    """The store, once with commands through sprout-runtime and once through `podman exec`;
    every sandbox a test makes is destroyed afterwards."""
    assert RUNTIME_BIN.exists(), "run ops/setup_podman.sh first (it writes runtime/sprout-runtime)"
    st = Store(base_store.root, runtime_bin=RUNTIME_BIN if request.param == "runtime" else None)
    before = {s.id for s in st.sandboxes()}
    yield st
    for sandbox in st.sandboxes():
        if sandbox.id not in before:
            sandbox.destroy()


@pytest.fixture
def other_store(tmp_path):
    """A second btrfs filesystem (its own loop file), as another host's store would be."""
    image, mount = tmp_path / "other.img", tmp_path / "other"
    subprocess.run(["truncate", "-s", "3G", str(image)], check=True)
    subprocess.run(["mkfs.btrfs", "-q", str(image)], check=True, capture_output=True)
    mount.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    store = Store(mount, runtime_bin=RUNTIME_BIN)
    yield store
    for sandbox in store.sandboxes():
        sandbox.destroy()
    store.meta.close()
    subprocess.run(["umount", str(mount)], check=True)
