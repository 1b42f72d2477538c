"""Task images: a task's prebuilt `docker_image` (pulled as the pull policy says) or its
`environment/Dockerfile` built with podman, unpacked once into the store and cached by image id.

A built image is tagged with a hash of Harbor's content hash of `environment/` and the ids of its FROM
images, so an unchanged environment on unchanged bases is never rebuilt, a changed base image is, and
tasks with identical environments share one image. Builds of one tag are serialised across threads
and processes by a file lock in the store. When a prebuilt image cannot be pulled and the task has a
Dockerfile, the Dockerfile is built instead (with a warning the summaries record).
"""

import fcntl
import hashlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Literal

from harbor.environments.definition import (
    DOCKERFILE_NAME,
    environment_content_hash,
    should_use_prebuilt_docker_image,
)
from harbor.models.task.config import EnvironmentConfig

from ..sandbox import Image, Store, trust
from ..sandbox.images import stand_in
from ..sandbox.podman import command as podman_command
from ..sandbox.podman import image_info, ulimit_flags
from .errors import TaskImageError
from .pull import OFFLINE_HELP, PullError, PullPolicy, ensure_present, pull_policy

TAG_REPOSITORY = "localhost/sprout-task-env"
STOP_GRACE_S = 10

ImageSource = Literal["present", "pulled", "built", "cached"]


@dataclass(frozen=True)
class TaskImage:
    image: Image
    reference: str  # the podman name the store image was imported from
    built: bool  # whether this call ran `podman build`
    seconds: float
    source: ImageSource = "present"  # prebuilt and already in podman, pulled, built now, or an earlier build
    warning: str | None = None  # e.g. the prebuilt image could not be pulled and the Dockerfile was built
    base_images: dict[str, str] = field(default_factory=dict)  # FROM name -> image id (builds)
    pull_s: float = 0.0
    build_s: float = 0.0
    stand_in: bool = False  # the image is, or is built on, an offline stand-in base (sprout.sandbox.images)


def ensure_image(store: Store, environment_dir: Path, config: EnvironmentConfig, *, name: str,
                 rebuild_before: float | None = None, log_path: Path | None = None,
                 pull: PullPolicy | None = None) -> TaskImage:
    """The store image of a task (or of a separate verifier: `environment_dir` is then tests/).

    `pull`: the pull policy (default: pull_policy()). `rebuild_before`: a build tagged before this time
    (epoch seconds) is redone without layer cache (--no-build-cache, Harbor's force_build); later ones,
    e.g. by a concurrent worker, are reused."""
    started = time.monotonic()
    policy = pull_policy(pull)
    dockerfile = environment_dir / DOCKERFILE_NAME
    if should_use_prebuilt_docker_image(environment_dir, docker_image=config.docker_image,
                                        force_build=rebuild_before is not None):
        what = f"task {name}: its image ([environment].docker_image)"
        try:
            pulled = ensure_present(store, config.docker_image, policy, what=what)
        except PullError as e:
            if not dockerfile.is_file():
                raise
            warning = (f"the prebuilt image {config.docker_image!r} could not be pulled ({e.answer}); "
                       f"built {DOCKERFILE_NAME} instead")
            try:
                built = _build_image(store, environment_dir, config, name=name, policy=policy,
                                     log_path=log_path, rebuild_before=None)
            except TaskImageError as b:
                raise TaskImageError(f"task {name}: its image {config.docker_image!r} could not be pulled "
                                     f"({e.answer}), and building {DOCKERFILE_NAME} instead failed: "
                                     f"{str(b).removeprefix(f'task {name}: ')}") from None
            return replace(built, warning=warning, seconds=time.monotonic() - started)
        return TaskImage(store.import_image(config.docker_image), config.docker_image, False,
                         time.monotonic() - started, source="pulled" if pulled.pulled else "present",
                         pull_s=pulled.seconds if pulled.pulled else 0.0, stand_in=stand_in(config.docker_image))
    if not dockerfile.is_file():
        raise TaskImageError(f"task {name}: no {DOCKERFILE_NAME} in {environment_dir.name}/ to build")
    built = _build_image(store, environment_dir, config, name=name, policy=policy, log_path=log_path,
                         rebuild_before=rebuild_before)
    return replace(built, seconds=time.monotonic() - started)


def image_reference(environment_dir: Path, base_ids: dict[str, str]) -> str:
    """The tag of a Dockerfile build: the environment's content hash and its FROM images' ids."""
    text = environment_content_hash(environment_dir) + "".join(f"\n{k}={v}" for k, v in sorted(base_ids.items()))
    return f"{TAG_REPOSITORY}:{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def _build_image(store: Store, environment_dir: Path, config: EnvironmentConfig, *, name: str,
                 policy: PullPolicy, log_path: Path | None, rebuild_before: float | None) -> TaskImage:
    pull_started = time.monotonic()
    base_ids, pulled = {}, False
    for base in base_images(environment_dir / DOCKERFILE_NAME):
        if "$" in base:  # an unresolved ARG: left for the build to report
            continue
        present = ensure_present(store, base, policy, what=f"task {name}: the Dockerfile's base image (FROM)")
        base_ids[base], pulled = present.image_id, pulled or present.pulled
    pull_s = time.monotonic() - pull_started if pulled else 0.0
    reference = image_reference(environment_dir, base_ids)
    build_started = time.monotonic()
    built = False
    with _file_lock(store.root / "state" / "locks" / f"build-{reference.rpartition(':')[2]}"):
        created = _created(reference)
        if created is None or (rebuild_before is not None and created < rebuild_before):
            _build(environment_dir, reference, name=name, timeout=config.build_timeout_sec,
                   no_cache=rebuild_before is not None, log_path=log_path)
            built = True
    build_s = time.monotonic() - build_started if built else 0.0
    return TaskImage(store.import_image(reference), reference, built, 0.0, source="built" if built else "cached",
                     base_images=base_ids, pull_s=pull_s, build_s=build_s, stand_in=stand_in(reference))


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _created(reference: str) -> float | None:
    """When podman's image of that name was built (epoch seconds), or None if podman has none."""
    info = image_info(reference)
    return datetime.fromisoformat(info["Created"]).timestamp() if info else None


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
    cmd = [*podman_command(), "build", "--pull=never", *ulimit_flags(), *trust.build_flags(trust.host_trust()), "-t", tag,
           "-f", str(environment_dir / DOCKERFILE_NAME)]
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
            last += f"; {OFFLINE_HELP}"
        where = f" (build log: {log_path})" if log_path else ""
        raise TaskImageError(f"task {name}: podman build failed: {last}{where}")
