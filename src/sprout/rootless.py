"""Rootless operation: Sprout run by a user without root.

Rootless podman keeps its containers and images in a user namespace of the user's own (uid 0 inside is
the user, uids 1..65536 are the user's subordinate ids). Sprout works on those files from the host side
(image import, snapshots, deleting, reading an agent's files), so a rootless Sprout runs inside that same
namespace, as `podman unshare` enters it: there it is uid 0 over exactly the user's own ids, every file
keeps the owner the image gave it, and the sandboxes' namespaces are its own to enter. The `sprout`
command re-executes itself there (`enter`); a program using the library runs under `podman unshare`.

What differs from running as root on cgroup v1 hosts: rootless podman creates no cgroups, so a sandbox
has no memory, pids or CPU limits, its processes are found by their PID namespace and frozen by stopping
them (SIGSTOP) rather than by the cgroup freezer.
"""

import os
import shutil
import sys
from pathlib import Path

from .errors import SproutError

ROOTLESS_UID = "_CONTAINERS_ROOTLESS_UID"  # set by podman in `podman unshare` (the user's uid outside)


def active() -> bool:
    """Whether Sprout runs for a user without root (inside that user's namespace or not yet)."""
    return os.geteuid() != 0 or ROOTLESS_UID in os.environ


def entered() -> bool:
    """Whether this process runs in the user's podman namespace (rootless, as `podman unshare` starts it)."""
    return os.geteuid() == 0 and ROOTLESS_UID in os.environ


def user_id() -> int:
    """The uid that owns what Sprout makes, outside the namespace."""
    return int(os.environ[ROOTLESS_UID]) if entered() else os.geteuid()


def subordinate_ids() -> str | None:
    """The user's first subordinate uid range in /etc/subuid (`start:count`), None when it has none."""
    import pwd

    names = {str(user_id()), pwd.getpwuid(user_id()).pw_name}
    try:
        lines = Path("/etc/subuid").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1] for line in lines if line.split(":", 1)[0] in names), None)


def enter() -> None:
    """Re-executes this program (its whole command line) inside the user's podman namespace when it runs
    rootless outside it. Returns when there is nothing to do, and also when the namespace cannot be had
    (no podman, no subordinate ids): then the store refuses with the reason and `sprout doctor` says it."""
    if os.geteuid() == 0 or shutil.which("podman") is None or subordinate_ids() is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp("podman", ["podman", "unshare", "--", sys.executable, *sys.orig_argv[1:]])


def require_namespace() -> None:
    """Refuses to work on a store from outside the user's namespace, where its files are not this process's."""
    if os.geteuid() != 0:
        raise SproutError(f"running as uid {os.geteuid()} outside podman's user namespace: Sprout's store holds "
                         "files of the user's subordinate ids; run the program under `podman unshare` (the "
                         "`sprout` command enters it by itself)")


def runtime_dir() -> Path:
    """The user's runtime directory, where rootless podman has runc keep its containers' state."""
    return Path(os.environ.get("XDG_RUNTIME_DIR", f"/tmp/podman-run-{user_id()}"))


_said: set[str] = set()


def say_once(note: str) -> None:
    """A note on what works otherwise rootless, on stderr once per process."""
    if note not in _said:
        _said.add(note)
        print(f"sprout (rootless): {note}", file=sys.stderr)


def limits_apply() -> bool:
    """Whether podman can set a sandbox's memory, pids and CPU limits: not rootless on cgroup v1, where
    it has no cgroups to set them in (it would warn and ignore them)."""
    return not entered() or Path("/sys/fs/cgroup/cgroup.controllers").exists()
