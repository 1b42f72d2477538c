"""The sandbox store: images, sandboxes and checkpoints as btrfs subvolumes, run with stock podman
(the container backend) or as QEMU microVMs (the microvm backend: sprout/sandbox/microvm/backend.py).

Layout of a store (a btrfs filesystem, by default ~/sprout-btrfs, a loop file when the host has none):
    images/<key>        read-only subvolume: an image's unpacked rootfs
    sandboxes/<id>      writable snapshot of an image or a checkpoint, the rootfs of a container
                        (of a microVM: a subvolume holding its disk.img)
    checkpoints/<id>    read-only snapshot of a sandbox
    state/sprout.db     metadata (SQLite);  state/sandboxes/<id>/  exec profiles, a VM's sockets
    microvm/            the guest kit and the images' disk files
    cache/              bootstrap tarballs
"""

import fcntl
import json
import marshal
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field, fields
from pathlib import Path

from . import btrfs, confinement, execution, podman, rootfs, runtime, shell, trust, users
from .errors import (
    CheckpointNotFound,
    CommandError,
    ImageNotFound,
    InUseError,
    SandboxNotFound,
    SandboxStateError,
    StoreError,
)
from .execution import DEFAULT_MAX_OUTPUT, ExecResult
from .metadata import Metadata
from .microvm import backend as microvm
from .microvm.files import GuestFiles
from .microvm.vm import MicroVM
from .podman import ImageConfig

CONTAINER_PREFIX = "sprout-"
LABEL = "sprout.sandbox"
STORE_LABEL = "sprout.store"  # several stores may share one podman
DEFAULT_LIMITS = {"memory": "4g", "pids": 4096, "cpus": None, "network": True}
DEFAULT_SHELL = ("bash", "-c")
BACKENDS = ("container", "microvm")
BACKEND_HELP = ("the sandboxes: podman containers (default), or QEMU microVMs (each with its own kernel); "
                "a branch keeps its checkpoint's")


def default_root() -> Path:
    return Path(os.environ.get("SPROUT_STORE", Path.home() / "sprout-btrfs")).expanduser()


def default_runtime_bin() -> Path | None:
    value = os.environ.get("SPROUT_RUNTIME_BIN")
    return Path(value) if value else None


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


@dataclass
class Image:
    store: "Store" = field(repr=False)
    key: str
    image_id: str
    names: list[str]
    config: ImageConfig

    @property
    def path(self) -> Path:
        return self.store.root / "images" / self.key


@dataclass
class Checkpoint:
    store: "Store" = field(repr=False)
    id: str
    sandbox_id: str
    image_key: str
    parent: str | None
    label: str | None
    created: float
    duration_ms: float | None
    limits: dict = field(default_factory=lambda: dict(DEFAULT_LIMITS))  # of the sandbox it was taken of

    @property
    def path(self) -> Path:
        return self.store.root / "checkpoints" / self.id

    @property
    def rootfs(self) -> Path:
        """The checkpoint's files as a directory (a container's; a microVM's are inside its disk)."""
        return _rootfs_of(self.path, self.limits, f"checkpoint {self.id}")

    @property
    def exists(self) -> bool:
        return btrfs.is_subvolume(self.path)

    def branch(self, **limits) -> "Sandbox":
        """A new running sandbox whose filesystem is exactly this checkpoint's."""
        return self.store.create_sandbox(self.store.image(self.image_key), from_checkpoint=self, **limits)

    def delete(self, force: bool = False) -> None:
        self.store.remove_checkpoint(self.id, force=force)


@dataclass
class Sandbox:
    store: "Store" = field(repr=False)
    id: str
    image_key: str
    base_checkpoint: str | None
    last_checkpoint: str | None
    container: str
    limits: dict
    label: str | None
    created: float

    @property
    def path(self) -> Path:
        return self.store.root / "sandboxes" / self.id

    @property
    def rootfs(self) -> Path:
        """The sandbox's files as a directory (a container's; a microVM's are inside its disk)."""
        return _rootfs_of(self.path, self.limits, f"sandbox {self.id}")

    @property
    def profile_path(self) -> Path:
        return self.store.root / "state" / "sandboxes" / self.id / "profile.bin"

    @property
    def image(self) -> Image:
        return self.store.image(self.image_key)

    @property
    def backend(self) -> str:
        return self.limits.get("backend", "container")

    def _vm(self) -> MicroVM | None:
        return MicroVM.attach(self.profile_path.parent) if self.backend == "microvm" else None

    def _profile(self) -> dict | None:
        if self.backend == "microvm":
            return None
        try:
            profile = marshal.loads(self.profile_path.read_bytes())
            if confinement.proc_starttime(profile["init_pid"]) == profile["init_starttime"]:
                return profile
        except (OSError, ValueError, EOFError, KeyError):
            pass
        return None

    @property
    def running(self) -> bool:
        return (self._vm() if self.backend == "microvm" else self._profile()) is not None

    @property
    def state(self) -> str:
        return "running" if self.running else "stopped"

    @property
    def network_enabled(self) -> bool:
        """Whether the sandbox has a network interface besides loopback now (False while it is stopped)."""
        if self.backend == "microvm":  # QEMU runs in its holder's network namespace
            vm = self._vm()
            return vm is not None and bool(self.limits.get("network")) and podman.connected(vm.pid)
        profile = self._profile()
        return profile is not None and podman.connected(profile["init_pid"])

    def set_network(self, enabled: bool) -> None:
        """Connects the running sandbox to podman's network, or disconnects it (only loopback is left;
        a microVM's link goes down with its way out); commands, running ones too, see the change at
        once. Asking for what already is, is a no-op.
        Remembered in the sandbox's limits (`network_connected`), which its checkpoints keep: a restart
        and a branch come back as it was last switched (an agent phase without network stays so)."""
        if enabled and not self.limits.get("network", True):
            raise SandboxStateError(f"sandbox {self.id} was created without network (network=False); "
                                    "it cannot be connected")
        if not self.running:
            raise SandboxStateError(f"sandbox {self.id} is not running, so its network cannot be switched")
        if self.backend == "microvm":
            if self.limits.get("network") and (vm := self._vm()) is not None:
                microvm.set_network(vm, self.container, enabled)
        elif self.network_enabled != enabled:
            try:
                podman.set_network(self.container, enabled)
            except CommandError:
                if self.network_enabled != enabled:  # unless another caller switched it meanwhile
                    raise
        if self.limits.get("network_connected", True) != enabled:
            self.limits["network_connected"] = enabled
            self.store.meta.execute("UPDATE sandboxes SET limits = ? WHERE id = ?", json.dumps(self.limits), self.id)

    def exec(self, command: str | list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
             timeout: float | None = None, user: str | int | None = None,
             max_output: int = DEFAULT_MAX_OUTPUT, cancel: threading.Event | None = None) -> ExecResult:
        """Runs a command (a string goes to `bash -c`) in a fresh process inside the sandbox, as the
        image's user unless `user` (a name or uid, optionally `:group`) says otherwise. In a microVM,
        setting `cancel` kills what it started, as its timeout would (a container's processes are
        killed from the host instead: kill_processes_since)."""
        profile, vm = self._profile(), self._vm()
        if profile is None and vm is None:
            raise SandboxStateError(f"sandbox {self.id} is not running (start it: "
                                    f"python -m sprout.sandbox start {self.id})")
        argv = [*DEFAULT_SHELL, command] if isinstance(command, str) else list(command)
        config = self.image.config
        cwd = cwd or config.workdir or "/"
        env = dict(env or {})
        if vm is not None:
            return vm.exec(argv, cwd=cwd, env=config.env | self.limits.get("env", {}) | env,
                           user=str(user if user is not None else config.user or "0"), timeout=timeout,
                           max_output=max_output, cancel=cancel)
        if self.store.runtime_bin is not None:
            identity = users.resolve(self.path, user) if user is not None else None
            return execution.run_via_runtime(self.store.runtime_bin, self.profile_path, argv, cwd, env,
                                             timeout, max_output, identity)
        return execution.run_via_podman(self.container, profile, argv, cwd,
                                        str(user) if user is not None else config.user, env, timeout, max_output)

    @contextmanager
    def guest_files(self) -> Iterator[GuestFiles]:
        """A running microVM's files, through its agent, for one transfer (a container's are at rootfs)."""
        if self.backend != "microvm":
            raise SandboxStateError(f"sandbox {self.id} is a container: its files are at its rootfs")
        vm = self._vm()
        if vm is None:
            raise SandboxStateError(f"sandbox {self.id} is not running, so its files cannot be reached")
        with vm.files() as files:
            yield files

    def processes(self) -> set[tuple[int, int]]:
        """(pid, start time) of the processes running in the sandbox now."""
        self._refuse_for_vm("listing its processes from the host")
        profile = self._profile()
        return runtime.processes(profile["cgroup_procs"]) if profile else set()

    def kill_processes_since(self, before: set[tuple[int, int]]) -> int:
        """SIGKILLs every process the sandbox started since `before` was taken (see processes())."""
        self._refuse_for_vm("killing its processes from the host")
        profile = self._profile()
        return runtime.kill_new_processes(profile, before) if profile else 0

    def _refuse_for_vm(self, what: str) -> None:
        if self.backend == "microvm":
            raise SandboxStateError(f"sandbox {self.id} is a microVM: {what} is not supported (a command's "
                                    "timeout kills what it started inside the VM)")

    def checkpoint(self, label: str | None = None, *, memory: bool = False) -> Checkpoint:
        """A point-in-time, read-only snapshot of the sandbox's filesystem: its processes are frozen
        (cgroup freezer; a microVM's filesystem is frozen by its kernel) while the filesystem is
        flushed and snapshotted, so no write lands half-way. `memory` (microVMs only) saves the VM's
        memory too: its branches resume the processes it was running."""
        if memory and self.backend != "microvm":
            raise SandboxStateError(f"sandbox {self.id} is a container: only microVMs save their memory")
        checkpoint_id = _new_id("ck")
        with self.store.building():
            started = time.perf_counter()
            dest = self.store.root / "checkpoints" / checkpoint_id
            if self.backend == "microvm":
                microvm.snapshot(self._vm(), self.path, dest, memory=memory)
            else:
                self._snapshot_frozen(dest)
            duration_ms = (time.perf_counter() - started) * 1000
            parent = self.last_checkpoint or self.base_checkpoint
            created = time.time()
            self.store.meta.put_checkpoint(checkpoint_id, self.id, self.image_key, parent, label, created,
                                           duration_ms, self.limits)
        self.last_checkpoint = checkpoint_id
        return Checkpoint(self.store, checkpoint_id, self.id, self.image_key, parent, label, created,
                          duration_ms, dict(self.limits))

    def _snapshot_frozen(self, dest: Path) -> None:
        profile = self._profile()  # None: stopped, nothing runs that could write
        with runtime.frozen(profile) if profile else nullcontext(True) as ok:
            if not ok:
                raise SandboxStateError(f"cannot checkpoint {self.id}: its processes did not freeze in time")
            btrfs.flush(self.path)
            btrfs.snapshot(self.path, dest, readonly=True)

    def start(self) -> None:
        """(Re)starts the sandbox's container on its subvolume, e.g. after a host restart."""
        if self.running:
            return
        if self.backend == "microvm":  # its disk boots; the memory of a resumed branch is gone
            self.store._start_vm(self)
            return
        podman.remove_container(self.container)  # podman's record may be stale after a reboot
        self.store._start_container(self)

    def stop(self) -> None:
        if self.backend == "microvm":
            microvm.stop(self._vm(), self.container if self.limits.get("network") else None)
            return
        podman.remove_container(self.container)
        self.profile_path.unlink(missing_ok=True)

    def destroy(self) -> None:
        """Stops the container and deletes the sandbox's subvolume; leaves nothing mounted or running."""
        self.store.remove_sandbox(self.id, force=True)


class Store:
    """`owner`: who the sandboxes made through this Store belong to (e.g. a worker's job and lease). They
    and their checkpoints carry it, with this process, until `adopt` takes the checkpoints over; when the
    process is gone, gc (and a worker's start) reaps what it left. Without an owner, nothing is reaped."""

    def __init__(self, root: Path | None = None, runtime_bin: Path | None = None, owner: dict | None = None,
                 backend: str = "container"):
        if backend not in BACKENDS:
            raise StoreError(f"unknown backend {backend!r}: use {' or '.join(BACKENDS)}")
        self.backend = backend  # of the sandboxes made from images; a branch keeps its checkpoint's
        self.root = Path(root or default_root()).expanduser().absolute()
        self.runtime_bin = runtime_bin if runtime_bin is not None else default_runtime_bin()
        self.owner = None if owner is None else {**owner, "host": socket.gethostname(), "pid": os.getpid(),
                                                 "start": confinement.proc_starttime(os.getpid())}
        ensure_mounted(self.root)
        for sub in ("images", "sandboxes", "checkpoints", "state/sandboxes", "state/locks", "cache"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.meta = Metadata(self.root / "state" / "sprout.db")

    # ---------------------------------------------------------------- images
    @contextmanager
    def _lock(self, name: str, shared: bool = False) -> Iterator[None]:
        with open(self.root / "state" / "locks" / name, "a") as f:
            fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield

    def building(self) -> AbstractContextManager[None]:
        """Held (shared, across processes) while subvolumes are made whose rows come later; gc waits for
        every holder, so it never takes something half-made for an orphan."""
        return self._lock("store", shared=True)

    def import_image(self, reference: str) -> Image:
        """Unpacks a podman image into a read-only subvolume, once per image id (cached).

        An image whose first layers are those of an image in the store starts as a snapshot of that one,
        and only the files that differ are written: task images built on one base share its files on
        disk instead of each holding a copy."""
        config = podman.inspect_image(reference)
        key = f"im-{config.image_id.removeprefix('sha256:')[:12]}"
        with self._lock(key), self.building():
            path = self.root / "images" / key
            if btrfs.is_subvolume(path) and self.meta.one("SELECT 1 FROM images WHERE key = ?", key):
                names = sorted(set(self.image(key).names) | set(config.names))
                self.meta.execute("UPDATE images SET names = ? WHERE key = ?", json.dumps(names), key)
                return self.image(key)
            partial = self.root / "images" / f".partial-{key}"
            btrfs.delete(partial)
            layers = podman.image_layers(config.image_id)
            try:
                self._begin_image(partial, layers)
                _copy_image(reference, config.image_id, partial)
                _create_workdir(partial, config.workdir, reference)
                btrfs.set_readonly(partial)
                btrfs.delete(path)
                partial.rename(path)
            except BaseException:
                btrfs.delete(partial)
                raise
            self.meta.put_image(key, config.image_id, config.names, config.__dict__, layers)
        return self.image(key)

    def _begin_image(self, partial: Path, layers: list[str]) -> None:
        """Makes the subvolume `partial`: a snapshot of the store image closest to `layers` (its hard links
        separated), or an empty one."""
        if (base := self._closest_image(layers)) is not None:
            with suppress(CommandError):  # removed meanwhile: then the image is copied whole
                btrfs.snapshot(base, partial, readonly=False)
        if partial.exists():
            _separate_hard_links(partial)
        else:
            btrfs.create(partial)

    def _closest_image(self, layers: list[str]) -> Path | None:
        """The subvolume of the store image that shares the longest run of first layers with `layers`."""
        best, shared = None, 0
        for row in self.meta.all("SELECT key, image_id, layers FROM images"):
            known = row["layers"]
            if known is None:  # recorded before layers were, or shipped: asked of podman, once
                known = json.dumps(podman.image_layers(row["image_id"]))
                self.meta.execute("UPDATE images SET layers = ? WHERE key = ?", known, row["key"])
            common = _shared_prefix(json.loads(known), layers)
            if common > shared and btrfs.is_subvolume(path := self.root / "images" / row["key"]):
                best, shared = path, common
        return best

    def image(self, name: str) -> Image:
        """An image by store key (im-...), podman name or image id."""
        row = self.meta.one("SELECT * FROM images WHERE key = ? OR image_id = ?", name, name)
        if row is None:
            for candidate in self.meta.all("SELECT * FROM images"):
                if name in json.loads(candidate["names"]) or _short_name_match(name, candidate["names"]):
                    row = candidate
                    break
        if row is None:
            raise ImageNotFound(f"no image {name!r} in the store (import it: python -m sprout.sandbox "
                                f"images import {name})")
        return Image(self, row["key"], row["image_id"], json.loads(row["names"]),
                     _image_config(json.loads(row["config"])))

    def remove_image(self, key: str) -> None:
        """Deletes an image's subvolume and record; refused while a sandbox or checkpoint uses it."""
        image = self.image(key)
        row = self.meta.one("SELECT (SELECT COUNT(*) FROM sandboxes WHERE image_key = ?) + "
                            "(SELECT COUNT(*) FROM checkpoints WHERE image_key = ?) AS n", image.key, image.key)
        if row["n"]:
            raise InUseError(f"image {image.key} is used by {row['n']} sandbox(es)/checkpoint(s)")
        btrfs.delete(image.path)
        microvm.remove_image_disk(self.root, image.key)
        self.meta.execute("DELETE FROM images WHERE key = ?", image.key)

    def images(self) -> list[Image]:
        return [self.image(row["key"]) for row in self.meta.all("SELECT key FROM images ORDER BY created")]

    def resolve_image(self, name: str) -> Image:
        """The store's image for `name`, importing it from podman when the store lacks it."""
        try:
            return self.image(name)
        except ImageNotFound:
            return self.import_image(name)

    # ---------------------------------------------------------------- sandboxes
    def create_sandbox(self, image: Image | str, *, memory: str | None = None, pids: int | None = None,
                       cpus: float | None = None, network: bool | None = None, label: str | None = None,
                       from_checkpoint: Checkpoint | None = None, host_trust: bool | None = None,
                       env: dict[str, str] | None = None, backend: str | None = None) -> Sandbox:
        """A writable snapshot of the image (or of a checkpoint), started as a podman container or, with
        the microvm backend (`backend`, else the store's; a branch keeps its checkpoint's), booted as a
        VM. Unset limits come from the checkpoint's sandbox, else the defaults; `host_trust` (the host's
        CA bundle and proxy variables, sprout/sandbox/trust.py) defaults to SPROUT_HOST_TRUST; `env` is
        set in the container over the image's (a task's [environment.env]), kept by branches."""
        if isinstance(image, str):
            image = self.resolve_image(image)
        inherited = from_checkpoint.limits if from_checkpoint else DEFAULT_LIMITS
        kind = _backend_of(from_checkpoint, backend or self.backend)
        asked = {"memory": memory, "pids": pids, "cpus": cpus, "network": network, "host_trust": host_trust,
                 "env": env or None}
        limits = inherited | {k: v for k, v in asked.items() if v is not None}
        limits.setdefault("host_trust", trust.enabled_by_config())
        if network is not None:  # asked for explicitly: not as the checkpoint's sandbox was last switched
            limits.pop("network_connected", None)
        if kind == "microvm":  # no network unless asked for (or its checkpoint's sandbox had it)
            limits |= {"backend": "microvm", "network": bool(network if network is not None else
                                                             from_checkpoint and inherited.get("network"))}
            if from_checkpoint and microvm.has_memory(from_checkpoint.path):
                microvm.check_resumable(from_checkpoint.limits, limits)
        sandbox_id = _new_id("sb")
        source = from_checkpoint.path if from_checkpoint else image.path
        if not btrfs.is_subvolume(source):
            what = f"checkpoint {from_checkpoint.id}" if from_checkpoint else f"image {image.key}"
            raise StoreError(f"the subvolume of {what} is missing from the store at {source}")
        sandbox = Sandbox(self, sandbox_id, image.key, from_checkpoint.id if from_checkpoint else None, None,
                          CONTAINER_PREFIX + sandbox_id, limits, label, time.time())
        with self.building():
            if kind == "microvm" and from_checkpoint is None:
                microvm.create_subvolume(self.root, image.key, image.path, sandbox.path)
            else:
                btrfs.snapshot(source, sandbox.path, readonly=False)
            try:
                self._start_vm(sandbox) if kind == "microvm" else self._start_container(sandbox)
            except BaseException:
                sandbox.stop()
                btrfs.delete(sandbox.path)
                shell.run(["rm", "-rf", str(sandbox.profile_path.parent)], check=False)
                raise
            self.meta.put_sandbox(sandbox_id, image.key, sandbox.base_checkpoint, sandbox.container, limits, label,
                                  self.owner)
        return sandbox

    def _start_container(self, sandbox: Sandbox) -> None:
        _check_startable(sandbox.path)
        config = self.image(sandbox.image_key).config
        host = trust.host_trust(sandbox.limits.get("host_trust"))
        spec = podman.ContainerSpec(
            name=sandbox.container, rootfs=str(sandbox.path),
            env=trust.container_env(host) | config.env | sandbox.limits.get("env", {}),
            workdir=config.workdir, user=config.user, memory=sandbox.limits.get("memory"),
            pids=sandbox.limits.get("pids"), cpus=sandbox.limits.get("cpus"),
            network=sandbox.limits.get("network", True), mounts=trust.container_mounts(host),
            labels={LABEL: sandbox.id, STORE_LABEL: str(self.root)})
        container_id = podman.run_container(spec)
        if spec.network and sandbox.limits.get("network_connected") is False:  # as it was switched last
            podman.set_network(sandbox.container, False)
        sandbox.profile_path.parent.mkdir(parents=True, exist_ok=True)
        lock = sandbox.profile_path.parent / "freeze.lock"  # serializes freezes (runtime.frozen)
        confinement.write(confinement.capture(container_id) | {"freeze_lock": str(lock)}, sandbox.profile_path)

    def _start_vm(self, sandbox: Sandbox) -> None:
        microvm.start(self.root, sandbox.path, sandbox.profile_path.parent, sandbox.limits, sandbox.id,
                      holder=sandbox.container, labels={LABEL: sandbox.id, STORE_LABEL: str(self.root)},
                      trust=trust.host_trust(sandbox.limits.get("host_trust")))

    def sandbox(self, sandbox_id: str) -> Sandbox:
        row = self.meta.one("SELECT * FROM sandboxes WHERE id = ?", sandbox_id)
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} in the store at {self.root}")
        return Sandbox(self, row["id"], row["image_key"], row["base_checkpoint"], row["last_checkpoint"],
                       row["container"], json.loads(row["limits"]), row["label"], row["created"])

    def sandboxes(self) -> list[Sandbox]:
        return [self.sandbox(row["id"]) for row in self.meta.all("SELECT id FROM sandboxes ORDER BY created")]

    def remove_sandbox(self, sandbox_id: str, force: bool = False) -> None:
        """Deletes a sandbox. A running one is refused unless forced (then it is stopped first):
        deleting the subvolume under a running container breaks it silently."""
        sandbox = self.sandbox(sandbox_id)
        if sandbox.running and not force:
            raise SandboxStateError(f"sandbox {sandbox_id} is running; stop it first or force the removal")
        sandbox.stop()
        btrfs.delete(sandbox.path)
        shell.run(["rm", "-rf", str(sandbox.profile_path.parent)], check=False)
        self.meta.execute("DELETE FROM sandboxes WHERE id = ?", sandbox_id)

    # ---------------------------------------------------------------- checkpoints
    def checkpoint(self, checkpoint_id: str) -> Checkpoint:
        row = self.meta.one("SELECT * FROM checkpoints WHERE id = ?", checkpoint_id)
        if row is None:
            raise CheckpointNotFound(f"no checkpoint {checkpoint_id!r} in the store at {self.root}")
        return Checkpoint(self, row["id"], row["sandbox_id"], row["image_key"], row["parent"], row["label"],
                          row["created"], row["duration_ms"],
                          json.loads(row["limits"]) if row["limits"] else dict(DEFAULT_LIMITS))

    def checkpoints(self, sandbox_id: str | None = None) -> list[Checkpoint]:
        sql = "SELECT id FROM checkpoints" + (" WHERE sandbox_id = ?" if sandbox_id else "") + " ORDER BY created"
        return [self.checkpoint(row["id"]) for row in self.meta.all(sql, *([sandbox_id] if sandbox_id else []))]

    def branches_of(self, checkpoint_id: str) -> list[Sandbox]:
        rows = self.meta.all("SELECT id FROM sandboxes WHERE base_checkpoint = ?", checkpoint_id)
        return [self.sandbox(row["id"]) for row in rows]

    def remove_checkpoint(self, checkpoint_id: str, force: bool = False) -> None:
        checkpoint = self.checkpoint(checkpoint_id)
        branches = self.branches_of(checkpoint_id)
        if branches and not force:
            raise InUseError(f"checkpoint {checkpoint_id} has {len(branches)} live branch(es) "
                             f"({', '.join(b.id for b in branches)}); force to delete it anyway")
        btrfs.delete(checkpoint.path)
        self.meta.execute("DELETE FROM checkpoints WHERE id = ?", checkpoint_id)

    def size_of(self, checkpoint: Checkpoint) -> int | None:
        """Bytes held only by this checkpoint (on demand: btrfs quotas stay off for fast snapshots)."""
        return btrfs.disk_usage([checkpoint.path]) if checkpoint.exists else None

    # ---------------------------------------------------------------- maintenance
    def adopt(self, checkpoint_ids: list[str]) -> None:
        """Takes checkpoints out of their owner's hands: a finished attempt's checkpoints outlive it."""
        with self.meta.transaction() as db:
            db.executemany("UPDATE checkpoints SET owner = NULL WHERE id = ?", [(c,) for c in checkpoint_ids])

    def gc(self, older_than_s: float | None = None, dry_run: bool = False) -> list[str]:
        """Removes what no one references; returns what it removed (or would remove).

        Always: sandboxes and checkpoints whose owner process on this host is gone (a killed worker's),
        subvolumes without a metadata row (left by a crash), rows whose subvolume is gone, and containers
        of sandboxes that no longer exist. With `older_than_s`: checkpoints older than that with no live
        branch and no child checkpoint, and images no sandbox or checkpoint uses and podman no longer has.
        It holds the store's lock, so nothing being made meanwhile is taken for an orphan."""
        with self._lock("store"):
            removed = self._reap(dry_run) + self._reconcile(dry_run)
            if older_than_s is not None:
                removed += self._collect_old(time.time() - older_than_s, dry_run)
        return removed

    def reap(self, dry_run: bool = False) -> list[str]:
        """Removes the sandboxes and checkpoints whose owner process on this host is gone."""
        with self._lock("store"):
            return self._reap(dry_run)

    def _reap(self, dry_run: bool) -> list[str]:
        removed = []
        for table, kind in (("sandboxes", "sandbox"), ("checkpoints", "checkpoint")):
            for row in self.meta.all(f"SELECT id, owner FROM {table} WHERE owner IS NOT NULL ORDER BY created DESC"):
                owner = json.loads(row["owner"])
                if _owner_alive(owner):
                    continue
                removed.append(f"{kind} {row['id']} of dead owner {_describe_owner(owner)}")
                if not dry_run:
                    if kind == "sandbox":
                        self.remove_sandbox(row["id"], force=True)
                    else:
                        self.remove_checkpoint(row["id"], force=True)
        return removed

    def _reconcile(self, dry_run: bool) -> list[str]:
        """Orphan subvolumes and containers, and rows whose subvolume is gone."""
        removed: list[str] = []
        known = {
            "sandboxes": {row["id"] for row in self.meta.all("SELECT id FROM sandboxes")},
            "checkpoints": {row["id"] for row in self.meta.all("SELECT id FROM checkpoints")},
            "images": {row["key"] for row in self.meta.all("SELECT key FROM images")},
        }
        for run_dir in sorted((self.root / "state" / "sandboxes").iterdir()):
            if run_dir.name not in known["sandboxes"] and (vm := MicroVM.attach(run_dir)) is not None:
                removed.append(f"orphan microVM of {run_dir.name}")
                if not dry_run:
                    vm.kill()
        for kind, ids in known.items():
            singular = kind.removesuffix("es") if kind == "sandboxes" else kind[:-1]
            for path in sorted((self.root / kind).iterdir()):
                if path.name not in ids and btrfs.is_subvolume(path):
                    removed.append(f"orphan {singular} subvolume {path.name}")
                    if not dry_run:
                        btrfs.delete(path)
            for name in sorted(ids):
                if not btrfs.is_subvolume(self.root / kind / name):
                    removed.append(f"{singular} {name} whose subvolume is gone")
                    if not dry_run:
                        self._forget(kind, name)
        for name in podman.container_names(f"{STORE_LABEL}={self.root}"):
            if name.removeprefix(CONTAINER_PREFIX) not in known["sandboxes"]:
                removed.append(f"orphan container {name}")
                if not dry_run:
                    podman.remove_container(name)
        return removed

    def _forget(self, kind: str, name: str) -> None:
        if kind == "sandboxes":
            self.sandbox(name).stop()
            shell.run(["rm", "-rf", str(self.root / "state" / "sandboxes" / name)], check=False)
        self.meta.execute(f"DELETE FROM {kind} WHERE {'key' if kind == 'images' else 'id'} = ?", name)

    def _collect_old(self, cutoff: float, dry_run: bool) -> list[str]:
        removed = []
        referenced = {row["parent"] for row in self.meta.all("SELECT parent FROM checkpoints")}
        referenced |= {row["base_checkpoint"] for row in self.meta.all("SELECT base_checkpoint FROM sandboxes")}
        for checkpoint in self.checkpoints():
            if checkpoint.created < cutoff and checkpoint.id not in referenced:
                removed.append(f"checkpoint {checkpoint.id}")
                if not dry_run:
                    self.remove_checkpoint(checkpoint.id)
        used = {row["image_key"] for row in self.meta.all(
            "SELECT image_key FROM sandboxes UNION SELECT image_key FROM checkpoints")}
        podman_ids = {i.removeprefix("sha256:") for i in podman_image_ids()}
        for image in self.images():
            if image.key not in used and image.image_id.removeprefix("sha256:") not in podman_ids:
                removed.append(f"image {image.key}")
                if not dry_run:
                    self.remove_image(image.key)
        return removed


def _rootfs_of(path: Path, limits: dict, what: str) -> Path:
    if limits.get("backend") == "microvm":
        raise SandboxStateError(f"{what} is a microVM: its files are inside its disk, and reading or "
                                "writing them from the host (task files, grading) is not supported yet")
    return path


def _backend_of(checkpoint: Checkpoint | None, asked: str) -> str:
    """The backend of a new sandbox: a branch's is its checkpoint's, whatever the store's default."""
    if asked not in BACKENDS:
        raise StoreError(f"unknown backend {asked!r}: use {' or '.join(BACKENDS)}")
    if checkpoint is None:
        return asked
    return checkpoint.limits.get("backend", "container")


def _owner_alive(owner: dict) -> bool:
    """Whether the owner's process still runs (an owner on another host is assumed to)."""
    if owner.get("host") != socket.gethostname():
        return True
    try:
        return confinement.proc_starttime(int(owner["pid"])) == owner.get("start")
    except (OSError, ValueError, KeyError, IndexError):
        return False


def _describe_owner(owner: dict) -> str:
    return ", ".join(f"{key} {owner[key]}" for key in ("worker", "job", "pid") if owner.get(key) is not None)


def podman_image_ids() -> set[str]:
    return set(podman.podman("images", "-q", "--no-trunc").split())


def _check_startable(root: Path) -> None:
    """runc reads the rootfs's /etc/passwd and /etc/group when a container starts: a FIFO there blocks the
    start forever and a device is read without end, so such a rootfs is refused with the reason."""
    for path in ("/etc/passwd", "/etc/group"):
        try:
            rootfs.check_regular(root, path)
        except rootfs.UnsafeFile as e:
            raise SandboxStateError(f"cannot start a container on {root.name}: {e}") from None


def _short_name_match(name: str, names_json: str) -> bool:
    """`python:3.11-slim` matches `docker.io/library/python:3.11-slim`, as podman resolves it."""
    for full in json.loads(names_json):
        if full.endswith("/" + name) or full == f"localhost/{name}":
            return True
    return False


def _create_workdir(root: Path, workdir: str, reference: str) -> None:
    """Creates the image's WORKDIR when its rootfs lacks it, as podman and docker do when a container
    starts: buildah only records it in the config, and `podman run --rootfs` refuses a missing one."""
    try:
        rootfs.makedirs_in_root(root, workdir)
    except (NotADirectoryError, FileExistsError):
        raise StoreError(f"image {reference}: its WORKDIR {workdir} exists but is not a directory") from None


def _image_config(stored: dict) -> ImageConfig:
    """An image row's config, without keys this version does not know (another version's rows)."""
    return ImageConfig(**{f.name: stored[f.name] for f in fields(ImageConfig) if f.name in stored})


def _shared_prefix(a: list[str], b: list[str]) -> int:
    """How many first items `a` and `b` have in common."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _separate_hard_links(root: Path) -> None:
    """Gives each name of a hard-linked file its own inode, a reflink copy (no data written). rsync sets
    metadata in place, which would set it for every name of a link that a layer broke (a chmod of one
    name); --hard-links then links again what the image links."""
    found = shell.run(["find", str(root), "-xdev", "-type", "f", "-links", "+1", "-print0"],
                      what="finding hard links").stdout
    for name in filter(None, found.split(b"\0")):
        path = Path(os.fsdecode(name))
        copy = path.with_name(f".sprout-{secrets.token_hex(4)}")
        btrfs.clone_file(path, copy)
        copy.replace(path)


def _copy_image(reference: str, image_id: str, dest: Path) -> None:
    """Makes `dest` hold exactly the filesystem of podman's image `image_id` (`reference`'s). Files `dest`
    already holds alike (content, metadata) are left as they are, so a snapshot of a related image keeps
    sharing them."""
    mountpoint = podman.podman("image", "mount", image_id, what=f"podman image mount {reference}")
    try:
        # --checksum: a file a layer rewrote may keep its size and mtime; --modify-window=-1: times to the
        # nanosecond (rsync otherwise leaves a new file's own time when it is in the source's second)
        proc = shell.run(["rsync", "--archive", "--hard-links", "--acls", "--xattrs", "--numeric-ids",
                          "--checksum", "--modify-window=-1", "--delete", f"{mountpoint}/", f"{dest}/"],
                         check=False)
    finally:
        shell.run([*podman.PODMAN, "image", "unmount", image_id], check=False)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.decode(errors="replace").splitlines() if line.strip()]
        raise StoreError(f"copying {reference} into the store failed: {'; '.join(errors[:3])}")


def ensure_mounted(root: Path) -> None:
    """Mounts the store's loop file again if the machine rebooted; fails clearly when there is no store."""
    if not root.exists() and btrfs.is_btrfs(_existing_ancestor(root)):
        root.mkdir(parents=True)
    if btrfs.is_btrfs(root):
        return
    image = Path(os.environ.get("SPROUT_STORE_IMAGE", f"{root}.img"))
    if not image.exists():
        raise StoreError(f"no btrfs store at {root} (and no loop file {image}); run ops/setup_podman.sh "
                         "or set SPROUT_STORE to a btrfs directory")
    if os.geteuid() != 0:
        raise StoreError(f"the store {root} is not mounted and only root can mount {image}")
    root.mkdir(parents=True, exist_ok=True)
    shell.run(["mount", "-o", "loop,noatime", str(image), str(root)], what=f"mounting {image}")
    if not btrfs.is_btrfs(root):
        raise StoreError(f"{image} is mounted at {root} but is not btrfs")


def _existing_ancestor(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path
