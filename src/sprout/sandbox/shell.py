"""Running host tools (podman, btrfs, mmdebstrap) with one clear error when they fail."""

import shutil
import subprocess
from collections.abc import Sequence

from .errors import CommandError


def run(cmd: Sequence[str], *, input: bytes | None = None, check: bool = True,
        timeout: float | None = None, what: str | None = None) -> subprocess.CompletedProcess:
    """Runs a host command, capturing output; raises CommandError with its stderr on failure."""
    if shutil.which(cmd[0]) is None:
        raise CommandError(f"{cmd[0]} is not installed (run ops/setup_podman.sh)")
    try:
        proc = subprocess.run(list(cmd), input=input, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CommandError(f"{what or cmd[0]} timed out after {timeout}s: {' '.join(cmd)}") from None
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).decode(errors="replace").strip().splitlines()
        message = detail[-1] if detail else f"exit code {proc.returncode}"
        raise CommandError(f"{what or ' '.join(cmd[:3])} failed: {message}")
    return proc


def output(cmd: Sequence[str], **kwargs) -> str:
    return run(cmd, **kwargs).stdout.decode().strip()
