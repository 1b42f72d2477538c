"""The sandbox layer's errors: each a SproutError with one clear message (the CLI prints it, no traceback)."""

from ..errors import SproutError


class StoreError(SproutError):
    """The btrfs store is missing, not btrfs, or not writable."""


class ImageNotFound(SproutError):
    """An image was asked for that podman or the store does not have."""


class SandboxNotFound(SproutError):
    pass


class CheckpointNotFound(SproutError):
    pass


class SandboxStateError(SproutError):
    """The operation does not fit the sandbox's state (e.g. deleting a running sandbox's disk)."""


class InUseError(SproutError):
    """A checkpoint or image still has live dependants."""


class CommandError(SproutError):
    """An external tool (podman, btrfs, mmdebstrap) failed."""


class TransferError(SproutError):
    """A file could not be copied into or out of a sandbox (it refused: a link where a file goes, a path
    that is not on its disk, a special or oversized file)."""
