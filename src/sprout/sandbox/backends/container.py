"""The container backend: stock podman runs the sandbox's subvolume as its rootfs (`--rootfs --init`),
confined as podman confines any container. Commands run through the confined runtime (setns, fast) or
`podman exec`; a checkpoint freezes the container's processes (cgroup freezer) while the filesystem is
flushed and snapshotted. Its files are a host directory, reached by resolving every path inside it."""

import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from ... import rootless
from .. import btrfs, confinement, execution, podman, processes, rootfs, trust, users
from ..diff import Tree, host_trees
from ..errors import CommandError, SandboxStateError
from ..execution import ExecResult
from ..host_files import HostFiles
from . import Check, Smoke

if TYPE_CHECKING:
    from ..store import Checkpoint, Image, Sandbox, Store


class ContainerBackend:
    name = "container"
    summary = "podman containers"
    host_files = True
    smoke = Smoke()
    # what podman puts in the rootfs when the container starts (its mount points and init): part of every
    # sandbox, no command's work
    start_made = frozenset({"/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/etc/mtab", "/run/.containerenv",
                            "/run/podman-init", trust.CONTAINER_BUNDLE})

    def limits(self, limits: dict, *, network: bool | None, checkpoint: "Checkpoint | None") -> dict:
        return limits

    def make_subvolume(self, store: "Store", image: "Image", dest: Path) -> None:
        btrfs.snapshot(image.path, dest, readonly=False)

    def start(self, store: "Store", sandbox: "Sandbox", *, restart: bool = False) -> None:
        _check_regular_users(sandbox.path, "start a container on")
        if restart:
            podman.remove_container(sandbox.container)  # podman's record may be stale after a reboot
        config = sandbox.image.config
        host = trust.host_trust(sandbox.limits.get("host_trust"))
        spec = podman.ContainerSpec(
            name=sandbox.container, rootfs=str(sandbox.path),
            env=trust.container_env(host) | config.env | sandbox.limits.get("env", {}),
            workdir=config.workdir, user=config.user, memory=sandbox.limits.get("memory"),
            pids=sandbox.limits.get("pids"), cpus=sandbox.limits.get("cpus"),
            network=sandbox.limits.get("network", True), mounts=trust.container_mounts(host),
            labels=store.labels(sandbox.id))
        container_id = podman.run_container(spec)
        profile = confinement.capture(container_id)
        if spec.network and sandbox.limits.get("network_connected") is False:  # as it was switched last
            podman.set_network(sandbox.container, False)
        elif spec.network and not podman.connected(profile["init_pid"]):
            podman.reconnect(sandbox.container)
        sandbox.profile_path.parent.mkdir(parents=True, exist_ok=True)
        lock = sandbox.profile_path.parent / "freeze.lock"  # serializes freezes (processes.frozen)
        confinement.write(profile | {"freeze_lock": str(lock)}, sandbox.profile_path)

    def stop(self, sandbox: "Sandbox") -> None:
        podman.remove_container(sandbox.container)
        sandbox.profile_path.unlink(missing_ok=True)

    def file_trees(self, store: "Store", sources: "Sequence[Checkpoint | Image]") -> AbstractContextManager[list[Tree]]:
        """The subvolumes themselves (a checkpoint's is its rootfs, as an image's is)."""
        return host_trees([source.path for source in sources])

    def running(self, sandbox: "Sandbox") -> bool:
        return profile_of(sandbox) is not None

    def network_enabled(self, sandbox: "Sandbox") -> bool:
        profile = profile_of(sandbox)
        return profile is not None and podman.connected(profile["init_pid"])

    def set_network(self, sandbox: "Sandbox", enabled: bool) -> None:
        if self.network_enabled(sandbox) == enabled:
            return
        try:
            podman.set_network(sandbox.container, enabled)
        except CommandError as e:
            if self.network_enabled(sandbox) == enabled:  # another caller switched it meanwhile
                return
            if not enabled or "already connected" not in str(e):
                raise
            podman.reconnect(sandbox.container)  # podman's record outlived the interface

    def exec(self, sandbox: "Sandbox", argv: list[str], *, cwd: str, env: dict[str, str], user: str | int | None,
             timeout: float | None, max_output: int, cancel: threading.Event | None) -> ExecResult:
        """Through the store's runtime when it has one, else `podman exec`. Setting `cancel` kills every
        process the sandbox started since the command began, as its timeout would."""
        profile = _running_profile(sandbox)
        if cancel is not None and cancel.is_set():
            return ExecResult.cancelled_before_start()
        runtime_bin = sandbox.store.runtime_bin
        if runtime_bin is not None and profile["seccomp_unread"]:
            rootless.say_once("commands run through `podman exec`: sprout-runtime cannot load a seccomp "
                              "filter that it cannot read or reproduce exactly (one whose default is not ENOSYS)")
        elif runtime_bin is not None:
            identity = users.resolve(sandbox.path, user) if user is not None else None
            return execution.run_via_runtime(runtime_bin, sandbox.profile_path, profile, argv, cwd, env,
                                             identity, timeout, max_output, cancel)
        _check_regular_users(sandbox.path, "run a command through `podman exec` in")
        return execution.run_via_podman(sandbox.container, profile, argv, cwd,
                                        str(user) if user is not None else sandbox.image.config.user, env,
                                        timeout, max_output, cancel)

    def snapshot(self, sandbox: "Sandbox", dest: Path, *, memory: bool) -> None:
        if memory:
            raise SandboxStateError(f"sandbox {sandbox.id} is a container: only microVMs save their memory")
        profile = profile_of(sandbox)  # None: stopped, nothing runs that could write
        # Write back what is dirty while the sandbox still runs: the snapshot (inside the freeze) then
        # writes back only what came since, so after a big write the sandbox stands still for
        # milliseconds, not for the second its writeback takes.
        btrfs.flush(sandbox.path)
        with processes.frozen(profile) if profile else nullcontext(True) as ok:
            if not ok:
                raise SandboxStateError(f"cannot checkpoint {sandbox.id}: its processes did not freeze in time")
            btrfs.snapshot(sandbox.path, dest, readonly=True)

    @contextmanager
    def files(self, sandbox: "Sandbox") -> Iterator[HostFiles]:
        yield HostFiles(sandbox.path)

    def reap(self, store: "Store", sandbox_ids: set[str], dry_run: bool) -> list[str]:
        removed = []
        for name in podman.container_names(store.label_filter()):
            if name.removeprefix(store.container_prefix) not in sandbox_ids:
                removed.append(f"orphan container {name}")
                if not dry_run:
                    podman.remove_container(name)
        return removed

    def forget_image(self, store: "Store", image_key: str) -> None:
        pass

    def checks(self, store: "Store | None") -> list[Check]:
        return []


def profile_of(sandbox: "Sandbox") -> dict | None:
    """The running container's confinement profile (written when it started), None when it is not running."""
    try:
        profile = confinement.read(sandbox.profile_path)
        if confinement.proc_starttime(profile["init_pid"]) == profile["init_starttime"]:
            return profile
    except (OSError, ValueError, KeyError):
        pass
    return None


def _running_profile(sandbox: "Sandbox") -> dict:
    profile = profile_of(sandbox)
    if profile is None:
        raise SandboxStateError(f"sandbox {sandbox.id} is not running (start it: sprout sandbox start {sandbox.id})")
    return profile


def _check_regular_users(root: Path, doing: str) -> None:
    """runc reads the rootfs's /etc/passwd and /etc/group when a container starts or `podman exec` enters it:
    a FIFO there blocks it forever and a device is read without end, so that is refused with the reason
    (the compiled runtime resolves users itself, reading only regular files)."""
    for path in ("/etc/passwd", "/etc/group"):
        try:
            rootfs.check_regular(root, path)
        except rootfs.UnsafeFile as e:
            raise SandboxStateError(f"cannot {doing} {root.name}: {e}") from None
