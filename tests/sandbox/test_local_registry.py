"""The test registry itself (tests/registry.py): podman pushes to it and pulls back from it over plain
HTTP, with nothing but the session's $CONTAINERS_REGISTRIES_CONF telling podman that it may."""

import os
import subprocess
import urllib.request

from sprout.sandbox.podman import command as podman_command
from tests.conftest import DEBIAN_IMAGE


def podman(*args: str) -> subprocess.CompletedProcess:
    """podman as Sprout runs it: the process environment only (no extra env, no --tls-verify)."""
    return subprocess.run([*podman_command(), *args], capture_output=True, text=True, timeout=600, check=False)


def image_id(ref: str) -> str:
    proc = podman("image", "inspect", "--format", "{{.Id}}", ref)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_push_remove_and_pull_back_through_the_local_registry(local_registry):
    assert os.environ["CONTAINERS_REGISTRIES_CONF"] == local_registry.env["CONTAINERS_REGISTRIES_CONF"]
    with urllib.request.urlopen(f"{local_registry.url}/v2/", timeout=5) as answer:
        assert answer.status == 200
    original = image_id(DEBIAN_IMAGE)
    ref = local_registry.push(DEBIAN_IMAGE, "sprout-test/debian:pushed")
    try:
        assert ref == f"127.0.0.1:{local_registry.port}/sprout-test/debian:pushed"
        assert "pushed" in local_registry.tags("sprout-test/debian")

        local_registry.remove_local(ref)
        assert podman("image", "exists", ref).returncode == 1
        assert image_id(DEBIAN_IMAGE) == original, "removing the registry's name removed the image"

        pulled = podman("pull", ref)
        assert pulled.returncode == 0, pulled.stderr
        assert podman("image", "exists", ref).returncode == 0
        assert image_id(ref) == original
    finally:
        local_registry.remove_local(ref)
    assert podman("image", "exists", ref).returncode == 1
    assert podman("image", "exists", DEBIAN_IMAGE).returncode == 0


def test_without_the_registries_conf_podman_refuses_plain_http(local_registry):
    """The registries.conf is what makes the pulls above work (podman defaults to HTTPS)."""
    env = {k: v for k, v in os.environ.items() if k != "CONTAINERS_REGISTRIES_CONF"}
    proc = subprocess.run([*podman_command(), "pull", local_registry.ref("sprout-test/absent:1")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert "server gave HTTP response to HTTPS client" in proc.stderr, proc.stderr
