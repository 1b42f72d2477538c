"""The sandbox store: images, sandboxes and checkpoints as btrfs subvolumes, each sandbox run by its
backend (sprout.sandbox.backends: a podman container, or a QEMU microVM).

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
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, field, fields
from pathlib import Path

from .. import rootless
from ..settings import settings
from . import backends, btrfs, confinement, podman, rootfs, shell, trust
from .diff import CheckpointDiff, diff_trees
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
from .files import SandboxFiles
from .metadata import Metadata
from .podman import ImageConfig

CONTAINER_PREFIX = "sprout-"
LABEL = "sprout.sandbox"
STORE_LABEL = "sprout.store"  # several stores may share one podman
DEFAULT_LIMITS = {"memory": "4g", "pids": 4096, "cpus": None, "network": True}
DEFAULT_SHELL = ("bash", "-c")


def default_root() -> Path:
    return settings().store_path()


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
    def has_host_files(self) -> bool:
        """Whether its files are a host directory (`rootfs`); a microVM's are inside its disk."""
        return backends.of_limits(self.limits).host_files

    @property
    def exists(self) -> bool:
        return btrfs.is_subvolume(self.path)

    def branch(self, **limits) -> "Sandbox":
        """A new running sandbox whose filesystem is exactly this checkpoint's."""
        return self.store.create_sandbox(self.store.image(self.image_key), from_checkpoint=self, **limits)

    def delete(self, force: bool = False) -> None:
        self.store.remove_checkpoint(self.id, force=force)

    def diff(self, target: "Checkpoint", *, content: bool = True) -> CheckpointDiff:
        """What changed on disk from this checkpoint to `target`, a later one of its lineage (Store.diff)."""
        return self.store.diff(self.id, target.id, content=content)


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
        """The name of the backend that runs it (sprout.sandbox.backends)."""
        return self._backend.name

    @property
    def _backend(self) -> backends.SandboxBackend:
        return backends.of_limits(self.limits)

    @property
    def running(self) -> bool:
        return self._backend.running(self)

    @property
    def state(self) -> str:
        return "running" if self.running else "stopped"

    @property
    def network_enabled(self) -> bool:
        """Whether the sandbox has a network interface besides loopback now (False while it is stopped)."""
        return self._backend.network_enabled(self)

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
        self._backend.set_network(self, enabled)
        if self.limits.get("network_connected", True) != enabled:
            self.limits["network_connected"] = enabled
            self.store.meta.execute("UPDATE sandboxes SET limits = ? WHERE id = ?", json.dumps(self.limits), self.id)

    def exec(self, command: str | list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
             timeout: float | None = None, user: str | int | None = None,
             max_output: int = DEFAULT_MAX_OUTPUT, cancel: threading.Event | None = None) -> ExecResult:
        """Runs a command (a string goes to `bash -c`) in a fresh process inside the sandbox, as the
        image's user unless `user` (a name or uid, optionally `:group`) says otherwise. Setting `cancel`
        kills every process the command started, as its timeout would."""
        argv = [*DEFAULT_SHELL, command] if isinstance(command, str) else list(command)
        return self._backend.exec(self, argv, cwd=cwd or self.image.config.workdir or "/", env=dict(env or {}),
                                  user=user, timeout=timeout, max_output=max_output, cancel=cancel)

    def files(self) -> AbstractContextManager[SandboxFiles]:
        """The running sandbox's files, for one transfer (sprout.sandbox.files): copy in and out as
        `docker cp` does, every path resolved inside the sandbox."""
        if not self.running:
            raise SandboxStateError(f"sandbox {self.id} is not running, so its files cannot be reached")
        return self._backend.files(self)

    def checkpoint(self, label: str | None = None, *, memory: bool = False) -> Checkpoint:
        """A point-in-time, read-only snapshot of the sandbox's filesystem: its processes are frozen
        (cgroup freezer; a microVM's filesystem is frozen by its kernel) while the filesystem is
        flushed and snapshotted, so no write lands half-way. `memory` (microVMs only) saves the VM's
        memory too: its branches resume the processes it was running."""
        checkpoint_id = _new_id("ck")
        with self.store.building():
            started = time.perf_counter()
            self._backend.snapshot(self, self.store.root / "checkpoints" / checkpoint_id, memory=memory)
            duration_ms = (time.perf_counter() - started) * 1000
            parent = self.last_checkpoint or self.base_checkpoint
            created = time.time()
            self.store.meta.put_checkpoint(checkpoint_id, self.id, self.image_key, parent, label, created,
                                           duration_ms, self.limits)
        self.last_checkpoint = checkpoint_id
        return Checkpoint(self.store, checkpoint_id, self.id, self.image_key, parent, label, created,
                          duration_ms, dict(self.limits))

    def start(self) -> None:
        """(Re)starts the sandbox on its subvolume, e.g. after a host restart (a microVM boots its disk:
        the memory of a resumed branch is gone)."""
        if not self.running:
            self._backend.start(self.store, self, restart=True)

    def stop(self) -> None:
        self._backend.stop(self)

    def destroy(self) -> None:
        """Stops the sandbox and deletes its subvolume; leaves nothing mounted or running."""
        self.store.remove_sandbox(self.id, force=True)


class Store:
    """`owner`: who the sandboxes made through this Store belong to (e.g. a worker's job and lease). They
    and their checkpoints carry it, with this process, until `adopt` takes the checkpoints over; when the
    process is gone, gc (and a worker's start) reaps what it left. Without an owner, nothing is reaped."""

    container_prefix = CONTAINER_PREFIX  # of the podman containers that run (or hold) its sandboxes

    def __init__(self, root: Path | None = None, runtime_bin: Path | None = None, owner: dict | None = None,
                 backend: str = "container"):
        backends.get(backend)  # an unknown name fails here, clearly
        rootless.require_namespace()
        self.backend = backend  # of the sandboxes made from images; a branch keeps its checkpoint's
        self.root = Path(root or default_root()).expanduser().absolute()
        self.runtime_bin = runtime_bin if runtime_bin is not None else settings().runtime_bin
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

    def receiving(self) -> AbstractContextManager[None]:
        """Held (exclusive, across processes) while a checkpoint and its image are shipped in: two receivers
        of one subvolume would each remove what the other was making."""
        return self._lock("receive")

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
            raise ImageNotFound(f"no image {name!r} in the store (import it: sprout sandbox "
                                f"images import {name})")
        return Image(self, row["key"], row["image_id"], json.loads(row["names"]),
                     _image_config(json.loads(row["config"])))

    def remove_image(self, key: str) -> None:
        """Deletes an image's subvolume and record; refused while a sandbox or checkpoint uses it."""
        image = self.image(key)
        row = self.meta.one("SELECT (SELECT COUNT(*) FROM sandboxes WHERE image_key = ?) + "
                            "(SELECT COUNT(*) FROM checkpoints WHERE image_key = ?) AS n", image.key, image.key)
        if row is not None and row["n"]:
            raise InUseError(f"image {image.key} is used by {row['n']} sandbox(es)/checkpoint(s)")
        btrfs.delete(image.path)
        for backend in backends.backends().values():
            backend.forget_image(self, image.key)
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
        runner = backends.of_limits(inherited) if from_checkpoint else backends.get(backend or self.backend)
        asked = {"memory": memory, "pids": pids, "cpus": cpus, "network": network, "host_trust": host_trust,
                 "env": env or None}
        limits = inherited | {k: v for k, v in asked.items() if v is not None}
        limits.setdefault("host_trust", trust.enabled_by_config())
        if network is not None:  # asked for explicitly: not as the checkpoint's sandbox was last switched
            limits.pop("network_connected", None)
        limits = runner.limits(limits, network=network, checkpoint=from_checkpoint)
        sandbox_id = _new_id("sb")
        source = from_checkpoint.path if from_checkpoint else image.path
        if not btrfs.is_subvolume(source):
            what = f"checkpoint {from_checkpoint.id}" if from_checkpoint else f"image {image.key}"
            raise StoreError(f"the subvolume of {what} is missing from the store at {source}")
        sandbox = Sandbox(self, sandbox_id, image.key, from_checkpoint.id if from_checkpoint else None, None,
                          self.container_prefix + sandbox_id, limits, label, time.time())
        with self.building():
            if from_checkpoint is None:
                runner.make_subvolume(self, image, sandbox.path)
            else:
                btrfs.snapshot(source, sandbox.path, readonly=False)
            try:
                runner.start(self, sandbox)
            except BaseException:
                sandbox.stop()
                btrfs.delete(sandbox.path)
                shell.run(["rm", "-rf", str(sandbox.profile_path.parent)], check=False)
                raise
            self.meta.put_sandbox(sandbox_id, image.key, sandbox.base_checkpoint, sandbox.container, limits, label,
                                  self.owner)
        return sandbox

    def labels(self, sandbox_id: str) -> dict[str, str]:
        """The podman labels of what runs a sandbox of this store (several stores may share one podman)."""
        return {LABEL: sandbox_id, STORE_LABEL: str(self.root)}

    def label_filter(self) -> str:
        """The podman label filter that finds what runs this store's sandboxes."""
        return f"{STORE_LABEL}={self.root}"

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

    def diff(self, base: str, target: str, *, content: bool = True, walk: bool = False) -> CheckpointDiff:
        """What changed on disk from `base` (a checkpoint, or the image key a lineage began from) to the
        checkpoint `target`: files added, changed and removed (sprout.sandbox.diff); `content` adds a
        unified diff of each text file under the cap. A microVM's checkpoints are read through guests
        booted on their disks (seconds under emulation), and walked."""
        after = self.checkpoint(target)
        before: Checkpoint | Image = self.image(base) if base.startswith("im-") else self.checkpoint(base)
        before_image = before.key if isinstance(before, Image) else before.image_key
        if before_image != after.image_key:
            raise StoreError(f"{base} and {target} are not of one lineage: they come from the images "
                             f"{before_image} and {after.image_key}")
        for name, path in ((base, before.path), (target, after.path)):
            if not btrfs.is_subvolume(path):
                raise StoreError(f"{name} is recorded but its subvolume {path} is gone")
        backend = backends.of_limits(after.limits)
        with backend.file_trees(self, [before, after]) as trees:
            return diff_trees(trees, base_name=base, target_name=target, content=content, walk=walk,
                              subvolumes=[before.path, after.path] if after.has_host_files else (),
                              start_made=backend.start_made if isinstance(before, Image) else frozenset())

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
        for backend in backends.backends().values():
            removed += backend.reap(self, known["sandboxes"], dry_run)
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
    if not backends.of_limits(limits).host_files:
        raise SandboxStateError(f"{what} is a microVM: its files are inside its disk, and reading or "
                                "writing them from the host (task files, grading) is not supported yet")
    return path


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
        shell.run([*podman.command(), "image", "unmount", image_id], check=False)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.decode(errors="replace").splitlines() if line.strip()]
        raise StoreError(f"copying {reference} into the store failed: {'; '.join(errors[:3])}")


def ensure_mounted(root: Path) -> None:
    """Mounts the store's loop file again if the machine rebooted; fails clearly when there is no store."""
    if not root.exists() and btrfs.is_btrfs(_existing_ancestor(root)):
        root.mkdir(parents=True)
    if btrfs.is_btrfs(root):
        return
    configured = settings().store_image
    image = configured.expanduser() if configured else Path(f"{root}.img")
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
