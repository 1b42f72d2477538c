"""Task images: `environment/Dockerfile` built offline with podman (or a `docker_image` reference),
unpacked once into the store and cached by image id.

A built image is tagged with Harbor's content hash of `environment/`, so an unchanged environment
is never rebuilt and tasks with identical environments share one image. Builds of one hash are
serialised across threads and processes by a file lock in the store.
"""

import fcntl
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harbor.environments.definition import (DOCKERFILE_NAME, environment_content_hash,
                                            should_use_prebuilt_docker_image)
from harbor.models.task.config import EnvironmentConfig

from ..sandbox import Image, Store
from ..sandbox.errors import ImageNotFound
from ..sandbox.podman import PODMAN, ulimit_flags
from .errors import TaskImageError

TAG_REPOSITORY = "localhost/sprout-task-env"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")  # RUN steps reach package mirrors with the host's CAs
STOP_GRACE_S = 10
HOW_TO_PROVIDE = ("no registry is reachable, so provide it offline: `python -m sprout.sandbox images bootstrap` "
                  "(python:3.11/3.12, debian:bookworm, ubuntu:22.04/24.04), or `podman load -i IMAGE.tar` "
                  "(or `podman import ROOTFS.tar`) and `podman tag` it with that name")


@dataclass(frozen=True)
class TaskImage:
    image: Image
    reference: str  # the podman name the store image was imported from
    built: bool  # whether this call ran `podman build`
    seconds: float


def image_reference(environment_dir: Path, config: EnvironmentConfig, *, force_build: bool = False) -> str:
    """The podman name of a task's image: its docker_image, or the tag of its Dockerfile build."""
    if should_use_prebuilt_docker_image(environment_dir, docker_image=config.docker_image, force_build=force_build):
        return config.docker_image
    return f"{TAG_REPOSITORY}:{environment_content_hash(environment_dir)}"


def ensure_image(store: Store, environment_dir: Path, config: EnvironmentConfig, *, name: str,
                 rebuild_before: float | None = None, log_path: Path | None = None) -> TaskImage:
    """The store image of a task, building it first when podman lacks it.

    `rebuild_before`: a build tagged before this time (epoch seconds) is redone without layer cache
    (--no-build-cache, Harbor's force_build); later ones, e.g. by a concurrent worker, are reused."""
    started = time.monotonic()
    reference = image_reference(environment_dir, config, force_build=rebuild_before is not None)
    if not reference.startswith(TAG_REPOSITORY + ":"):
        try:
            image = store.resolve_image(reference)
        except ImageNotFound:
            raise TaskImageError(f"task {name}: its image {reference!r} ([environment].docker_image) "
                                 f"is not in podman; {HOW_TO_PROVIDE}") from None
        return TaskImage(image, reference, False, time.monotonic() - started)
    built = False
    with _file_lock(store.root / "state" / "locks" / f"build-{reference.rpartition(':')[2]}"):
        created = _created(reference)
        if created is None or (rebuild_before is not None and created < rebuild_before):
            _check_base_images(environment_dir / DOCKERFILE_NAME, name)
            _build(environment_dir, reference, name=name, timeout=config.build_timeout_sec,
                   no_cache=rebuild_before is not None, log_path=log_path)
            built = True
    return TaskImage(store.import_image(reference), reference, built, time.monotonic() - started)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _podman(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True)


def _created(reference: str) -> float | None:
    """When podman's image of that name was built (epoch seconds), or None if podman has none."""
    proc = _podman("image", "inspect", "--format", "{{.Created.Unix}}", reference)
    return float(proc.stdout.strip()) if proc.returncode == 0 else None


def base_images(dockerfile: Path) -> list[str]:
    """The images a Dockerfile's FROM lines name (ARG defaults expanded; stage names and scratch left out)."""
    text = re.sub(r"\\\r?\n", " ", dockerfile.read_text())
    args: dict[str, str] = {}
    stages: set[str] = set()
    images: list[str] = []
    seen_from = False
    for line in text.splitlines():
        words = line.strip().split()
        if not words or words[0].startswith("#"):
            continue
        keyword = words[0].upper()
        if keyword == "ARG" and not seen_from and len(words) > 1:  # only ARGs before the first FROM apply
            key, _, value = words[1].partition("=")
            args[key] = value.strip("\"'")
        elif keyword == "FROM":
            seen_from = True
            rest = [w for w in words[1:] if not w.startswith("--")]
            if not rest:
                continue
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), rest[0])
            if len(rest) >= 3 and rest[1].upper() == "AS":
                stages.add(rest[2].lower())
            if image.lower() not in stages and image != "scratch":
                images.append(image)
    return images


def _check_base_images(dockerfile: Path, name: str) -> None:
    for image in base_images(dockerfile):  # one with an unresolved ARG is left for the build to report
        if "$" not in image and _podman("image", "exists", image).returncode != 0:
            raise TaskImageError(f"task {name}: the Dockerfile's base image {image!r} (FROM) is not in "
                                 f"podman; {HOW_TO_PROVIDE}")


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def _kill_build_steps(pid: int) -> None:
    """SIGKILLs what a `podman build` (pid) runs: its child processes and everything in the cgroups of
    its RUN steps (/buildah-*), where a step's daemonised processes are left when runc is gone."""
    doomed = set(_descendants(pid))
    for child in list(doomed):
        try:
            lines = Path(f"/proc/{child}/cgroup").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            _, controller, path = line.split(":", 2)
            if controller == "pids" and path.startswith("/buildah-"):
                procs = Path(f"/sys/fs/cgroup/pids{path}/cgroup.procs")
                doomed.update(int(p) for p in procs.read_text().split()) if procs.exists() else None
    for victim in doomed:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _build(environment_dir: Path, tag: str, *, name: str, timeout: float, no_cache: bool,
           log_path: Path | None) -> None:
    cmd = [*PODMAN, "build", "--pull=never", *ulimit_flags(), "-t", tag,
           "-f", str(environment_dir / DOCKERFILE_NAME)]
    if CA_BUNDLE.exists():
        cmd += ["-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"]
    if no_cache:
        cmd.append("--no-cache")
    proc = subprocess.Popen([*cmd, str(environment_dir)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_build_steps(proc.pid)
        try:
            proc.communicate(timeout=STOP_GRACE_S)  # the step failed: podman removes its working container
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise TaskImageError(f"task {name}: building its image timed out after {timeout:g}s "
                             "([environment].build_timeout_sec)") from None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(output)
    if proc.returncode != 0:
        lines = [line for line in output.splitlines() if line.strip()]
        last = next((line for line in reversed(lines) if line.startswith("Error")), lines[-1] if lines else "")
        if "pull policy" in last or "image not known" in last:
            last += f"; {HOW_TO_PROVIDE}"
        where = f" (build log: {log_path})" if log_path else ""
        raise TaskImageError(f"task {name}: podman build failed: {last}{where}")
