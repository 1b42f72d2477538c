"""Grade noise, `regrade_attempts(...)`: each graded attempt of an evaluation graded N more times from its
final checkpoint, each in a branch of its own (concurrently, within the host's slots), so a "solved" that
is the verifier's luck shows as a pass rate below 1 (`sprout evaluate --regrade N`)."""

from concurrent.futures import ThreadPoolExecutor

from harbor.models.task.task import Task

from ..method.records import AttemptRecord
from ..sandbox import SproutError, Store
from ..sandbox.slots import HostSlots, host_slot_count
from ..tasks.grade import grade
from ..tasks.pull import PullPolicy


def regrade_attempts(store: Store, task: Task, attempts: list[AttemptRecord], times: int, *,
                     pull: PullPolicy | None = None) -> None:
    """Sets `regrades` (the N rewards; None: that grade failed) and `pass_rate` (the share of the attempt's
    N + 1 grades that scored 1) on each attempt that was graded and kept its final checkpoint."""
    chosen = [a for a in attempts if not a.cancelled and a.final_checkpoint and not a.regrades]
    work = [attempt for attempt in chosen for _ in range(times)]
    if not work:
        return

    def one(attempt: AttemptRecord) -> float | None:
        own = Store(store.root, runtime_bin=store.runtime_bin, backend=store.backend)  # a Store per thread
        with HostSlots(own.root).hold():
            try:
                assert attempt.final_checkpoint is not None  # (chosen for having one)
                return grade(own, own.checkpoint(attempt.final_checkpoint), task, pull=pull).reward
            except SproutError:
                return None

    with ThreadPoolExecutor(max_workers=min(len(work), host_slot_count()), thread_name_prefix="regrade") as pool:
        rewards = list(pool.map(one, work))
    for index, attempt in enumerate(chosen):
        attempt.regrades = rewards[index * times:(index + 1) * times]
        grades = [attempt.reward, *attempt.regrades]
        attempt.pass_rate = sum(r is not None and r >= 1 for r in grades) / len(grades)
