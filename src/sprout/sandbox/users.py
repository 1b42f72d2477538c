"""Resolving a user name or id the way podman does, from the sandbox's own /etc/passwd and /etc/group.

The files are the agent's: they are read with sprout.sandbox.rootfs (links resolved inside the sandbox,
regular files only, bounded size). One that cannot be read safely counts as empty.
"""

from pathlib import Path

from . import rootfs
from .errors import SproutError

MAX_TABLE_BYTES = 1 << 20


def _table(root: Path, path: str) -> list[list[str]]:
    try:
        data = rootfs.read_file(root, path, MAX_TABLE_BYTES) or b""
    except rootfs.UnsafeFile:
        data = b""
    return [line.split(":") for line in data.decode(errors="replace").splitlines() if line and line[0] != "#"]


def resolve(root: Path, user: str | int) -> tuple[int, int, list[int]]:
    """uid, gid and supplementary groups for `name`, `uid`, `name:group` or `uid:gid` inside the rootfs `root`."""
    spec = str(user)
    name, _, group = spec.partition(":")
    passwd, groups = _table(root, "/etc/passwd"), _table(root, "/etc/group")
    entry = next((e for e in passwd if len(e) > 3 and e[2].isdigit() and e[3].isdigit() and name in (e[0], e[2])),
                 None)
    if entry is not None:
        uid, gid, login = int(entry[2]), int(entry[3]), entry[0]
    elif name.isdigit() or name == "root":
        uid = gid = 0 if name == "root" else int(name)
        login = None
    else:
        raise SproutError(f"no user {name!r} in the sandbox's /etc/passwd")
    if group:
        match = next((g for g in groups if len(g) > 2 and g[2].isdigit() and group in (g[0], g[2])), None)
        if match is None and not group.isdigit():
            raise SproutError(f"no group {group!r} in the sandbox's /etc/group")
        gid = int(match[2]) if match else int(group)
    extra = sorted({int(g[2]) for g in groups if len(g) > 3 and g[2].isdigit() and login and login in g[3].split(",")}
                   - {gid})
    return uid, gid, extra
