"""Sandbox backends: what runs a sandbox's subvolume. `container` runs it as a podman container (its
subvolume is the container's rootfs), `microvm` as a QEMU microVM (its subvolume holds the VM's disk
file). The store (sprout.sandbox.store) does the rest, the same for every backend: images, snapshots,
metadata, limits, owners and gc.

A backend is named in a sandbox's limits (`"backend"`, absent for containers: older rows), so its
checkpoints and branches keep it. This module is the one registry of backends: every command-line choice,
job payload and config field that names one takes its names from here, and nothing outside this package
compares a backend's name.
"""

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from pydantic import AfterValidator

from ..diff import Tree
from ..errors import StoreError
from ..execution import ExecResult
from ..files import SandboxFiles

if TYPE_CHECKING:
    import threading

    from ..store import Checkpoint, Image, Sandbox, Store

DEFAULT = "container"


@dataclass
class Check:
    """One line of `sprout doctor`: what was checked, whether it is fine, and what to do when it is not."""

    name: str
    ok: bool
    detail: str


@dataclass
class Smoke:
    """How doctor's smoke test makes a sandbox of a backend: the step's name and create_sandbox's options."""

    first: str = "create"
    save_memory: bool = False
    create: dict[str, Any] = field(default_factory=dict)
    detail: str = ""  # what the smoke line says before the timings


class SandboxBackend(Protocol):
    name: str
    summary: str  # one line, for help texts
    host_files: bool  # whether the sandbox's files are a host directory (its rootfs) while it runs
    start_made: frozenset[str]  # paths the sandbox's start adds to its image's files or writes (no command's work)

    def limits(self, limits: dict, *, network: bool | None, checkpoint: "Checkpoint | None") -> dict:
        """A new sandbox's limits (`limits`: the defaults or its checkpoint's, with what was asked),
        as this backend keeps them."""
        ...

    def make_subvolume(self, store: "Store", image: "Image", dest: Path) -> None:
        """A fresh sandbox's subvolume at `dest`, from `image` (a branch's is a snapshot of its checkpoint)."""
        ...

    def start(self, store: "Store", sandbox: "Sandbox", *, restart: bool = False) -> None:
        """Runs the sandbox on its subvolume; `restart`: again, after it stopped (or the host rebooted)."""
        ...

    def stop(self, sandbox: "Sandbox") -> None: ...

    def running(self, sandbox: "Sandbox") -> bool: ...

    def network_enabled(self, sandbox: "Sandbox") -> bool: ...

    def set_network(self, sandbox: "Sandbox", enabled: bool) -> None: ...

    def exec(self, sandbox: "Sandbox", argv: list[str], *, cwd: str, env: dict[str, str], user: str | int | None,
             timeout: float | None, max_output: int, cancel: "threading.Event | None") -> ExecResult: ...

    def snapshot(self, sandbox: "Sandbox", dest: Path, *, memory: bool) -> None:
        """A read-only snapshot of the running (or stopped) sandbox at `dest`, nothing written half-way."""
        ...

    def files(self, sandbox: "Sandbox") -> AbstractContextManager[SandboxFiles]:
        """The running sandbox's files, for one transfer."""
        ...

    def file_trees(self, store: "Store", sources: "Sequence[Checkpoint | Image]") -> AbstractContextManager[list[Tree]]:
        """The files of checkpoints (or of the image a lineage began from), read-only, as the trees a
        checkpoint diff compares (sprout.sandbox.diff)."""
        ...

    def reap(self, store: "Store", sandbox_ids: set[str], dry_run: bool) -> list[str]:
        """Removes what this backend runs for sandboxes that no longer exist; says what (it would)."""
        ...

    def forget_image(self, store: "Store", image_key: str) -> None:
        """Removes what this backend keeps of an image that is being removed."""
        ...

    def checks(self, store: "Store | None") -> list[Check]:
        """Doctor's checks of this host (and of `store`, when it opened) for this backend, before its smoke
        test."""
        ...

    @property
    def smoke(self) -> Smoke:
        """How doctor's smoke test makes one of its sandboxes."""
        ...


def _registry() -> dict[str, SandboxBackend]:
    from .container import ContainerBackend
    from .microvm import MicroVMBackend

    return {backend.name: backend for backend in (ContainerBackend(), MicroVMBackend())}


_BACKENDS: dict[str, SandboxBackend] = {}


def backends() -> dict[str, SandboxBackend]:
    """Every backend by name, the default first."""
    if not _BACKENDS:
        _BACKENDS.update(_registry())
    return _BACKENDS


def names() -> list[str]:
    return list(backends())


def get(name: str) -> SandboxBackend:
    """The backend called `name`; StoreError naming the others for an unknown one."""
    found = backends().get(name)
    if found is None:
        raise StoreError(f"unknown backend {name!r}: use {' or '.join(names())}")
    return found


def check_name(name: str) -> str:
    """`name` if it is a backend's (a pydantic validator: ValueError otherwise)."""
    if name not in backends():
        raise ValueError(f"unknown sandbox backend {name!r}: use {' or '.join(names())}")
    return name


BackendName = Annotated[str, AfterValidator(check_name)]  # a field naming a backend (payloads, configs)


def help_text() -> str:
    """The help of every --backend flag."""
    return "the sandboxes: " + "; ".join(f"{b.name}: {b.summary}" for b in backends().values()) + \
        f" (default {DEFAULT}); a branch keeps its checkpoint's"


def of_limits(limits: dict) -> SandboxBackend:
    """The backend of a sandbox or checkpoint with these limits."""
    return get(limits.get("backend", DEFAULT))

