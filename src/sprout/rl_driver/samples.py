"""One sample slot: a rollout of mini-swe-agent (a checkpoint per turn, a journal), graded at its end (a
Harbor task live by its verifier in its own sandbox; a SWE-rebench V2 instance in a fresh sandbox of its
image, as its official harness), run here or as a Run Store job, and turned into a trajectory.

The policy is called at the request's `model_endpoint` with the request's sampling parameters. A base
URL without a path (an SGLang or vLLM router, `http://host:30000`) gets `/v1` appended, where those
servers serve Chat Completions; a URL with a path is used as it is. The key sent with each call is the
value of the driver's configured variable (`miles.api_key_env`), never one a request names; over a
Run Store, workers call a URL a job names with no key at all (sprout.jobs.endpoints).
"""

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from harbor.models.trial.paths import EnvironmentPaths

from ..agent.journal import Journal, read_journal
from ..agent.models import Endpoint, SamplingParams
from ..agent.runner import InsertedTurn, RolloutCancelled, RolloutSpec
from ..jobs.hosts import HostImages, prepare_hosts
from ..jobs.journals import discard
from ..jobs.local import RolloutDone, RolloutRequest, rollout_here
from ..jobs.payloads import PrepareResult, RolloutResult, rollout_payload
from ..jobs.remote import submit_job, wait_job
from ..sandbox import Store
from ..sandbox.errors import CheckpointNotFound, SproutError
from ..sandbox.rootfs import O_PATH, open_in_root
from ..sandbox.slots import HostSlots, SlotWaitStopped
from ..tasks import GradeResult, load_task
from ..tasks.swe_rebench import SweRebenchRef
from .export import TOOLS_BY_MODEL_CLASS, ExportError, export_messages, journal_messages, restored_messages
from .protocol import RolloutGroupRequest, SampleSlot, prompt_message_text

MODEL_CLASS = "tools"
STOP_REASONS = {"LimitsExceeded": "max_turns_reached", "TimeExceeded": "timeout"}
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "stop", "max_new_tokens"}
log = logging.getLogger("sprout.rl_driver")
IMAGE_AFFINITY_S = 10.0  # how long a sample waits for a host holding its image (an import costs ~1.5 s)


@dataclass
class BranchStart:
    """Where a search branch starts: a turn of an earlier sample's journal (its checkpoint, on `host`), the
    continuation prompt it gets there (a training hint) and the repair turn it executes first, if any."""

    journal: Path
    turn: int
    checkpoint: str
    host: str | None
    note: str | None
    insert: InsertedTurn | None
    root_branch_id: str  # the root it descends from: the trajectory's parent_branch_id


@dataclass
class SamplePlan:
    """What one slot runs; paths are the same on every host that runs samples (a shared filesystem)."""

    group_id: str
    generation: float  # when the group was submitted: one submission of an id, apart from a later one
    request: RolloutGroupRequest
    slot: SampleSlot
    task_dir: Path | None  # a Harbor task
    swe: SweRebenchRef | None  # or a SWE-rebench V2 instance
    grade_wall_s: float  # a SWE-rebench grade's test commands, at most
    sample_dir: Path  # the journal and the verifier's files go here
    deadline_unix: float  # the agent's wall time ends here (submission + max_wall_time_seconds)
    key_env: str | None
    command_timeout_s: int
    token_limit: int
    job_id: int | None = None  # the Run Store job already running it (a restarted driver waits on it)
    branch: BranchStart | None = None  # a search branch; None: a fresh rollout
    group_label: str | None = None  # `root`, `student:<point>`, `repair:<point>:<candidate>`; None without a search
    search: dict[str, Any] | None = None  # metadata.search as planned (the outcome is added when answered)

    @property
    def attempt(self) -> str:
        key = f"{self.group_id}\n{self.generation}\n{self.slot.sample_slot_id}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        return f"rl-{digest}-{self.slot.sample_index}"

    @property
    def journal(self) -> Path:
        return self.sample_dir / "journal.jsonl"

    def rollout_request(self) -> RolloutRequest:
        wall = math.ceil(self.deadline_unix - time.time())
        if wall < 1:
            raise SproutError("the group's wall time ran out before this sample started")
        spec = RolloutSpec(task=prompt_text(self.request.prompt), model=self.request.model or "default",
                           endpoint=policy_endpoint(self.request.model_endpoint, self.key_env), journal=self.journal,
                           image=self.request.image, model_class=MODEL_CLASS, step_limit=self.request.max_turns,
                           token_limit=self.token_limit, wall_time_s=wall, command_timeout_s=self.command_timeout_s,
                           sampling=sampling_params(self.request.sampling_params))
        branch = self.branch
        if branch is None:
            return RolloutRequest(attempt=self.attempt, spec=spec, trial_dir=self.sample_dir / "trial")
        spec.from_journal, spec.from_turn, spec.note, spec.insert = branch.journal, branch.turn, branch.note, branch.insert
        return RolloutRequest(attempt=self.attempt, spec=spec, host=branch.host, checkpoint=branch.checkpoint,
                              trial_dir=self.sample_dir / "trial")


class SampleBackend(Protocol):
    """Where samples run. On close, one that `detaches` leaves its samples running (the next driver finds
    them again); the others' samples are stopped."""

    def run(self, plan: SamplePlan, stop: threading.Event, on_job: Callable[[int], None]) -> RolloutDone: ...

    def close(self) -> None: ...


class LocalSamples:
    """Samples run in this process, in this host's store, each in one of the host's slots (the agent's
    wall time is what is left of the group's once the slot is free). `store` should have an owner: what a
    sample makes belongs to this process until the sample finishes, so the sandboxes and checkpoints of a
    killed driver's unfinished samples (a snapshot not yet journaled included) are reaped by the next
    one's gc."""

    def __init__(self, store: Store):
        self.store = store
        self.slots = HostSlots(store.root)

    def run(self, plan: SamplePlan, stop: threading.Event, on_job: Callable[[int], None]) -> RolloutDone:
        if plan.journal.exists():  # a sample the previous driver process did not finish: start it again
            discard(self.store, plan.journal)
        try:
            with self.slots.hold(stop):
                task = load_task(plan.task_dir) if plan.swe is None and plan.task_dir is not None else None
                done = rollout_here(self.store, plan.rollout_request(), task=task, swe=plan.swe,
                                    grade_wall_s=plan.grade_wall_s, stop=stop)
        except SlotWaitStopped:
            raise RolloutCancelled("stopped while waiting for a free slot on this host") from None
        self.store.adopt(done.checkpoints)
        return done

    def close(self) -> None:
        pass


class RunStoreSamples:
    """Samples as Run Store rollout jobs. A restarted driver waits on a slot's recorded job, or finds it
    by its idempotency key, instead of submitting a second one; closing detaches from the jobs (they run
    on, for the next driver) rather than cancelling them."""

    detaches = True  # on close: its jobs run on, for the next driver

    def __init__(self, client, wait_s: float, backend: str, branch_affinity_s: float):
        """`branch_affinity_s`: how long a branch job waits for the host that holds its checkpoint before
        another host may take it (and fetch the checkpoint from there)."""
        self.client, self.wait_s, self.backend = client, wait_s, backend
        self.branch_affinity_s = branch_affinity_s
        self.detach = threading.Event()
        self.images = HostImages()  # which hosts hold which task's image: a sample prefers those

    def prepare(self, tasks: list[Path]) -> None:
        """Imports the tasks' images on every live worker host, in the background; hosts that report them
        ready are preferred for those tasks' samples from then on."""
        def run() -> None:
            def report(result: PrepareResult) -> None:
                self.images.add(result)
                log.info("host %s: %d task image(s) ready, %d failed%s", result.host, len(result.ready),
                         len(result.failed), "".join(f"; {Path(t).name}: {p}" for t, p in result.failed.items()))
            try:
                prepare_hosts(self.client, tasks, on_host=report)
            except SproutError as e:
                log.warning("could not prepare the task images on the workers' hosts: %s", e)

        if tasks:
            threading.Thread(target=run, name="prepare-hosts", daemon=True).start()

    def run(self, plan: SamplePlan, stop: threading.Event, on_job: Callable[[int], None]) -> RolloutDone:
        if plan.job_id is not None:
            job = self.client.get(plan.job_id)
        else:
            payload = rollout_payload(plan.rollout_request(), plan.task_dir, deadline_unix=plan.deadline_unix,
                                      swe=plan.swe, grade_wall_s=plan.grade_wall_s, backend=self.backend)
            # a branch goes where its checkpoint is (else it is shipped), a sample where its image is
            if plan.branch and plan.branch.host:
                affinity: dict[str, Any] = {"host": plan.branch.host,
                                             "affinity_timeout_s": self.branch_affinity_s}
            else:
                host = self.images.host_for(plan.task_dir) if plan.task_dir else None
                affinity = {"host": host, "affinity_timeout_s": IMAGE_AFFINITY_S} if host else {}
            job = submit_job(self.client, payload, group_id=plan.group_id[:200], idempotency_key=plan.attempt,
                             **affinity)
            on_job(job.id)
        result = wait_job(self.client, job, wait_s=self.wait_s, stop=stop, detach=self.detach)
        return RolloutResult.model_validate(result).done()

    def close(self) -> None:
        self.detach.set()


def policy_endpoint(url: str, key_env: str | None) -> Endpoint:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise SproutError(f"model_endpoint must be an http(s) URL, got {url!r}")
    if urlsplit(url).path in ("", "/"):
        url += "/v1"
    return Endpoint(url, key_env=key_env)


def sampling_params(params: dict[str, Any]) -> SamplingParams:
    """Miles' sampling_params as sent: max_new_tokens is each call's completion limit; keys beyond the
    usual ones go in the request body as they are."""
    extra = {k: v for k, v in params.items() if k not in SAMPLING_KEYS}
    return SamplingParams(temperature=params.get("temperature"), top_p=params.get("top_p"),
                          top_k=params.get("top_k"), stop=params.get("stop"),
                          max_tokens=params.get("max_new_tokens"), extra_body=extra)


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """The task the agent is given: the prompt string, or its user messages' text (the protocol admits no
    other), one paragraph each."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(prompt_message_text(message) for message in prompt)


@dataclass
class SampleResult:
    trajectory: dict[str, Any] | None
    failure: str | None
    budget: dict[str, float]


def sample_result(plan: SamplePlan, done: RolloutDone, job_id: int | None, store: Store) -> SampleResult:
    """The slot's trajectory (or why there is none) from its journal and its grade; `store`: this host's,
    where the graded checkpoint is looked up for the test paths it touched. The grade is kept beside the
    journal (`grade.json`: a search reviews a failed sample with its grader's output)."""
    journal = read_journal(plan.journal)
    if done.grade is not None:
        (plan.sample_dir / "grade.json").write_text(done.grade.model_dump_json())
    budget = _budget(journal, done.grade)
    outcome = done.outcome
    status, stop_reason = "completed", None
    if outcome.exit_status != "Submitted":
        status, stop_reason = "truncated", STOP_REASONS.get(outcome.exit_status, "interrupted")
    calls = journal.turns[-1].n_calls if journal.turns else journal.header.n_calls  # a branch's prefix included
    if stop_reason == "max_turns_reached" and calls < plan.request.max_turns:
        stop_reason = "interrupted"  # the token limit, not max_turns
    if stop_reason == "interrupted" and not journal.turns:
        return SampleResult(None, f"actor failed: {outcome.exit_status}: {outcome.message}"[:500], budget)
    try:
        exported = export_messages(journal_messages(journal), prefix=restored_messages(journal))
    except ExportError as e:
        return SampleResult(None, f"actor failed: {e}"[:500], budget)
    reward, zero_reason = _reward(done.grade)
    if plan.search is not None and zero_reason is None:
        reward = 1.0 if reward >= 1 else 0.0  # a search's credit takes a verdict: pass (reward >= 1) or not
    metadata = {
        "job_id": job_id, "attempt_id": plan.attempt, "task_id": plan.request.task_id,
        "source_image": plan.request.image, "graded_snapshot_id": outcome.final_checkpoint,
        "checkpoints": [t.checkpoint for t in journal.turns], "host": done.host, "journal": str(plan.journal),
        "provenance": {"prefix_messages": exported.prefix_messages, "inserted_messages": exported.inserted_messages},
        "search": plan.search, "zero_reason": zero_reason, "exit_status": outcome.exit_status,
        "touched_test_paths": done.grade.touched_test_paths if done.grade and plan.swe else
        touched_test_paths(store, plan.task_dir, outcome.final_checkpoint),
        "grade": None if done.grade is None else {"verdict": done.grade.verdict, "mode": done.grade.mode,
                                                  "reward": done.grade.reward, "error": done.grade.error},
    }
    trajectory = {"sample_slot_id": plan.slot.sample_slot_id, "branch_id": plan.attempt,
                  "parent_branch_id": plan.branch.root_branch_id if plan.branch else None, "group": plan.group_label,
                  "messages": exported.messages, "tools": TOOLS_BY_MODEL_CLASS[MODEL_CLASS], "reward": reward,
                  "status": status, "stop_reason": stop_reason, "hints_removed": True, "metadata": metadata}
    return SampleResult(trajectory, None, budget)


def touched_test_paths(store: Store, task_dir: Path | None, checkpoint_id: str | None) -> list[str] | None:
    """The task's test files (Harbor copies tests/ to /tests only to grade) that the graded state
    already had at their paths: what the agent wrote where the tests go. None when that state is not
    in this host's store (a Run Store worker elsewhere graded it), or a microVM's: its files are inside
    its disk image, which the host does not parse (the guest made it)."""
    if checkpoint_id is None or task_dir is None:
        return None
    try:
        checkpoint = store.checkpoint(checkpoint_id)
    except CheckpointNotFound:
        return None
    if not checkpoint.has_host_files:
        return None
    root = checkpoint.rootfs
    tests = load_task(task_dir).paths.tests_dir
    paths = sorted(str(EnvironmentPaths.tests_dir / f.relative_to(tests)) for f in tests.rglob("*") if f.is_file())
    return [path for path in paths if _exists_in(root, path)]


def _exists_in(root: Path, path: str) -> bool:
    try:
        os.close(open_in_root(root, path, O_PATH))
    except OSError:
        return False
    return True


def _reward(grade: GradeResult | None) -> tuple[float, str | None]:
    """The reward, and why it is a placeholder 0 when the grade gave no verdict."""
    if grade is None:
        return 0.0, "not_graded"
    if grade.verdict == "error" or grade.reward is None:
        return 0.0, "grade_failed"
    return float(grade.reward), None


def _budget(journal: Journal, grade: GradeResult | None) -> dict[str, float]:
    """What the sample consumed: model and tool calls, tokens, and the seconds its sandboxes ran."""
    turns = journal.turns
    outcome = journal.outcome
    agent_s = outcome.wall_s if outcome else 0.0
    return {"model_calls": (turns[-1].n_calls - journal.header.n_calls) if turns else 0,
            "tool_calls": sum(len(t.commands) for t in turns),
            "tokens_in": sum(t.tokens_in for t in turns), "tokens_out": sum(t.tokens_out for t in turns),
            "sandbox_seconds": round(agent_s + (grade.duration_s if grade else 0.0), 3)}
