"""One long-poll of a group's events for every thread of this process that waits on the group's jobs.

A waiter per job, each long-polling its group on its own, made the API answer (and the database read) a
request per job every poll: an RL driver waiting on 64 samples sent 64 a second. Here the first waiter
on a group starts a follower thread that long-polls the group's events and wakes the waiters whose jobs
an event names; the follower ends once no one waits. An error it meets (the Run Store lost, say) is
raised in every waiter.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_followers: dict[tuple[int, str], "GroupEvents"] = {}
_lock = threading.Lock()


class GroupEvents:
    """The events of one group, as far as they have been read: the latest seq that names each job."""

    def __init__(self, client, group_id: str, wait_s: float):
        self.client, self.group_id, self.wait_s = client, group_id, wait_s
        self._changed = threading.Condition()
        self._latest: dict[int, int] = {}  # job id -> the seq of its latest event
        self._seq = 0
        self._waiters = 0
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._follow, name=f"events-{group_id[:40]}", daemon=True)

    def wait(self, job_id: int, seen: int, timeout_s: float) -> int:
        """Waits up to `timeout_s` for an event about `job_id` after seq `seen`; returns the seq of the
        latest event about it (still `seen`, or less, when none came)."""
        with self._changed:
            self._changed.wait_for(lambda: self._latest.get(job_id, 0) > seen or self._error is not None,
                                   timeout=timeout_s)
            if self._error is not None:
                raise self._error
            return self._latest.get(job_id, 0)

    def _follow(self) -> None:
        while True:
            try:
                events = self.client.events(self.group_id, after_seq=self._seq, wait_s=self.wait_s)
            except Exception as e:  # noqa: BLE001 - raised in every waiter, as their own poll would have
                with self._changed:
                    self._error = e
                    self._changed.notify_all()
                events = []
            with _lock, self._changed:
                for event in events:
                    self._latest[event.job_id] = max(self._latest.get(event.job_id, 0), event.seq)
                    self._seq = max(self._seq, event.seq)
                if events:
                    self._changed.notify_all()
                if self._waiters == 0 or self._error is not None:
                    if _followers.get(self._key) is self:
                        del _followers[self._key]
                    return

    @property
    def _key(self) -> tuple[int, str]:
        return id(self.client), self.group_id


@contextmanager
def group_events(client, group_id: str, wait_s: float) -> Iterator[GroupEvents]:
    """The follower of `group_id`'s events through `client`, shared with this process's other waiters."""
    key = (id(client), group_id)
    with _lock:
        follower = _followers.get(key)
        if follower is None:
            follower = _followers[key] = GroupEvents(client, group_id, wait_s)
            follower._thread.start()
        with follower._changed:
            follower._waiters += 1
    try:
        yield follower
    finally:
        with _lock, follower._changed:
            follower._waiters -= 1
