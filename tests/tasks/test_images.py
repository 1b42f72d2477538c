"""Task images on real podman: built once (even by concurrent workers), cached, clear errors offline."""

import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sprout.sandbox import Store
from sprout.sandbox.podman import PODMAN
from sprout.tasks import TaskImageError, ensure_image, image_reference, load_task
from tests.conftest import DEBIAN_IMAGE


def test_two_parallel_attempts_build_the_image_once(copy_task, base_store):
    task_dir = copy_task("py-bugfix", **{"environment/nonce.txt": uuid.uuid4().hex})  # a new content hash
    task = load_task(task_dir)
    reference = image_reference(task.paths.environment_dir, task.config.environment)
    assert subprocess.run([*PODMAN, "image", "exists", reference]).returncode == 1

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
        subprocess.run([*PODMAN, "rmi", reference], capture_output=True)


def test_missing_base_image_says_which_and_how_to_provide_it(copy_task, fast_store):
    task_dir = copy_task("py-bugfix", **{"environment/Dockerfile": "FROM sprout-test/no-such-base:1\nRUN true\n"})
    task = load_task(task_dir)
    with pytest.raises(TaskImageError) as e:
        ensure_image(fast_store, task.paths.environment_dir, task.config.environment, name="py-bugfix")
    message = str(e.value)
    assert "task py-bugfix" in message and "'sprout-test/no-such-base:1'" in message
    assert "python -m sprout.sandbox images bootstrap" in message and "podman load" in message


def test_missing_docker_image_says_how_to_provide_it(copy_task, fast_store):
    task_dir = copy_task("shell-count")
    toml = task_dir / "task.toml"
    toml.write_text(toml.read_text().replace('"debian:bookworm"', '"sprout-test/absent:2"'))
    task = load_task(task_dir)
    with pytest.raises(TaskImageError, match="its image 'sprout-test/absent:2'.*images bootstrap"):
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
