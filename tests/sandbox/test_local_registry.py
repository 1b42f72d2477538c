"""The test registry itself (tests/registry.py): podman pushes to it and pulls back from it over plain
HTTP, with nothing but the session's $CONTAINERS_REGISTRIES_CONF telling podman that it may."""

import os
import subprocess
import urllib.request
import uuid
from dataclasses import replace

from sprout.sandbox.images import RECIPE_LABEL, RECIPES, bootstrap, stand_in
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


def _mirror_of_docker_io(path, mirror: str, registry_host: str) -> str:
    """A registries.conf (for this test only) that sends docker.io's pulls to `mirror` first."""
    path.write_text(f'[[registry]]\nprefix = "docker.io"\nlocation = "docker.io"\n[[registry.mirror]]\n'
                    f'location = "{mirror}"\ninsecure = true\n\n'
                    f'[[registry]]\nlocation = "{registry_host}"\ninsecure = true\n')
    return str(path)


def test_base_images_are_pulled_where_a_registry_has_them_and_stand_ins_only_elsewhere(local_registry, tmp_path,
                                                                                        base_store, monkeypatch):
    """The set-up's base images with docker.io mirrored by the local registry: a name it has is pulled, one it
    lacks gets the offline stand-in (labelled as one); once the registry has it too, a second run replaces
    the stand-in; offline again, podman's real images are kept, never covered by a stand-in."""
    run = uuid.uuid4().hex[:8]
    reachable, later = f"docker.io/library/sprout-test-base:{run}-a", f"docker.io/library/sprout-test-base:{run}-b"
    real = f"localhost/sprout-test/real-base:{run}"
    (tmp_path / "Containerfile").write_text(f'FROM {DEBIAN_IMAGE}\nLABEL {RECIPE_LABEL}=""\nRUN echo real > /real\n')
    assert podman("build", "-q", "--pull=never", "-t", real, str(tmp_path)).returncode == 0
    pushed = [local_registry.push(real, f"library/sprout-test-base:{run}-a")]
    recipe = replace(RECIPES[1], tags=(reachable, later))  # the debian recipe's stand-in, under test names
    cache, lines = base_store.root / "cache" / "bootstrap", []
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF",
                       _mirror_of_docker_io(tmp_path / "mirror.conf", local_registry.host, local_registry.host))
    try:
        done = bootstrap(recipe, cache, log=lines.append)
        assert done.pulled == [reachable] and list(done.stand_ins) == [later] and not done.kept
        assert image_id(reachable) == image_id(real) and not stand_in(reachable)
        assert stand_in(later) and image_id(later) == image_id(f"localhost/{recipe.name}:{recipe.digest}")
        assert f"  pulled    {reachable}" in lines and any(line.startswith(f"  stand-in  {later} ") for line in lines)

        pushed.append(local_registry.push(real, f"library/sprout-test-base:{run}-b"))
        done = bootstrap(recipe, cache, log=lines.append)  # the set-up run again, the registry now has both
        assert done.pulled == [reachable, later] and not done.stand_ins
        assert image_id(later) == image_id(real) and not stand_in(later)

        monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF",  # offline: the mirror is a closed port
                           _mirror_of_docker_io(tmp_path / "closed.conf", "127.0.0.1:1", local_registry.host))
        done = bootstrap(recipe, cache, log=lines.append)
        assert done.kept == [reachable, later] and not done.pulled and not done.stand_ins
        assert image_id(later) == image_id(real)
    finally:
        podman("rmi", "--force", reachable, later, real, *pushed)
