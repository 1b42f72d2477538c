"""Layer 1: images, sandboxes, checkpoints and branches on a btrfs store, run with stock podman."""

from typing import TYPE_CHECKING

from ..lazy import exports
from .errors import (
    CheckpointNotFound,
    CommandError,
    ImageNotFound,
    InUseError,
    SandboxNotFound,
    SandboxStateError,
    SproutError,
    StoreError,
    TransferError,
)

if TYPE_CHECKING:
    from .execution import ExecResult
    from .files import SandboxFiles
    from .store import Checkpoint, Image, Sandbox, Store
    from .trust import HostTrust, HostTrustError, host_trust

__getattr__ = exports(__name__, {
    ".execution": ["ExecResult"],
    ".files": ["SandboxFiles"],
    ".store": ["Checkpoint", "Image", "Sandbox", "Store"],
    ".trust": ["HostTrust", "HostTrustError", "host_trust"],
})

__all__ = ["Store", "Image", "Sandbox", "Checkpoint", "ExecResult", "SproutError", "StoreError",
           "ImageNotFound", "SandboxNotFound", "CheckpointNotFound", "SandboxStateError", "InUseError",
           "CommandError", "TransferError", "SandboxFiles", "HostTrust", "HostTrustError", "host_trust"]
