"""Groups: accept a request into the ledger, run its sample slots concurrently, answer its result.

POST only records the group and hands it to a background thread, so it answers at once. Each group's
thread starts its slots on the sample backend (in-process slots, or Run Store jobs that free workers
take), waits for them until the group's hard deadline (submission + wall time + finalization), stops
what is still running then, and records the terminal status. A driver that restarts picks up every
group the ledger has unfinished: finished slots stay, the others run again (a Run Store job that is
still running is found again by its idempotency key, not run twice).
"""

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from ..sandbox import Store
from ..sandbox.errors import SproutError
from .config import DriverConfig, task_dir_for
from .ledger import GroupRow, Ledger
from .protocol import TERMINAL_STATUSES, RolloutGroupAck, RolloutGroupRequest, RolloutGroupResult
from .samples import LocalSamples, SampleBackend, SamplePlan, SampleResult, sample_result

log = logging.getLogger("sprout.rl_driver")
BUDGET_KEYS = ("model_calls", "tool_calls", "tokens_in", "tokens_out", "sandbox_seconds")


class GroupConflict(SproutError):
    """The id is taken by a group with another body (answered 409)."""


class GroupNotFound(SproutError):
    """No group has this id (answered 404)."""


class Driver:
    def __init__(self, config: DriverConfig, ledger: Ledger, backend: SampleBackend, *, slots: int):
        self.config, self.ledger, self.backend = config, ledger, backend
        self._samples = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="sample")
        self._stops: dict[str, threading.Event] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closing = False  # shutting down: running groups stay unfinished for the next driver
        self.store = Store(runtime_bin=config.runtime_bin)  # this host's: test paths, checkpoint release

    def start(self) -> None:
        """Carries on every group a previous driver process left unfinished."""
        for group_id in self.ledger.unfinished():
            log.info("resuming group %s", group_id)
            self._launch(group_id)

    def submit(self, request: RolloutGroupRequest) -> RolloutGroupAck:
        task_dir_for(self.config, request.task_id)  # refused before anything is recorded
        slots = [(s.sample_slot_id, s.sample_index) for s in request.sample_slots]
        digest = request.body_digest()
        if self.ledger.add_group(request.rollout_job_id, digest, request.wire(), time.time(), slots,
                                 used=request.max_samples):
            self._launch(request.rollout_job_id)
            return RolloutGroupAck(rollout_job_id=request.rollout_job_id, status="queued")
        group = self.ledger.group(request.rollout_job_id)
        if group is None:  # deleted in between
            raise GroupConflict(f"group {request.rollout_job_id} was just deleted; submit it under a new id")
        if group.digest != digest:
            raise GroupConflict(f"group {request.rollout_job_id} exists with a different request body")
        return RolloutGroupAck(rollout_job_id=group.id, status=group.status)

    def result(self, group_id: str) -> RolloutGroupResult:
        group = self.ledger.group(group_id)
        if group is None:
            raise GroupNotFound(f"no rollout group {group_id!r} (never accepted, or deleted)")
        return group_result(group)

    def delete(self, group_id: str) -> RolloutGroupAck:
        """Cancels what is unfinished and forgets the group at once; its checkpoints are released
        as soon as its samples have stopped (each within one turn)."""
        group = self.ledger.group(group_id)
        if group is None:
            raise GroupNotFound(f"no rollout group {group_id!r} (never accepted, or already deleted)")
        status = group.status if group.status in TERMINAL_STATUSES else "cancelled"
        self.ledger.delete(group_id)
        with self._lock:
            running = group_id in self._threads
            if running:
                self._stops[group_id].set()  # the group's thread releases the checkpoints when its samples end
        if not running:
            self._release(group_id)
        return RolloutGroupAck(rollout_job_id=group_id, status=status)

    def close(self) -> None:
        """Stops waiting; running groups stay unfinished in the ledger for the next driver. Samples run
        here are stopped (the next driver runs them again); Run Store jobs carry on, to be found again."""
        local = isinstance(self.backend, LocalSamples)
        with self._lock:
            self._closing = True
            stops = list(self._stops.values()) if local else []
        for stop in stops:
            stop.set()
        self._samples.shutdown(wait=local, cancel_futures=True)

    def _launch(self, group_id: str) -> None:
        with self._lock:
            stop = self._stops[group_id] = threading.Event()
            thread = self._threads[group_id] = threading.Thread(target=self._run_group, args=(group_id, stop),
                                                                name=f"group-{group_id[:40]}", daemon=True)
        thread.start()

    def _stop(self, group_id: str) -> None:
        with self._lock:
            stop = self._stops.get(group_id)
        if stop is not None:
            stop.set()

    def _run_group(self, group_id: str, stop: threading.Event) -> None:
        try:
            self._run_slots(group_id, stop)
        except Exception as e:  # a bug or a lost ledger: the group fails rather than hangs
            log.exception("group %s failed", group_id)
            self.ledger.set_status(group_id, "failed", f"driver error: {type(e).__name__}: {e}"[:500], time.time())
        finally:
            with self._lock:
                self._stops.pop(group_id, None)
                self._threads.pop(group_id, None)
            if self.ledger.group(group_id) is None:  # deleted while it ran
                self._release(group_id)

    def _run_slots(self, group_id: str, stop: threading.Event) -> None:
        group = self.ledger.group(group_id)
        if group is None or group.status in TERMINAL_STATUSES:
            return
        request = RolloutGroupRequest.model_validate(group.request)
        self.ledger.set_status(group_id, "running")
        deadline = group.submitted_at + request.budgets.max_wall_time_seconds
        hard_deadline = deadline + request.finalization_timeout_seconds
        task_dir = task_dir_for(self.config, request.task_id)
        futures: dict[Future, str] = {}
        for slot_row, slot in zip(group.slots, request.sample_slots, strict=True):
            if slot_row.state in ("pending", "running"):
                plan = self._plan(group_id, request, slot, task_dir, deadline)
                futures[self._samples.submit(self._run_sample, plan, stop)] = slot.sample_slot_id
        pending = set(futures)
        while pending and not stop.is_set():
            _, pending = wait(pending, timeout=min(1.0, max(0.0, hard_deadline - time.time())),
                              return_when=FIRST_COMPLETED)
            if time.time() >= hard_deadline:
                break
        stop.set()  # what is still running is past its deadline (or the group was deleted): stop it
        wait(pending)
        if not self._cancelled(group_id) and not self._closing:
            self._finish(group_id, request)

    def _plan(self, group_id: str, request: RolloutGroupRequest, slot, task_dir: Path, deadline: float) -> SamplePlan:
        sample_dir = self.config.data_path / "groups" / _safe(group_id) / f"slot-{slot.sample_index}"
        return SamplePlan(group_id=group_id, request=request, slot=slot, task_dir=task_dir, sample_dir=sample_dir,
                          deadline_unix=deadline, key_env=self.config.miles.api_key_env,
                          command_timeout_s=self.config.command_timeout_s, token_limit=self.config.token_limit)

    def _run_sample(self, plan: SamplePlan, stop: threading.Event) -> None:
        group_id, slot_id = plan.group_id, plan.slot.sample_slot_id
        job_id: int | None = None

        def on_job(job: int) -> None:
            nonlocal job_id
            job_id = job
            self.ledger.set_slot(group_id, slot_id, state="running", job_id=job)

        if stop.is_set():
            result = SampleResult(None, "stopped before it started: the group's time ran out", {})
        else:
            self.ledger.set_slot(group_id, slot_id, state="running")
            try:
                done = self.backend.run(plan, stop, on_job)
                result = sample_result(plan, done, job_id, self.store)
            except Exception as e:
                reason = "stopped: the group's wall time and finalization ran out" if stop.is_set() else str(e)
                result = SampleResult(None, f"{type(e).__name__}: {reason}"[:500], {})
        if self._cancelled(group_id) or self._closing:
            return
        self.ledger.set_slot(group_id, slot_id, state="done" if result.trajectory else "failed",
                             trajectory=result.trajectory, failure=result.failure, budget=result.budget)

    def _cancelled(self, group_id: str) -> bool:
        return self.ledger.group(group_id) is None  # deleted

    def _finish(self, group_id: str, request: RolloutGroupRequest) -> None:
        group = self.ledger.group(group_id)
        assert group is not None
        done = sum(1 for s in group.slots if s.state == "done")
        failed = [s for s in group.slots if s.state == "failed"]
        if done == request.max_samples:
            status, reason = "completed", None
        elif done >= request.minimum_returned_samples:
            status, reason = "early_stopped", f"{len(failed)} of {request.max_samples} samples failed"
        else:
            status = "failed"
            reason = f"{done} of {request.max_samples} samples returned, fewer than the minimum " \
                     f"{request.minimum_returned_samples}" + (f"; {failed[0].slot_id}: {failed[0].failure}"
                                                               if failed else "")
        self.ledger.set_status(group_id, status, reason, time.time())
        log.info("group %s %s (%d of %d samples)", group_id, status, done, request.max_samples)

    def _release(self, group_id: str) -> None:
        """Releases the checkpoints of a deleted group's samples (unless keep_checkpoints), as an
        evaluation does when it finishes; their journals stay."""
        if self.config.keep_checkpoints:
            return
        from ..method.executor import release

        journals = sorted((self.config.data_path / "groups" / _safe(group_id)).glob("slot-*/journal.jsonl"))
        if journals:
            release(self.store, journals)


def group_result(group: GroupRow) -> RolloutGroupResult:
    request = group.request
    trajectories = [s.trajectory for s in group.slots if s.state == "done" and s.trajectory]
    failed = [{"sample_slot_id": s.slot_id, "reason": s.failure or "failed"} for s in group.slots
              if s.state == "failed"]
    budget: dict[str, float] = {k: 0 for k in BUDGET_KEYS}
    for slot in group.slots:
        for key in BUDGET_KEYS:
            budget[key] += slot.budget.get(key, 0)
    budget["sandbox_seconds"] = round(budget["sandbox_seconds"], 3)
    budget["total_tokens"] = budget["tokens_in"] + budget["tokens_out"]
    return RolloutGroupResult(
        rollout_job_id=group.id, prompt_group_id=request["prompt_group_id"], max_samples=request["max_samples"],
        actual_samples=len(trajectories), trajectories=trajectories, failed_samples=failed, search_branches=0,
        consumed_budget=budget, status=group.status, stop_reason=group.stop_reason)


def _safe(group_id: str) -> str:
    """A directory name for a group id (ids are the client's: keep them readable but harmless)."""
    import hashlib

    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in group_id)[:80].lstrip(".")
    return f"{cleaned}-{hashlib.sha256(group_id.encode()).hexdigest()[:8]}"
