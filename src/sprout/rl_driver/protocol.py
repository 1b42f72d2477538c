"""The wire between Miles's rollout client and Sprout's RL driver (``/rollout-groups``).

There is no version tag: both sides refuse unknown fields, so every model here is
``extra="forbid"`` and frozen, and a key either side adds without the other fails
the group instead of vanishing from training data. ``request.example.json`` and
``result.example.json`` beside this module are the shared examples; Miles keeps
byte copies of them.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

#: A string with at least one non-whitespace character.
NonEmpty = Annotated[str, StringConstraints(strict=True, pattern=r"\S")]
Count = Annotated[StrictInt, Field(ge=0)]
Positive = Annotated[StrictInt, Field(gt=0)]
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Seconds = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]

GroupStatus = Literal["queued", "running", "completed", "early_stopped", "failed", "cancelled"]
#: Group statuses the driver never leaves.
TERMINAL_STATUSES: frozenset[str] = frozenset({"completed", "early_stopped", "failed", "cancelled"})
TrajectoryStatus = Literal["completed", "truncated"]
StopReason = Literal["max_turns_reached", "timeout", "interrupted"]

#: Sprout wraps each branch continuation prompt in these and strips the span from
#: user and system messages at export; a trajectory still carrying one is refused.
HINT_OPEN = "<sprout_training_hint>"
HINT_CLOSE = "</sprout_training_hint>"
# A span runs to its close tag, or to the end when the close is missing: an unclosed hint is still a hint.
_HINT_SPAN = re.compile(re.escape(HINT_OPEN) + ".*?(?:" + re.escape(HINT_CLOSE) + r"|\Z)", re.DOTALL)

ROLES = frozenset({"system", "user", "assistant", "tool"})
MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "reasoning_content", "name"})


class Strict(BaseModel):
    """Unknown fields are errors and instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SampleSlot(Strict):
    """A place Miles allocated for one returned trajectory."""

    sample_slot_id: NonEmpty
    sample_index: Count


class Budgets(Strict):
    """Execution wall time, counted from submission (queueing included)."""

    max_wall_time_seconds: Seconds


class SearchSpec(Strict):
    """Branches Sprout may run after the roots, by outcome (``outcome.search_outcome``)."""

    roots: Positive
    points: Positive
    candidates: Count
    student_continuations: Positive
    candidate_continuations: Count
    tf_student_continuations: Count
    repair_rounds: Positive
    review_seconds: Seconds
    wall_time_seconds: Seconds

    @model_validator(mode="after")
    def _check(self) -> SearchSpec:
        if (self.candidates == 0) != (self.candidate_continuations == 0):
            raise ValueError("candidates and candidate_continuations must both be zero or both be positive")
        if self.repair_rounds > 1 and (self.candidates, self.candidate_continuations) != (1, 1):
            raise ValueError("repair_rounds > 1 requires candidates == 1 and candidate_continuations == 1")
        return self

    def branches(self) -> int:
        """The most branches any outcome makes: every root failed (FF) or all but one (TF, FF_partial)."""
        every_root_failed = self.roots * (
            self.student_continuations + self.candidates * self.candidate_continuations * self.repair_rounds
        )
        all_but_one = (self.roots - 1) * self.tf_student_continuations
        return self.points * max(every_root_failed, all_but_one)

    def search_seconds(self, finalization_seconds: float) -> float:
        """Time after the roots: each round's review and branches, and a grade for all rounds but the last."""
        rounds = self.repair_rounds if self.candidates > 0 else 1
        return rounds * (self.review_seconds + self.wall_time_seconds) + (rounds - 1) * finalization_seconds


def prompt_message_text(message: dict[str, Any]) -> str:
    """A prompt message's text: its string content, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content or [] if isinstance(part, dict))


class RolloutGroupRequest(Strict):
    """``POST /rollout-groups``: one prompt group, its slots and budgets, and optionally a search."""

    rollout_job_id: NonEmpty
    rollout_id: Count
    prompt_group_id: NonEmpty
    task_id: NonEmpty
    image: NonEmpty
    prompt: (
        Annotated[str, StringConstraints(strict=True, min_length=1)]
        | Annotated[list[dict[str, Any]], Field(min_length=1)]
    )
    model_endpoint: NonEmpty
    model: NonEmpty | None
    sample_slots: Annotated[list[SampleSlot], Field(min_length=1)]
    max_samples: Positive
    minimum_returned_samples: Positive
    #: Model calls per trajectory; tool calls are free.
    max_turns: Positive
    #: Time after the execution deadline for the final snapshot, the export and grading.
    finalization_timeout_seconds: Seconds = 1800.0
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    budgets: Budgets
    search: SearchSpec | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        """The prompt is the task statement the agent is given, framed by the agent's own system message and
        task template (its bash tool, how to submit): a string, or user messages of text. Anything else in
        it would not reach the policy, so it is refused rather than dropped unseen."""
        if isinstance(prompt, str):
            return prompt
        for index, message in enumerate(prompt):
            role = message.get("role")
            if not (isinstance(role, str) and role):
                raise ValueError("every prompt message needs a role")
            if role != "user":
                raise ValueError(
                    f"message {index} is a {role!r} message: the prompt is the task, as user messages; the "
                    "conversation's system message is the agent's own (its tool and how to submit) and the "
                    "trajectory returned shows it"
                )
            content = message.get("content")
            if not isinstance(content, str) and not (
                isinstance(content, list)
                and all(isinstance(part, dict) and part.get("type") == "text" for part in content)
            ):
                raise ValueError(f"message {index}: its content must be text (a string, or parts of type text)")
            if not prompt_message_text(message).strip():
                raise ValueError(f"message {index} has no text")
        return prompt

    @model_validator(mode="after")
    def _check(self) -> RolloutGroupRequest:
        slots = self.sample_slots
        if len({slot.sample_slot_id for slot in slots}) != len(slots):
            raise ValueError("sample_slot_id values must be unique")
        if len({slot.sample_index for slot in slots}) != len(slots):
            raise ValueError("sample_index values must be unique")
        if not self.minimum_returned_samples <= self.max_samples <= len(slots):
            raise ValueError("expected minimum_returned_samples <= max_samples <= len(sample_slots)")
        if self.search is not None:
            if self.minimum_returned_samples > self.search.roots:
                raise ValueError("with a search, minimum_returned_samples must not exceed search.roots")
            if self.max_samples < self.search.roots + self.search.branches():
                raise ValueError(
                    f"max_samples {self.max_samples} is below search.roots + search.branches() = "
                    f"{self.search.roots + self.search.branches()}"
                )
        return self

    def wire(self) -> dict[str, Any]:
        """The JSON body, with ``search`` left out when there is none."""
        body = self.model_dump(mode="json")
        if body["search"] is None:
            del body["search"]
        return body

    def body_digest(self) -> str:
        """SHA-256 of the canonical JSON of ``wire()``: equal bodies, equal digests (idempotent re-POSTs)."""
        canonical = json.dumps(self.wire(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


class RolloutGroupAck(Strict):
    """What ``POST`` and ``DELETE /rollout-groups`` answer."""

    rollout_job_id: NonEmpty
    status: GroupStatus


def _check_tool_call(call: Any, seen: set[str]) -> str:
    """Checks one assistant tool call and returns its id."""
    if not isinstance(call, dict) or set(call) != {"id", "type", "function"}:
        raise ValueError("a tool call has exactly the keys id, type and function")
    identifier, function = call["id"], call["function"]
    if not isinstance(identifier, str) or not identifier:
        raise ValueError("a tool call needs a non-empty id")
    if identifier in seen:
        raise ValueError(f"tool call id {identifier!r} is used twice")
    if call["type"] != "function":
        raise ValueError(f"tool call {identifier!r} has type {call['type']!r}, not 'function'")
    if not isinstance(function, dict) or set(function) != {"name", "arguments"}:
        raise ValueError(f"tool call {identifier!r}: function has exactly the keys name and arguments")
    if not isinstance(function["name"], str) or not function["name"]:
        raise ValueError(f"tool call {identifier!r} needs a function name")
    arguments = function["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise ValueError(f"tool call {identifier!r}: arguments are not JSON") from error
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call {identifier!r}: arguments must decode to a JSON object")
    return identifier


def check_messages(messages: Any) -> None:
    """Raises ValueError unless ``messages`` is a hint-free chat Miles can render and train on."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("a trajectory needs at least one message")
    pending: set[str] = set()
    seen: set[str] = set()
    for position, message in enumerate(messages):
        where = f"message {position}"
        if not isinstance(message, dict):
            raise ValueError(f"{where} is not an object")
        if unknown := set(message) - MESSAGE_KEYS:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where} has role {role!r}; expected one of {sorted(ROLES)}")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"{where}: content must be a string or null, not {type(content).__name__}")
        if "reasoning_content" in message and not isinstance(message["reasoning_content"], str):
            raise ValueError(f"{where}: reasoning_content must be a string (omit it rather than send null)")
        if "name" in message and not isinstance(message["name"], str):
            raise ValueError(f"{where}: name must be a string")
        if role in ("user", "system") and content and (HINT_OPEN in content or HINT_CLOSE in content):
            raise ValueError(f"{where} ({role}) still carries a training hint marker")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ValueError(f"{where}: only assistant messages carry tool_calls")
            if not isinstance(calls, list):
                raise ValueError(f"{where}: tool_calls must be a list")
            for call in calls:
                identifier = _check_tool_call(call, seen)
                seen.add(identifier)
                pending.add(identifier)
        if role == "tool":
            answered = message.get("tool_call_id")
            if answered not in pending:
                raise ValueError(f"{where} answers {answered!r}, which is no pending tool call")
            pending.remove(answered)
        elif "tool_call_id" in message:
            raise ValueError(f"{where}: only tool messages carry tool_call_id")
    if pending:
        raise ValueError(f"tool calls {sorted(pending)} are never answered")
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError("a trajectory needs at least one assistant message")


class Provenance(Strict):
    """Which messages no policy sampled: the restored prefix (a count) and inserted assistant turns."""

    prefix_messages: Count
    inserted_messages: list[Count]


class Trajectory(Strict):
    """One returned rollout: hint-free messages, the verdict as ``reward``, and Sprout's metadata."""

    sample_slot_id: NonEmpty
    branch_id: NonEmpty
    parent_branch_id: NonEmpty | None = None
    #: ``root``, ``student:<point>`` or ``repair:<point>:<candidate>`` in a search; None without one.
    group: NonEmpty | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = Field(default_factory=list)
    reward: FiniteFloat
    status: TrajectoryStatus
    stop_reason: StopReason | None = None
    hints_removed: Literal[True]
    metadata: dict[str, Any]

    @field_validator("hints_removed", mode="before")
    @classmethod
    def _literally_true(cls, value: Any) -> Any:
        if value is not True:
            raise ValueError("hints_removed must be literally true")
        return value

    @model_validator(mode="after")
    def _check(self) -> Trajectory:
        if (self.status == "completed") != (self.stop_reason is None):
            raise ValueError("stop_reason is null exactly when status is 'completed'")
        check_messages(self.messages)
        if "provenance" not in self.metadata:
            raise ValueError("metadata.provenance is required")
        try:
            provenance = Provenance.model_validate(self.metadata["provenance"])
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '-'}: {e['msg']}" for e in error.errors())
            raise ValueError(f"metadata.provenance is invalid: {problems}") from None
        count = len(self.messages)
        if provenance.prefix_messages > count:
            raise ValueError(f"provenance prefix_messages {provenance.prefix_messages} > {count} messages")
        for index in provenance.inserted_messages:
            if index >= count or self.messages[index]["role"] != "assistant":
                raise ValueError(f"provenance inserted_messages: message {index} is not an assistant message")
        return self


class FailedSample(Strict):
    """A slot whose actor failed: missing, not a 0."""

    sample_slot_id: NonEmpty
    reason: str


class RolloutGroupResult(Strict):
    """``GET /rollout-groups/{id}``: the group's state, with its trajectories once terminal."""

    rollout_job_id: NonEmpty
    prompt_group_id: NonEmpty
    max_samples: Positive
    actual_samples: Count
    trajectories: list[Trajectory] = Field(default_factory=list)
    failed_samples: list[FailedSample] = Field(default_factory=list)
    #: Non-root trajectories (0 without a search).
    search_branches: Count = 0
    consumed_budget: dict[str, Any] = Field(default_factory=dict)
    status: GroupStatus
    stop_reason: str | None = None

    @model_validator(mode="after")
    def _check(self) -> RolloutGroupResult:
        if self.actual_samples != len(self.trajectories):
            raise ValueError(f"actual_samples {self.actual_samples} != {len(self.trajectories)} trajectories")
        slots = [t.sample_slot_id for t in self.trajectories]
        slots += [f.sample_slot_id for f in self.failed_samples]
        if len(set(slots)) != len(slots):
            raise ValueError("each sample slot is filled or failed at most once")
        return self


def strip_hints(text: str) -> tuple[str, bool]:
    """Removes every hint span (hints guide a branch's sampling but must not be trained on) and any stray
    close tag; returns the text, stripped of surrounding whitespace when anything went, and whether it did."""
    stripped = _HINT_SPAN.sub("", text).replace(HINT_CLOSE, "")
    if stripped == text:
        return text, False
    return stripped.strip(), True
