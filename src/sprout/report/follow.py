"""How `sprout view`'s page follows a live run: a stream of Server-Sent Events, `change` whenever the run
moved (the page then reads it again) and `end` once it is over.

An evaluation that runs over a Run Store is followed through that Run Store's event stream of its group (its
jobs submitted, claimed, finished), when the viewer is configured for the same Run Store
($SPROUT_RUNSTORE_URL and its token); otherwise, and for RL groups, by watching the run's files. Each wait is
short, so a closed page costs the server one wait at most.
"""

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import SproutError
from ..eval.summary import SUMMARY, read_summary
from ..jobs.remote import configured_client
from ..rl_driver.groups import GROUP_STATUS

if TYPE_CHECKING:
    from ..runstore.client import RunStoreClient

WAIT_S = 10.0  # one long poll of the Run Store, or one stretch of watching files between keep-alives
POLL_S = 0.5  # how often files are looked at


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def follow_evaluation(directory: Path) -> Iterator[str]:
    """The events of the evaluation in `directory` until it is no longer running."""
    summary = read_summary(directory)
    client = configured_client() if summary.runstore_group else None
    if client is not None and client.url != summary.runstore:
        yield sse("note", {"text": f"following the files: this viewer's Run Store is {client.url}, "
                                   f"the evaluation's {summary.runstore}"})
        client.close()
        client = None
    running = lambda: read_summary(directory).status == "running"  # noqa: E731
    if client is None:
        yield from _watch(lambda: _stamp(directory / SUMMARY), running)
        return
    with client:
        yield from _follow_group_events(client, summary.runstore_group or "", directory, running)


def _follow_group_events(client: "RunStoreClient", group: str, directory: Path,
                         running: Callable[[], bool]) -> Iterator[str]:
    """Each batch of the group's Run Store events is a change; the files are watched if the Run Store goes."""
    yield sse("note", {"text": f"following Run Store group {group}"})
    seq = 0
    while running():
        try:
            events = client.events(group, after_seq=seq, wait_s=WAIT_S)
        except SproutError as e:  # the Run Store went away: the files still tell
            yield sse("note", {"text": f"the Run Store stopped answering ({e}); following the files"})
            yield from _watch(lambda: _stamp(directory / SUMMARY), running)
            return
        if events:
            seq = events[-1].seq
            yield sse("change", {"source": "runstore", "events": [f"{e.type} job {e.job_id}" for e in events]})
        else:
            yield ": keep-alive\n\n"
    yield sse("end", {})


def follow_group(directory: Path) -> Iterator[str]:
    """The events of the RL group in `directory` until the driver has written its status."""
    yield from _watch(lambda: _tree_stamp(directory), lambda: not (directory / GROUP_STATUS).is_file())


def _watch(stamp: Callable[[], object], live: Callable[[], bool]) -> Iterator[str]:
    last = stamp()
    while live():
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and stamp() == last and live():
            time.sleep(POLL_S)
        if (now := stamp()) != last:
            last = now
            yield sse("change", {"source": "files"})
        else:
            yield ": keep-alive\n\n"
    yield sse("end", {})


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


def _tree_stamp(directory: Path) -> tuple:
    """Every file's stamp in a group's directory (its slots' journals and grades, its reviews)."""
    return tuple(sorted((str(p), _stamp(p)) for p in directory.glob("**/*.json*")))
