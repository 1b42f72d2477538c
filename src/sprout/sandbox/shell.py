"""Running host tools (podman, btrfs, tar, mmdebstrap) with one clear error when they fail, and streaming\na tool's output to another's input in chunks (checkpoint shipping)."""

import shutil
import subprocess
from collections.abc import Generator, Iterator, Sequence

from .errors import CommandError


def tool(name: str) -> str:
    """A host tool's path: from PATH, else from the sbin directories a user's PATH may lack (mkfs.ext4)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin") or name


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


def stream_out(cmd: Sequence[str], what: str, chunk: int = 1 << 20) -> Generator[bytes, None, None]:
    """A command's stdout in chunks; raises CommandError with its stderr when it fails. `close()` kills
    a command whose output was not read to the end."""
    process = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout and process.stderr
    try:
        while data := process.stdout.read(chunk):
            yield data
        error = process.stderr.read().decode(errors="replace").strip()
        if process.wait() != 0:
            raise CommandError(f"{what} failed: {error}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        process.stderr.close()


def stream_in(cmd: Sequence[str], chunks: Iterator[bytes], what: str, first: bytes = b"") -> int:
    """Feeds `first` then `chunks` to a command's stdin; returns the bytes taken from `chunks`. Raises
    CommandError with its stderr when it fails, or what reading `chunks` raised."""
    process = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdin and process.stderr
    size = 0
    try:
        process.stdin.write(first)
        for data in chunks:
            size += len(data)
            process.stdin.write(data)
    except BrokenPipeError:
        pass  # the command gave up; its error follows
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        try:
            process.stdin.close()
        except BrokenPipeError:
            pass
    error = process.stderr.read().decode(errors="replace").strip()
    process.stderr.close()
    if process.wait() != 0:
        raise CommandError(f"{what} failed: {error}")
    return size
