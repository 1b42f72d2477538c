"""Task images on real podman and a real registry on 127.0.0.1: pulled as the pull policy says, built
once (even by concurrent workers), rebuilt when a base image changes, clear errors offline."""

import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sprout.errors import SproutError
from sprout.sandbox import Store, podman
from sprout.sandbox.podman import command as podman_command
from sprout.tasks import TaskImageError, ensure_image, image_reference, load_task
from sprout.tasks.images import base_images
from sprout.tasks.pull import image_id, pull_policy
from tests.conftest import DEBIAN_IMAGE, PYTHON_IMAGE


def test_two_parallel_attempts_build_the_image_once(copy_task, base_store):
    task_dir = copy_task("py-bugfix", **{"environment/nonce.txt": uuid.uuid4().hex})  # a new content hash
    task = load_task(task_dir)
    bases = base_images(task.paths.environment_dir / "Dockerfile")
    reference = image_reference(task.paths.environment_dir, {base: image_id(base) for base in bases})
    assert subprocess.run([*podman_command(), "image", "exists", reference]).returncode == 1

    def attempt(_):  # each worker has its own Store (and SQLite connection), as the gate's do
        return ensure_image(Store(base_store.root), task.paths.environment_dir, task.config.environment,
                            name=task_dir.name)

    try:
        with ThreadPoolExecutor(2) as pool:
            first, second = pool.map(attempt, range(2))
        assert sorted([first.built, second.built]) == [False, True]
        assert first.image.key == second.image.key and first.reference == second.reference == reference
        again = attempt(0)
        assert not again.built and again.image.key == first.image.key
        config = first.image.config
        assert config.workdir == "/app" and reference in first.image.names
    finally:
        subprocess.run([*podman_command(), "rmi", reference], capture_output=True)


def test_missing_base_image_says_which_and_how_to_provide_it(copy_task, fast_store):
    task_dir = copy_task("py-bugfix", **{"environment/Dockerfile": "FROM sprout-test/no-such-base:1\nRUN true\n"})
    task = load_task(task_dir)
    with pytest.raises(TaskImageError) as e:
        ensure_image(fast_store, task.paths.environment_dir, task.config.environment, name="py-bugfix")
    message = str(e.value)
    assert "task py-bugfix" in message and "'sprout-test/no-such-base:1'" in message
    assert "sprout sandbox images bootstrap" in message and "podman load" in message


def test_missing_docker_image_says_how_to_provide_it(copy_task, fast_store):
    task_dir = copy_task("shell-count")
    toml = task_dir / "task.toml"
    toml.write_text(toml.read_text().replace('"debian:bookworm"', '"sprout-test/absent:2"'))
    task = load_task(task_dir)
    with pytest.raises(TaskImageError, match=r"its image \(\[environment\].docker_image\) 'sprout-test/absent:2' "
                                             r"could not be pulled: short-name .*podman load.*images bootstrap"):
        ensure_image(fast_store, task.paths.environment_dir, task.config.environment, name="shell-count")


def test_failed_build_is_one_line_with_the_log(copy_task, fast_store, tmp_path):
    dockerfile = f"FROM {DEBIAN_IMAGE}\nRUN echo {uuid.uuid4().hex} && exit 7\n"
    task_dir = copy_task("py-bugfix", **{"environment/Dockerfile": dockerfile})
    task = load_task(task_dir)
    log = tmp_path / "build.log"
    with pytest.raises(TaskImageError) as e:
        ensure_image(fast_store, task.paths.environment_dir, task.config.environment, name="py-bugfix", log_path=log)
    assert "task py-bugfix: podman build failed" in str(e.value) and str(log) in str(e.value)
    assert "\n" not in str(e.value) and "exit 7" in log.read_text()


def test_a_hanging_build_is_cut_off_at_the_build_timeout(copy_task, fast_store):
    marker = f".{uuid.uuid4().int % 10**9:09d}"  # in every process of the step: sleep 300.<digits>
    task_dir = copy_task("py-bugfix", **{"environment/Dockerfile":
                                         f"FROM {DEBIAN_IMAGE}\nRUN (sleep 300{marker} &) && sleep 301{marker}\n"})
    toml = task_dir / "task.toml"
    toml.write_text(toml.read_text().replace("build_timeout_sec = 300.0", "build_timeout_sec = 2.0"))
    task = load_task(task_dir)
    started = time.monotonic()
    with pytest.raises(TaskImageError, match="building its image timed out after 2s"):
        ensure_image(fast_store, task.paths.environment_dir, task.config.environment, name="py-bugfix")
    assert time.monotonic() - started < 15
    time.sleep(0.5)
    survivors = [p for p in Path("/proc").iterdir() if p.name.isdigit() and marker in _cmdline(p)]
    assert not survivors, "the build's RUN step is still running"


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _registry_task(copy_task, docker_image: str, dockerfile: str | None) -> Path:
    """shell-count with `docker_image`, and an environment/Dockerfile when given."""
    task_dir = copy_task("shell-count")
    toml = task_dir / "task.toml"
    toml.write_text(toml.read_text().replace('"debian:bookworm"', f'"{docker_image}"'))
    if dockerfile is not None:
        (task_dir / "environment" / "Dockerfile").write_text(dockerfile)
    return task_dir


def _ensure(store, task_dir: Path, **kwargs):
    task = load_task(task_dir)
    return ensure_image(store, task.paths.environment_dir, task.config.environment, name=task_dir.name, **kwargs)


def test_a_prebuilt_image_is_pulled_as_the_policy_says(copy_task, fast_store, local_registry):
    ref = local_registry.push(DEBIAN_IMAGE, f"sprout-test/prebuilt:{uuid.uuid4().hex[:8]}")
    local_registry.remove_local(ref)
    task_dir = _registry_task(copy_task, ref, None)
    try:
        with pytest.raises(TaskImageError, match=f"'{ref}' is not in podman and the pull policy is 'never'"):
            _ensure(fast_store, task_dir, pull="never")
        pulled = _ensure(fast_store, task_dir)  # missing, the default
        assert (pulled.source, pulled.built, pulled.reference) == ("pulled", False, ref) and pulled.pull_s > 0
        assert pulled.image.image_id == image_id(DEBIAN_IMAGE)
        assert _ensure(fast_store, task_dir).source == "present"
        assert _ensure(fast_store, task_dir, pull="always").source == "pulled"
    finally:
        local_registry.remove_local(ref)


def test_an_unpullable_prebuilt_image_builds_the_dockerfile_or_says_what_the_registry_answered(
        copy_task, fast_store, local_registry):
    absent = local_registry.ref(f"sprout-test/never-pushed:{uuid.uuid4().hex[:8]}")
    task_dir = _registry_task(copy_task, absent, None)
    with pytest.raises(TaskImageError) as e:
        _ensure(fast_store, task_dir)
    message = str(e.value)
    assert f"its image ([environment].docker_image) '{absent}' could not be pulled: " in message
    assert "manifest unknown" in message and "podman load" in message and "\n" not in message
    (task_dir / "environment" / "Dockerfile").write_text("FROM sprout-test/no-such-base:1\n")
    with pytest.raises(TaskImageError, match=f"its image '{absent}' could not be pulled \\(.*manifest unknown.*\\), "
                                             "and building Dockerfile instead failed: the Dockerfile's base image"):
        _ensure(fast_store, task_dir)
    (task_dir / "environment" / "Dockerfile").write_text(f"FROM {DEBIAN_IMAGE}\nWORKDIR /app\n")
    built = _ensure(fast_store, task_dir)
    assert built.source in ("built", "cached") and built.reference.startswith("localhost/sprout-task-env:")
    assert built.warning.startswith(f"the prebuilt image '{absent}' could not be pulled (")
    assert built.warning.endswith("built Dockerfile instead") and built.base_images == {
        DEBIAN_IMAGE: image_id(DEBIAN_IMAGE)}


def test_a_changed_base_image_is_rebuilt_not_reused(copy_task, fast_store, local_registry):
    base = local_registry.ref(f"sprout-test/base:{uuid.uuid4().hex[:8]}")
    task_dir = copy_task("py-bugfix", **{"environment/Dockerfile": f"FROM {base}\nRUN true\n"})
    made = []
    try:
        local_registry.push(DEBIAN_IMAGE, base.split("/", 1)[1])
        first = _ensure(fast_store, task_dir)
        made.append(first.reference)
        assert first.base_images == {base: image_id(DEBIAN_IMAGE)}
        local_registry.push(PYTHON_IMAGE, base.split("/", 1)[1])  # the registry's base is now another image
        subprocess.run([*podman_command(), "tag", DEBIAN_IMAGE, base], check=True)  # podman's is still the old one
        assert _ensure(fast_store, task_dir).reference == first.reference  # missing: the local base is kept
        second = _ensure(fast_store, task_dir, pull="always")
        made.append(second.reference)
        assert second.base_images == {base: image_id(PYTHON_IMAGE)} and second.reference != first.reference
        assert second.source == "built" and second.image.image_id != first.image.image_id
    finally:
        for ref in (*made, base):
            subprocess.run([*podman_command(), "rmi", ref], capture_output=True)


def test_the_pull_policy_comes_from_the_flag_then_the_environment(monkeypatch):
    monkeypatch.delenv("SPROUT_PULL_POLICY", raising=False)
    assert pull_policy() == "missing" and pull_policy("never") == "never"
    monkeypatch.setenv("SPROUT_PULL_POLICY", "always")
    assert pull_policy() == "always" and pull_policy("missing") == "missing"
    monkeypatch.setenv("SPROUT_PULL_POLICY", "sometimes")
    with pytest.raises(SproutError, match="SPROUT_PULL_POLICY='sometimes' cannot be used: Input should be 'missing', "
                                         "'always' or 'never'"):
        pull_policy()


def test_concurrent_workers_pull_an_image_once(copy_task, base_store, local_registry, monkeypatch):
    ref = local_registry.push(DEBIAN_IMAGE, f"sprout-test/shared:{uuid.uuid4().hex[:8]}")
    local_registry.remove_local(ref)
    pulls = []
    real_pull = podman.pull


    def slow_pull(reference: str) -> str | None:
        pulls.append(reference)
        time.sleep(2)  # every worker is waiting on the lock by now, not starting after the pull ended
        return real_pull(reference)

    monkeypatch.setattr(podman, "pull", slow_pull)
    task_dir = _registry_task(copy_task, ref, None)
    try:
        with ThreadPoolExecutor(3) as pool:  # each worker with its own Store, as the gate's are
            results = list(pool.map(lambda _: _ensure(Store(base_store.root), task_dir, pull="always"), range(3)))
        assert pulls == [ref]  # the others waited for that pull and used it
        assert {r.image.image_id for r in results} == {image_id(DEBIAN_IMAGE)}
    finally:
        local_registry.remove_local(ref)
