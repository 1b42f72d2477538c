"""Pulling images as any container tool does: a pull policy (`missing`, `always`, `never`) applied to a
task's `docker_image` and to the FROM images of its builds.

The policy comes from a flag (`--pull`), else $SPROUT_PULL_POLICY, else `missing`. Concurrent workers
on one host pull an image once: pulls of one name are serialised by a file lock in the store, and a
worker that waited while another pulled the same name uses that pull (even under `always`).
"""

import fcntl
import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from ..sandbox import podman
from ..sandbox.errors import ImageNotFound
from ..sandbox.podman import inspect_image
from ..settings import settings
from .errors import TaskImageError

if TYPE_CHECKING:
    from ..sandbox import Store

PullPolicy = Literal["missing", "always", "never"]
PULL_POLICIES: tuple[str, ...] = get_args(PullPolicy)
OFFLINE_HELP = ("to provide it offline: `podman load -i IMAGE.tar` (a `podman save` of it from a host with a "
                "registry), or `podman import ROOTFS.tar NAME`, or `sprout sandbox images bootstrap` for "
                "the common base images (python:3.11/3.12, debian:bookworm, ubuntu:22.04/24.04)")

PULL_HELP = ("pull policy for a task's docker_image and its Dockerfile's FROM images: missing (pull what podman "
             "lacks; the default, or $SPROUT_PULL_POLICY), always, never; a prebuilt image that cannot be pulled "
             "falls back to building the task's environment/Dockerfile")


class PullError(TaskImageError):
    """An image that the policy says to pull could not be pulled (`answer`: what the registry said)."""

    def __init__(self, message: str, answer: str):
        super().__init__(message)
        self.answer = answer


@dataclass(frozen=True)
class Pulled:
    reference: str
    image_id: str
    pulled: bool  # whether this call (or a concurrent one it waited for) ran `podman pull`
    seconds: float


def pull_policy(value: str | None = None) -> PullPolicy:
    """The policy to use: `value` (a flag), else $SPROUT_PULL_POLICY, else `missing`."""
    if value is None:
        return settings().pull_policy
    if value not in PULL_POLICIES:
        raise TaskImageError(f"--pull is {value!r}; it must be one of {', '.join(PULL_POLICIES)}")
    return value  # type: ignore[return-value]


def image_id(reference: str) -> str | None:
    """The id of podman's image of that name, or None when podman has none."""
    try:
        return inspect_image(reference).image_id
    except ImageNotFound:
        return None


def ensure_present(store: "Store", reference: str, policy: PullPolicy, *, what: str) -> Pulled:
    """Makes podman have `reference` as `policy` says; `what` names it in errors (e.g. "task x's image").
    Raises PullError when a needed pull fails, TaskImageError when `never` finds no image."""
    started = time.monotonic()
    present = image_id(reference)
    if policy == "never" or (policy == "missing" and present):
        if present is None:
            raise PullError(f"{what} {reference!r} is not in podman and the pull policy is 'never'; {OFFLINE_HELP}",
                            "not pulled (policy never)")
        return Pulled(reference, present, False, time.monotonic() - started)
    waited_since = time.time()
    with _pull_lock(store, reference) as marker:
        present = image_id(reference)
        if present and (policy == "missing" or _pulled_after(marker, waited_since)):
            return Pulled(reference, present, True, time.monotonic() - started)
        answer = podman.pull(reference)
        if answer is not None:
            raise PullError(f"{what} {reference!r} could not be pulled: {answer}; {OFFLINE_HELP}", answer)
        marker.write_text(str(time.time()))
    return Pulled(reference, image_id(reference) or "", True, time.monotonic() - started)


@contextmanager
def _pull_lock(store: "Store", reference: str) -> Iterator[Path]:
    """Held while `reference` is pulled; yields a marker file whose content is when it was last pulled."""
    digest = hashlib.sha256(reference.encode()).hexdigest()[:16]
    lock = store.root / "state" / "locks" / f"pull-{digest}"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield lock.with_suffix(".pulled")


def _pulled_after(marker: Path, since: float) -> bool:
    try:
        return float(marker.read_text()) >= since
    except (OSError, ValueError):
        return False
