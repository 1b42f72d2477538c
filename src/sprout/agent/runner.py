"""One rollout: mini-swe-agent's DefaultAgent in a sandbox, a checkpoint and a journal line per turn.

The agent is unmodified; two of its documented extension points are used:
`save()`, which DefaultAgent.run() calls after every iteration, is the per-turn hook, and the one
`add_messages(system, instance)` call at the start of run() is where a resumed rollout swaps in the
messages up to the turn it branches from, so the stock loop runs unchanged.
"""

import copy
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from minisweagent.agents.default import DefaultAgent
from minisweagent.exceptions import LimitsExceeded
from pydantic import BaseModel, ConfigDict

from ..sandbox import Checkpoint, Sandbox, Store
from ..sandbox.diff import ChangeSummary
from ..sandbox.errors import CheckpointNotFound, SproutError
from . import defaults
from .environment import SandboxEnvironment
from .journal import OBSERVATION_CAP, Header, JournalWriter, Limits, Outcome, ParentRef, Turn, read_journal
from .models import Endpoint, SamplingParams, make_model, mswea_config

log = logging.getLogger("sprout.agent")

#: Marks, in a journal, an assistant message no model call produced (``extra[INSERTED]`` is true).
INSERTED = "sprout_inserted"


class InsertedTurn(BaseModel):
    """An assistant turn written outside the policy (a reviewer's repair): a branch executes it as its first
    turn, in the sandbox, before the policy is called; it is journaled like any turn and is no model call."""

    model_config = ConfigDict(extra="forbid")

    reasoning: str
    command: str
    call_id: str
    content: str = ""

    def message(self) -> dict:
        """The assistant message as mini-swe-agent's tool-calling model would have returned it."""
        call = {"id": self.call_id, "type": "function",
                "function": {"name": "bash", "arguments": json.dumps({"command": self.command})}}
        return {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning,
                "tool_calls": [call],
                "extra": {"actions": [{"command": self.command, "tool_call_id": self.call_id}], INSERTED: True}}


@dataclass
class RolloutSpec:
    task: str
    model: str
    endpoint: Endpoint
    journal: Path
    image: str = defaults.IMAGE
    cwd: str = "/tmp"
    model_class: str = "tools"
    step_limit: int = defaults.STEP_LIMIT
    token_limit: int = defaults.TOKEN_LIMIT
    wall_time_s: int = defaults.WALL_TIME_S
    command_timeout_s: int = defaults.COMMAND_TIMEOUT_S
    keep_sandbox: bool = False
    sampling: SamplingParams | None = None  # sent with every model call
    # branching
    from_journal: Path | None = None
    from_turn: int | None = None
    note: str | None = None
    insert: InsertedTurn | None = None  # a branch's first turn, executed before the policy is called


@dataclass
class TurnEvent:
    turn: Turn
    total_tokens: int


@dataclass
class RolloutResult:
    outcome: Outcome
    journal: Path
    sandbox_id: str
    checkpoints: list[str] = field(default_factory=list)


def _usage(message: dict) -> tuple[int, int]:
    usage = (message.get("extra", {}).get("response") or {}).get("usage") or {}
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def _cap(text: str) -> str:
    return text if len(text) <= OBSERVATION_CAP else text[:OBSERVATION_CAP] + f"\n[... {len(text) - OBSERVATION_CAP} chars]"


class RolloutCancelled(SproutError):
    """The rollout was told to stop (a cancelled job, a lost lease, a draining worker): no outcome."""


class JournalingAgent(DefaultAgent):
    """DefaultAgent plus a per-turn callback, a token limit, a stop flag checked before every model call,
    and resume from saved messages."""

    def __init__(self, *args, on_start: Callable[["JournalingAgent"], None],
                 on_turn: Callable[["JournalingAgent", list[dict]], None], token_limit: int,
                 stop: threading.Event | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_start, self.on_turn, self.stop = on_start, on_turn, stop
        self._started = False
        self.token_limit = token_limit
        self.tokens = 0
        self.model_latency = 0.0
        self._journaled = 0  # messages already journaled
        self._resume_messages: list[dict] | None = None
        self.inserted: dict | None = None  # answered instead of the first model call

    def query(self) -> dict:
        if self.stop is not None and self.stop.is_set():
            raise RolloutCancelled("the rollout was stopped")
        if self.inserted is not None:
            message, self.inserted = self.inserted, None
            self.add_messages(message)
            return message
        if 0 < self.token_limit <= self.tokens:
            raise LimitsExceeded({"role": "exit", "content": "LimitsExceeded",
                                  "extra": {"exit_status": "LimitsExceeded", "submission": ""}})
        started = time.monotonic()
        try:
            message = super().query()
        finally:
            self.model_latency += time.monotonic() - started
        self.tokens += sum(_usage(message))
        return message

    def save(self, path, *extra_dicts):
        data = super().save(path, *extra_dicts)
        new = self.messages[self._journaled:]
        if new and self._started:
            self._journaled = len(self.messages)
            self.on_turn(self, new)
        return data

    def add_messages(self, *messages: dict) -> list[dict]:
        if self._started:
            return super().add_messages(*messages)
        # run()'s one add_messages(system, instance) call: a resumed rollout swaps in its messages
        if self._resume_messages is not None:
            self.messages, self._resume_messages = self._resume_messages, None
            added = list(self.messages)
        else:
            added = super().add_messages(*messages)
        self._started = True
        self._journaled = len(self.messages)
        self.on_start(self)
        return added

    def resume_with(self, messages: list[dict], n_calls: int) -> None:
        self._resume_messages = messages
        self.n_calls = n_calls


def resume_messages(messages: list[dict], model, note: str | None) -> list[dict]:
    """The messages to continue from: a trailing exit reopened, open tool calls answered, the note added."""
    messages = copy.deepcopy(messages)
    if messages and messages[-1].get("role") == "exit":
        messages.pop()
        last = messages[-1] if messages else {}
        if last.get("role") == "assistant" and last.get("extra", {}).get("actions"):
            messages += model.format_observation_messages(last, [], {})
    if note:
        messages.append(model.format_message(role="user", content=note))
    return messages


def _outcome_status(exit_status: str) -> str:
    if exit_status == "Submitted":
        return "submitted"
    if exit_status in ("LimitsExceeded", "TimeExceeded", "RepeatedFormatError"):
        return "limits_exceeded"
    return "error"


@dataclass
class _Start:
    """Where a rollout starts: its sandbox, and for a branch the messages, model calls and turn it resumes at."""

    sandbox: Sandbox
    prefix: list[dict] | None = None
    n_calls: int = 0
    first_turn: int = 1
    parent: ParentRef | None = None


def run_rollout(spec: RolloutSpec, store: Store, on_event: Callable[[TurnEvent], None] | None = None,
                sandbox: Sandbox | None = None, stop: threading.Event | None = None,
                on_finish: Callable[[Sandbox, Outcome], None] | None = None) -> RolloutResult:
    """Runs (or resumes) one rollout, journaling every turn; the sandbox is destroyed at the end
    unless `keep_sandbox` (its checkpoints stay). `on_finish` is called with the live sandbox once the
    outcome is journaled, before the sandbox goes (live grading). When `stop` is set the rollout ends
    before its next model call with RolloutCancelled, its journal left without an outcome."""
    config = mswea_config(spec.model_class)
    model = make_model(spec.model, spec.endpoint, spec.model_class, config, spec.sampling)
    start = _start(spec, store, model, sandbox)
    env = SandboxEnvironment(start.sandbox, **(config.get("environment", {}) | {
        "cwd": spec.cwd, "timeout": spec.command_timeout_s}))
    try:
        writer = JournalWriter(spec.journal)
    except SproutError:
        start.sandbox.destroy()
        raise
    result = RolloutResult(outcome=None, journal=spec.journal, sandbox_id=start.sandbox.id)  # type: ignore[arg-type]
    recorder = _TurnRecorder(writer, env, start, result, on_event, _header(spec, store, start))
    agent = JournalingAgent(model, env, on_start=recorder.start, on_turn=recorder.turn, token_limit=spec.token_limit,
                            stop=stop, step_limit=spec.step_limit, cost_limit=0, wall_time_limit_seconds=spec.wall_time_s,
                            **{k: v for k, v in config["agent"].items()
                               if k in ("system_template", "instance_template", "max_consecutive_format_errors")})
    if start.prefix is not None:
        agent.resume_with(start.prefix, start.n_calls)
    if spec.insert is not None:
        agent.inserted = spec.insert.message()
    started = time.monotonic()
    try:
        result.outcome = recorder.outcome(*_run(agent, spec.task), wall_s=time.monotonic() - started)
        writer.write(result.outcome)
        if on_finish is not None:
            on_finish(start.sandbox, result.outcome)
    finally:
        writer.close()
        if not spec.keep_sandbox:
            start.sandbox.destroy()
    return result


def _run(agent: "JournalingAgent", task: str) -> tuple[str, str, str]:
    """The agent's run: (exit status, message, submission). A stopped rollout raises RolloutCancelled; any
    other failure is the outcome (the agent already appended an exit message and journaled the turn)."""
    try:
        info = agent.run(task)
    except RolloutCancelled:
        raise
    except Exception as e:
        return type(e).__name__, _error_text(e), ""
    return info.get("exit_status", ""), info.get("exception_str", ""), info.get("submission", "") or ""


def _start(spec: RolloutSpec, store: Store, model, sandbox: Sandbox | None) -> _Start:
    """A fresh start (in `sandbox`, else a new sandbox of the spec's image) or a branch: a new sandbox from the
    parent turn's checkpoint with the messages up to that turn (and the note). Refuses, before any sandbox is
    made, a journal that exists and an inserted turn without a tool-calling branch."""
    parent_journal = read_journal(spec.from_journal) if spec.from_journal is not None else None
    if spec.insert is not None and (parent_journal is None or spec.model_class != "tools"):
        raise SproutError("an inserted turn needs a branch (from_journal) of a tool-calling rollout")
    if spec.journal.exists():  # checked before a sandbox is made; JournalWriter checks again atomically
        raise SproutError(f"the journal {spec.journal} already exists; choose another path or remove it")
    if parent_journal is None:
        return _Start(sandbox or store.create_sandbox(spec.image, network=True, label=f"rollout {spec.journal.name}"))
    if spec.from_turn is None:
        raise SproutError(f"a branch of {spec.from_journal} needs the turn it starts from")
    turn = parent_journal.turn(spec.from_turn)
    if turn.checkpoint is None:
        raise SproutError(f"turn {turn.turn} of {spec.from_journal} has no checkpoint")
    try:
        checkpoint = store.checkpoint(turn.checkpoint)
    except CheckpointNotFound:
        header = parent_journal.header
        made = header.store + (f" on {header.host}" if header.host else "")
        raise SproutError(f"turn {turn.turn}'s checkpoint {turn.checkpoint} is not in the store {store.root} "
                          f"(it was made in {made}); use that store, or ship the checkpoint here "
                          "(sprout.sandbox.ship)") from None
    spec.task = parent_journal.header.task
    return _Start(checkpoint.branch(label=f"branch of {turn.checkpoint}"),
                  prefix=resume_messages(parent_journal.messages_up_to(turn.turn), model, spec.note),
                  n_calls=turn.n_calls, first_turn=turn.turn + 1,
                  parent=ParentRef(journal=str(spec.from_journal), turn=turn.turn, checkpoint=turn.checkpoint,
                                   note=spec.note))


def _header(spec: RolloutSpec, store: Store, start: _Start) -> Header:
    return Header(task=spec.task, model=spec.model, model_class=spec.model_class, endpoint_host=spec.endpoint.host,
                  image=spec.image, image_key=start.sandbox.image_key, cwd=spec.cwd,
                  limits=Limits(step_limit=spec.step_limit, token_limit=spec.token_limit,
                                wall_time_s=spec.wall_time_s, command_timeout_s=spec.command_timeout_s),
                  store=str(store.root), sandbox=start.sandbox.id, parent=start.parent, first_turn=start.first_turn,
                  n_calls=start.n_calls, messages=start.prefix or [],
                  sampling=spec.sampling.model_dump(exclude_defaults=True) if spec.sampling else None)


class _TurnRecorder:
    """The agent's per-turn hook: checkpoints the sandbox, journals the turn, tells `on_event`."""

    def __init__(self, writer: JournalWriter, env: SandboxEnvironment, start: _Start, result: RolloutResult,
                 on_event: Callable[[TurnEvent], None] | None, header: Header):
        self.writer, self.env, self.start_at, self.result, self.on_event = writer, env, start, result, on_event
        self.header = header
        self.tokens_in = self.tokens_out = 0
        self.turn_number = start.first_turn - 1

    def start(self, agent: "JournalingAgent") -> None:
        """Once the agent has its first messages: the header, with them."""
        self.header.messages = list(agent.messages)
        self.writer.write(self.header)

    def turn(self, agent: "JournalingAgent", new: list[dict]) -> None:
        if not any(m.get("role") in ("assistant", "user", "tool") for m in new):
            return  # an iteration that only ended the run (limits): nothing happened in the sandbox
        self.turn_number += 1
        assistant = next((m for m in new if m.get("role") == "assistant"), {})
        observations = [m for m in new if m.get("role") in ("tool", "user")]
        returncodes = [m.get("extra", {}).get("returncode") for m in observations]
        tokens_in, tokens_out = _usage(assistant)
        self.tokens_in, self.tokens_out = self.tokens_in + tokens_in, self.tokens_out + tokens_out
        checkpoint = self.start_at.sandbox.checkpoint(label=f"turn {self.turn_number}")
        self.result.checkpoints.append(checkpoint.id)
        changes = _turn_changes(self.start_at.sandbox, checkpoint)
        exit_message = next((m for m in new if m.get("role") == "exit"), None)
        observation = "\n".join(str(m.get("extra", {}).get("raw_output", m.get("content", ""))) for m in observations)
        if exit_message and not observation:
            observation = str(exit_message.get("content", ""))
        record = Turn(turn=self.turn_number, checkpoint=checkpoint.id, thought=str(assistant.get("content") or ""),
                      commands=[a.get("command", "") for a in assistant.get("extra", {}).get("actions", [])],
                      observation=_cap(observation),
                      exit_code=next((rc for rc in reversed(returncodes) if rc is not None), None),
                      tokens_in=tokens_in, tokens_out=tokens_out, model_latency_s=round(agent.model_latency, 4),
                      command_s=round(self.env.command_seconds, 4), checkpoint_ms=round(checkpoint.duration_ms or 0, 2),
                      n_calls=agent.n_calls, changes=changes, new_messages=new)
        agent.model_latency, self.env.command_seconds = 0.0, 0.0
        self.writer.write(record)
        if self.on_event:
            self.on_event(TurnEvent(record, self.tokens_in + self.tokens_out))

    def outcome(self, exit_status: str, message: str, submission: str, *, wall_s: float) -> Outcome:
        checkpoints, parent = self.result.checkpoints, self.start_at.parent
        return Outcome(status=_outcome_status(exit_status), exit_status=exit_status, message=message,
                       submission=submission, turns=self.turn_number - self.start_at.first_turn + 1,
                       tokens_in=self.tokens_in, tokens_out=self.tokens_out, wall_s=round(wall_s, 3),
                       final_checkpoint=checkpoints[-1] if checkpoints else (parent.checkpoint if parent else None))


def _turn_changes(sandbox: Sandbox, checkpoint: Checkpoint) -> ChangeSummary | None:
    """What the turn changed on disk, from the previous checkpoint (or the image, on a fresh start's first
    turn). None for a microVM (its disks are read by guests booted for the diff: seconds, so on demand only)
    or where the store could not tell: a summary never fails a turn."""
    if not checkpoint.has_host_files:
        return None
    try:
        return sandbox.store.diff(checkpoint.parent or checkpoint.image_key, checkpoint.id, content=False).summary()
    except (SproutError, OSError) as e:
        log.warning("no change summary for %s: %s", checkpoint.id, e)
        return None


def _error_text(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:500]
