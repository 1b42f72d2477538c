"""Waiting on many jobs of one group (an RL group's samples, an evaluation's attempts) costs one long-poll
of the group's events at a time, not one per waiting job; each waiter still gets its own job's result."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sprout.errors import SproutError
from sprout.jobs import group_events
from sprout.jobs.remote import wait_job
from sprout.runstore.auth import Scope
from sprout.runstore.client import RunStoreClient
from tests.runstore.test_api import GATE, LiveApi, live_api


class CountingClient(RunStoreClient):
    """A real client that counts the event long-polls it has in flight."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.in_flight = self.most_in_flight = self.polls = 0
        self._count = threading.Lock()

    def events(self, *args, **kwargs):
        with self._count:
            self.in_flight += 1
            self.polls += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return super().events(*args, **kwargs)
        finally:
            with self._count:
                self.in_flight -= 1


def finish_one_by_one(api: LiveApi, n: int, every_s: float) -> None:
    worker = api.client(Scope.WORKER)
    done = 0
    while done < n:
        for claim in worker.claim("w", "h", limit=1, lease_s=30, wait_s=1):
            time.sleep(every_s)
            worker.complete(claim.job.id, claim.lease_token, {"n": claim.job.payload["task_dir"]})
            done += 1


def test_eight_waiters_on_one_group_share_one_long_poll(db_url: str) -> None:
    with live_api(db_url) as api:
        client = CountingClient(api.url, api.tokens[Scope.SUBMITTER])
        jobs = [client.submit("gate", {"task_dir": f"tasks/t{i}"}, group_id="g") for i in range(8)]
        finisher = threading.Thread(target=finish_one_by_one, args=(api, 8, 0.2))
        finisher.start()
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda job: wait_job(client, job, wait_s=0.5, timeout_s=60), jobs))
        finisher.join()
    assert results == [{"n": f"tasks/t{i}"} for i in range(8)]
    assert client.most_in_flight == 1
    # eight waiters polling on their own would each have polled at least once per 0.5 s for ~1.6 s
    assert client.polls < 8 * 3
    deadline = time.monotonic() + 5
    while group_events._followers and time.monotonic() < deadline:  # the follower ends once no one waits
        time.sleep(0.1)
    assert not group_events._followers


def test_every_waiter_hears_that_the_run_store_is_gone(db_url: str) -> None:
    with live_api(db_url) as api:
        client = RunStoreClient(api.url, api.tokens[Scope.SUBMITTER], retry_for_s=0)
        jobs = [client.submit("gate", GATE, group_id="lost") for _ in range(3)]
        pool = ThreadPoolExecutor(3)
        waits = [pool.submit(wait_job, client, job, wait_s=0.3, timeout_s=60) for job in jobs]
        time.sleep(0.5)
    for wait in waits:
        with pytest.raises(SproutError, match="lost the Run Store"):
            wait.result(timeout=30)
    pool.shutdown()
