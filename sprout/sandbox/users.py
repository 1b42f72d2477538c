"""Resolving a user name or id the way podman does, from the sandbox's own /etc/passwd and /etc/group."""

from pathlib import Path

from .errors import SproutError


def _table(path: Path) -> list[list[str]]:
    try:
        return [line.split(":") for line in path.read_text(errors="replace").splitlines() if line and line[0] != "#"]
    except FileNotFoundError:
        return []


def resolve(rootfs: Path, user: str | int) -> tuple[int, int, list[int]]:
    """uid, gid and supplementary groups for `name`, `uid`, `name:group` or `uid:gid` inside `rootfs`."""
    spec = str(user)
    name, _, group = spec.partition(":")
    passwd, groups = _table(rootfs / "etc/passwd"), _table(rootfs / "etc/group")
    entry = next((e for e in passwd if len(e) > 3 and (e[0] == name or e[2] == name)), None)
    if entry is not None:
        uid, gid, login = int(entry[2]), int(entry[3]), entry[0]
    elif name.isdigit():
        uid, gid, login = int(name), int(name), None
    else:
        raise SproutError(f"no user {name!r} in the sandbox's /etc/passwd")
    if group:
        match = next((g for g in groups if len(g) > 2 and (g[0] == group or g[2] == group)), None)
        if match is None and not group.isdigit():
            raise SproutError(f"no group {group!r} in the sandbox's /etc/group")
        gid = int(match[2]) if match else int(group)
    extra = sorted({int(g[2]) for g in groups if len(g) > 3 and login and login in g[3].split(",")} - {gid})
    return uid, gid, extra
