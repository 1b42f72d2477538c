"""Shared fixtures: a real btrfs store and real podman (set up by ops/setup_podman.sh)."""

import os

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
