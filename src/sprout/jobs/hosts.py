"""Images on every host ahead of time: one prepare job per live worker host, pinned to it.

A step's tasks bring many images, and the first sample on a host would pay the pull and import. A
submitter (`sprout rl-driver prepare --hosts`, the RL driver at start) sends each live host a prepare
job for the task set; each reports which images it holds and which failed, and samples then prefer
hosts that hold their image (`HostImages`).
"""

import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import SproutError
from ..tasks.pull import PullPolicy
from .payloads import PreparePayload, PrepareResult
from .remote import submit_job, wait_job

LIVE_S = 180.0  # a host whose workers registered this recently is live (they do every minute)


def prepare_hosts(client, tasks: Sequence[Path], *, hosts: Sequence[str] = (), pull: PullPolicy | None = None,
                  timeout_s: float = 3600.0,
                  on_host: Callable[[PrepareResult], None] = lambda _r: None) -> list[PrepareResult]:
    """Prepares `tasks` on `hosts` (default: every live host) at once; `on_host` is called as each one
    finishes. A host whose job failed, or did not finish within `timeout_s`, lists every task failed."""
    live = [h.name for h in client.hosts(LIVE_S)]
    names = list(dict.fromkeys(hosts)) or live
    if not names:
        raise SproutError(f"no live worker host on the Run Store at {client.url} (none registered in the last "
                          f"{LIVE_S:g} s): start workers (`sprout services up`) first")
    if absent := [name for name in names if name not in live]:
        raise SproutError(f"no live worker on host(s) {', '.join(absent)} (none registered in the last {LIVE_S:g} s; "
                          f"live: {', '.join(live) or 'none'})")
    payload = PreparePayload(tasks=[str(Path(t).resolve()) for t in tasks], pull=pull)
    group = f"prepare-{uuid.uuid4().hex[:12]}"
    jobs = {name: submit_job(client, payload, group_id=group, host=name) for name in names}  # pinned: no timeout
    results: dict[str, PrepareResult] = {}
    lock = threading.Lock()

    def wait(name: str) -> None:
        try:
            result = PrepareResult.model_validate(wait_job(client, jobs[name], timeout_s=timeout_s))
        except SproutError as e:
            result = PrepareResult(host=name, failed={task: str(e) for task in payload.tasks})
        with lock:
            results[name] = result
            on_host(result)

    threads = [threading.Thread(target=wait, args=(name,), daemon=True) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[name] for name in names]


class HostImages:
    """Which hosts hold which task's image, from prepare results: where a task's samples should go."""

    def __init__(self) -> None:
        self._hosts: dict[str, list[str]] = {}  # task directory -> hosts that hold its image
        self._turn = 0
        self._lock = threading.Lock()

    def add(self, result: PrepareResult) -> None:
        with self._lock:
            for task in result.ready:
                if result.host not in self._hosts.setdefault(task, []):
                    self._hosts[task].append(result.host)

    def host_for(self, task_dir: Path) -> str | None:
        """A host holding the task's image (in turn, to spread samples), or None when none is known."""
        with self._lock:
            hosts = self._hosts.get(str(Path(task_dir).resolve()))
            if not hosts:
                return None
            self._turn += 1
            return hosts[self._turn % len(hosts)]
