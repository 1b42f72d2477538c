"""Groups: accept a request into the ledger, run its sample slots concurrently, answer its result.

POST only records the group and hands it to a background thread, so it answers at once. Each group's
thread starts its slots on the sample backend (in-process slots, or Run Store jobs that free workers
take) and waits for them until a little before submission + wall time + finalization (Miles' own limit,
which it counts from before its POST); then it stops what still runs, lists it failed, and records the
terminal status. A sample that ends later changes nothing: slots are written only while their group (that
very submission of its id) is live, and a finished slot never changes. A DELETEd group is answered as unknown at once and forgotten once its
samples have stopped; its id is free again then. A driver that restarts picks up every group the ledger
has unfinished: finished slots stay, the others run again (a Run Store job that is still running is
waited on again, not run twice). A group with a `search` runs in phases (roots, then review rounds and
their branches), each stopped at its own deadline; sprout.rl_driver.search plans them. A live group no
client has polled (POSTed or GET) for `abandon_after_s` (counted from its submission, or from the restart
of a driver that resumed it) is abandoned: cancelled with its reason, its samples stopped and, once they
have, its checkpoints released; its result stays answerable until it is DELETEd.
"""

import hashlib
import json
import logging
import re
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from ..agent.models import Endpoint
from ..errors import SproutError
from ..files import write_atomic
from ..method.review import Reviewer
from ..sandbox import Store
from .config import DriverConfig, ReviewConfig, ServedTask, served_task
from .ledger import DELETING, LIVE, GroupRow, Ledger
from .outcome import annotate, root_counts
from .protocol import TERMINAL_STATUSES, RolloutGroupAck, RolloutGroupRequest, RolloutGroupResult
from .samples import SampleBackend, SamplePlan, SampleResult, policy_endpoint, sample_result

log = logging.getLogger("sprout.rl_driver")
BUDGET_KEYS = ("model_calls", "tool_calls", "tokens_in", "tokens_out", "sandbox_seconds")
ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,200}")
MARGIN, MAX_MARGIN_S = 0.2, 10.0  # a group is finished this share of its finalization (at most 10 s) early
OUT_OF_TIME = "did not finish within the group's wall time and finalization"
GROUP_STATUS = "status.json"  # in a group's directory once it ended: its status and reason (for `sprout view`)
SLOT_SEARCH = "search.json"  # in a search slot's directory: its group label and metadata.search as planned
STOP_GRACE_S = 15.0  # how long stopped samples get to end before the group is finished without them
ABANDONED = "abandoned: no client polled it for {:g} s, so its samples were stopped"


def review_client(review: ReviewConfig, key_env: str | None) -> Reviewer:
    """The reviewer of search groups, called at its configured URL with its key (or the policy's)."""
    return Reviewer(review, Endpoint(review.endpoint.rstrip("/"), key_env=review.api_key_env or key_env))


class GroupConflict(SproutError):
    """The id is taken by a group with another body, or one still being deleted (answered 409)."""


class GroupNotFound(SproutError):
    """No group has this id (answered 404)."""


class RequestRefused(SproutError):
    """A request this driver cannot serve as asked (answered 400)."""


class Driver:
    def __init__(self, config: DriverConfig, ledger: Ledger, backend: SampleBackend, *, slots: int):
        self.config, self.ledger, self.backend = config, ledger, backend
        self._samples = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="sample")
        self._stops: dict[str, threading.Event] = {}
        self._phases: dict[str, threading.Event] = {}  # each running group's samples stop when theirs is set
        self._threads: dict[str, threading.Thread] = {}
        self._polled: dict[str, float] = {}  # each running group's last POST or GET (time.monotonic())
        self._abandoned: set[str] = set()  # running groups cancelled for want of a client, still stopping
        self._lock = threading.Lock()
        self._closing = False  # shutting down: running groups stay unfinished for the next driver
        self.store = Store(runtime_bin=config.runtime_bin)  # this host's: test paths, checkpoint release
        review = config.miles.review
        self.reviewer = review_client(review, config.miles.api_key_env) if review else None  # search groups only

    def start(self) -> None:
        """Carries on every group a previous driver process left unfinished (forgets those it was
        deleting, releases those it abandoned), then watches for groups no client polls."""
        for group_id in self.ledger.unfinished():
            group = self.ledger.group(group_id)
            if group is not None and group.status == DELETING:
                self._forget(group)
            else:
                log.info("resuming group %s", group_id)
                self._launch(group_id)
        for group_id in self.ledger.abandoned():
            group = self.ledger.group(group_id)
            if group is not None and not (self.group_dir(group) / GROUP_STATUS).exists():  # killed while releasing
                self._release(group, "cancelled")
        if self.config.abandon_after_s is not None:
            threading.Thread(target=self._watch, args=(self.config.abandon_after_s,), name="abandoned-groups",
                             daemon=True).start()

    def submit(self, request: RolloutGroupRequest) -> RolloutGroupAck:
        check_servable(self.config, request)
        slots = [(s.sample_slot_id, s.sample_index) for s in request.sample_slots]
        digest = request.body_digest()
        used = request.search.roots if request.search else request.max_samples  # a search plans its branches later
        if self.ledger.add_group(request.rollout_job_id, digest, request.wire(), time.time(), slots, used=used):
            self._launch(request.rollout_job_id)
            return RolloutGroupAck(rollout_job_id=request.rollout_job_id, status="queued")
        self._poll(request.rollout_job_id)
        group = self.ledger.group(request.rollout_job_id)
        if group is None or group.status == DELETING:
            raise GroupConflict(f"group {request.rollout_job_id} is being deleted; submit it again in a moment")
        if group.digest != digest:
            raise GroupConflict(f"group {request.rollout_job_id} exists with a different request body")
        return RolloutGroupAck(rollout_job_id=group.id, status=group.status)

    def result(self, group_id: str) -> RolloutGroupResult:
        self._poll(group_id)
        return group_result(self._group(group_id))

    def delete(self, group_id: str) -> RolloutGroupAck:
        """Cancels what is unfinished and answers at once; the group is forgotten (its checkpoints
        released) as soon as its samples have stopped, each within one turn."""
        group = self._group(group_id)
        status = group.status if group.status in TERMINAL_STATUSES else "cancelled"
        self.ledger.set_status(group_id, DELETING, "deleted", time.time(), only_live=False)
        with self._lock:
            running = group_id in self._threads
            if running:
                self._stop(group_id)  # the group's thread forgets it when its samples have stopped
        if not running:
            self._forget(group)
        return RolloutGroupAck(rollout_job_id=group_id, status=status)

    def close(self) -> None:
        """Stops waiting; running groups stay unfinished in the ledger for the next driver. Samples run
        here are stopped (the next driver runs them again); Run Store jobs carry on, to be found again."""
        with self._lock:
            self._closing = True
            groups = list(self._stops)
        self.backend.close()
        if not getattr(self.backend, "detaches", False):
            with self._lock:
                for group_id in groups:
                    self._stop(group_id)
        self._samples.shutdown(wait=True, cancel_futures=True)

    @property
    def closing(self) -> bool:
        """The driver is shutting down: unfinished groups are left for the next one."""
        return self._closing

    def _poll(self, group_id: str) -> None:
        """A client asked after the group: it is not abandoned."""
        with self._lock:
            if group_id in self._polled:
                self._polled[group_id] = time.monotonic()

    def _watch(self, abandon_after_s: float) -> None:
        """Abandons every running group no client has polled for `abandon_after_s`, until the driver closes."""
        while not self._closing:
            time.sleep(min(5.0, abandon_after_s / 4))
            now = time.monotonic()
            with self._lock:
                idle = [g for g, polled in self._polled.items() if now - polled > abandon_after_s]
            for group_id in idle:
                self._abandon(group_id, abandon_after_s)

    def _abandon(self, group_id: str, abandon_after_s: float) -> None:
        """Cancels a running group (its unfinished slots failed with the reason) and stops its samples;
        its thread releases its checkpoints once they have stopped."""
        reason = ABANDONED.format(abandon_after_s)
        with self._lock:
            self._polled.pop(group_id, None)
            if not self.ledger.set_status(group_id, "cancelled", reason, time.time()):
                return  # it ended (or was deleted) meanwhile
            self.ledger.fail_unfinished_slots(group_id, reason)
            self._abandoned.add(group_id)
            self._stop(group_id)
        log.warning("group %s %s", group_id, reason)

    def _stop(self, group_id: str) -> None:
        """Stops a group and the samples it runs (the caller holds the lock)."""
        for events in (self._stops, self._phases):
            if group_id in events:
                events[group_id].set()

    def _group(self, group_id: str) -> GroupRow:
        group = self.ledger.group(group_id)
        if group is None or group.status == DELETING:
            raise GroupNotFound(f"no rollout group {group_id!r} (never accepted, or deleted)")
        return group

    def _launch(self, group_id: str) -> None:
        with self._lock:
            stop = self._stops[group_id] = threading.Event()
            self._polled[group_id] = time.monotonic()
            thread = self._threads[group_id] = threading.Thread(target=self._run_group, args=(group_id, stop),
                                                                name=f"group-{group_id[:40]}", daemon=True)
        thread.start()

    def _run_group(self, group_id: str, stop: threading.Event) -> None:
        try:
            self._run_slots(group_id, stop)
        except Exception as e:  # a bug or a lost ledger: the group fails rather than hangs
            if not self._closing:
                log.exception("group %s failed", group_id)
                self.ledger.set_status(group_id, "failed", f"driver error: {type(e).__name__}: {e}"[:500],
                                       time.time())
        finally:
            with self._lock:
                for running in (self._stops, self._phases, self._threads, self._polled):
                    running.pop(group_id, None)
                abandoned = group_id in self._abandoned
                self._abandoned.discard(group_id)
            group = self.ledger.group(group_id)
            if group is not None and group.status == DELETING:  # deleted while it ran
                self._forget(group)
            elif group is not None and abandoned and not self._closing:
                self._release(group, "cancelled")

    def _run_slots(self, group_id: str, stop: threading.Event) -> None:
        group = self.ledger.group(group_id)
        if group is None or group.status not in LIVE:
            return
        request = RolloutGroupRequest.model_validate(group.request)
        self.ledger.set_status(group_id, "running")
        task = served_task(self.config, request.task_id)
        if request.search is not None:
            from .search import SearchRun  # the search drives this driver's samples

            SearchRun(self, group, request, task, stop).run()
        else:
            deadline = group.submitted_at + request.budgets.max_wall_time_seconds
            plans = [self.plan_sample(group, request, row.position, task, deadline) for row in group.slots
                     if row.state in ("pending", "running")]
            self.run_phase(plans, stop, until=finish_by(group, request))
        stop.set()
        if not self._closing:
            self._finish(group_id, request)

    def run_phase(self, plans: list[SamplePlan], stop: threading.Event, until: float) -> None:
        """Runs `plans` at once and waits for them until `until` (or the group's stop); what still runs
        then is stopped and, within STOP_GRACE_S, listed failed."""
        phase = threading.Event()
        if plans:
            with self._lock:
                self._phases[plans[0].group_id] = phase
                if stop.is_set():
                    phase.set()
        pending = {self._samples.submit(self._run_sample, plan, phase) for plan in plans}
        while pending and not stop.is_set() and time.time() < until:
            _, pending = wait(pending, timeout=min(1.0, max(0.0, until - time.time())), return_when=FIRST_COMPLETED)
        phase.set()  # what still runs is past its time (or the group was deleted): stop it
        for future in pending:
            future.cancel()  # not started yet: it never will
        wait(pending, timeout=STOP_GRACE_S)
        if self.closing:
            return  # the next driver carries the unfinished ones on
        for plan in plans:  # a sample that did not end in time (or never started) failed
            self.ledger.fail_slot(plan.group_id, plan.generation, plan.slot.sample_slot_id, OUT_OF_TIME)

    def plan_sample(self, group: GroupRow, request: RolloutGroupRequest, position: int, task: ServedTask,
                    deadline: float, **search) -> SamplePlan:
        """The sample of the slot at `position`; `search`: a search's BranchStart and labels."""
        slot, row = request.sample_slots[position], group.slots[position]
        return SamplePlan(group_id=group.id, generation=group.submitted_at, request=request, slot=slot,
                          task_dir=task.task_dir, swe=task.swe, grade_wall_s=self.config.miles.grade_wall_seconds,
                          sample_dir=self.group_dir(group) / f"slot-{slot.sample_index}",
                          deadline_unix=deadline, key_env=self.config.miles.api_key_env, job_id=row.job_id,
                          command_timeout_s=self.config.command_timeout_s, token_limit=self.config.token_limit,
                          **search)

    def _run_sample(self, plan: SamplePlan, stop: threading.Event) -> None:
        slot_id = plan.slot.sample_slot_id
        job_id = plan.job_id

        def on_job(job: int) -> None:
            nonlocal job_id
            job_id = job
            self.ledger.set_slot(plan.group_id, plan.generation, slot_id, state="running", job_id=job)

        if stop.is_set():
            return  # the group's time is up: _finish lists it failed
        if plan.group_label is not None:
            write_atomic(plan.sample_dir / SLOT_SEARCH, json.dumps({"label": plan.group_label, "search": plan.search}))
        self.ledger.set_slot(plan.group_id, plan.generation, slot_id, state="running")
        try:
            done = self.backend.run(plan, stop, on_job)
            result = sample_result(plan, done, job_id, self.store)
        except Exception as e:
            if self._closing:
                return  # the next driver carries it on
            reason = "stopped: the group was deleted or its time ran out" if stop.is_set() else str(e)
            result = SampleResult(None, f"{type(e).__name__}: {reason}"[:500], {})
        self.ledger.set_slot(plan.group_id, plan.generation, slot_id, state="done" if result.trajectory else "failed",
                             trajectory=result.trajectory, failure=result.failure, budget=result.budget)

    def _finish(self, group_id: str, request: RolloutGroupRequest) -> None:
        """The group's terminal status: completed when every slot put to use returned (a search leaves
        the slots of branches it did not need unused, which is no failure), early_stopped when some
        failed but the minimum returned, else failed."""
        self.ledger.fail_unfinished_slots(group_id, OUT_OF_TIME)
        group = self.ledger.group(group_id)
        if group is None or group.status not in LIVE:
            return  # deleted meanwhile
        done = sum(1 for s in group.slots if s.state == "done")
        failed = [s for s in group.slots if s.state == "failed"]
        if not failed and done >= request.minimum_returned_samples:
            status, reason = "completed", None
        elif done >= request.minimum_returned_samples:
            status, reason = "early_stopped", f"{len(failed)} of {request.max_samples} samples failed"
        else:
            status = "failed"
            reason = f"{done} of {request.max_samples} samples returned, fewer than the minimum " \
                     f"{request.minimum_returned_samples}" + (f"; {failed[0].slot_id}: {failed[0].failure}"
                                                               if failed else "")
        if self.ledger.set_status(group_id, status, reason, time.time()):
            write_atomic(self.group_dir(group) / GROUP_STATUS, json.dumps({"status": status, "reason": reason}))
            log.info("group %s %s (%d of %d samples)", group_id, status, done, request.max_samples)

    def group_dir(self, group: GroupRow) -> Path:
        """The group's journals and verifier files: one directory per submission of an id."""
        return self.config.data_path / "groups" / f"{_safe(group.id)}-{int(group.submitted_at * 1000)}"

    def _forget(self, group: GroupRow) -> None:
        """Releases a deleted group's checkpoints, then its ledger rows; its journals stay."""
        self._release(group, "deleted")
        self.ledger.delete(group.id)

    def _release(self, group: GroupRow, status: str) -> None:
        """Releases a group's checkpoints (unless keep_checkpoints), as an evaluation does when it finishes,
        and records how it ended in its directory unless it ended before."""
        if not self.config.keep_checkpoints:
            from ..jobs.journals import release

            release(self.store, sorted(self.group_dir(group).glob("slot-*/journal.jsonl")))
        if self.group_dir(group).is_dir() and not (self.group_dir(group) / GROUP_STATUS).exists():
            reason = group.stop_reason if status == "cancelled" else None
            write_atomic(self.group_dir(group) / GROUP_STATUS, json.dumps({"status": status, "reason": reason}))


def finish_by(group: GroupRow, request: RolloutGroupRequest) -> float:
    """When the group is finished at the latest: a little before Miles stops waiting (submission + wall time
    + finalization, plus the search's time for a search)."""
    finalization = request.finalization_timeout_seconds
    search = request.search.search_seconds(finalization) if request.search else 0.0
    return (group.submitted_at + request.budgets.max_wall_time_seconds + finalization + search
            - min(MAX_MARGIN_S, MARGIN * finalization))


def check_servable(config: DriverConfig, request: RolloutGroupRequest) -> None:
    """Refuses what this driver cannot serve before anything is recorded: an unknown task, a search when no
    reviewer is configured, an id that cannot be addressed again, a policy endpoint that is not an http(s) URL."""
    served_task(config, request.task_id)
    if request.search is not None and config.miles.review is None:
        raise RequestRefused("Configure Sprout miles.review for search rollouts: this driver has no reviewer, "
                             "so it serves plain groups (no search) only")
    if not ID_PATTERN.fullmatch(request.rollout_job_id):
        raise RequestRefused("rollout_job_id must be 1-200 letters, digits, '.', '_', ':' or '-'")
    try:
        policy_endpoint(request.model_endpoint, None)
    except SproutError as e:
        raise RequestRefused(str(e)) from None


def group_result(group: GroupRow) -> RolloutGroupResult:
    request = group.request
    trajectories = [s.trajectory for s in group.slots if s.state == "done" and s.trajectory]
    search = request.get("search")
    if search:
        roots = [s.trajectory if s.state == "done" else None for s in group.slots[:search["roots"]]]
        annotate(trajectories, root_counts(search["roots"], roots))
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
        actual_samples=len(trajectories), trajectories=trajectories, failed_samples=failed,
        search_branches=sum(1 for t in trajectories if t["group"] not in (None, "root")),
        consumed_budget=budget, status=group.status, stop_reason=group.stop_reason)


def _safe(group_id: str) -> str:
    """A directory name for a group id (ids are the client's: keep them readable but harmless)."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in group_id)[:80].lstrip(".")
    return f"{cleaned}-{hashlib.sha256(group_id.encode()).hexdigest()[:8]}"
