"""The search's review: a configured model reads a failed rollout and its grade, chooses the turns to branch
from (points) and, when asked, writes repair turns to execute there (candidates).

Three calls in one conversation: an analysis in plain words, then the points as JSON, then the repairs as
JSON (only when candidates are wanted). An unusable answer is asked once more with the problem named;
points that still cannot be had come from the fallback rule (evenly spaced valid turns), repairs that
cannot be had are simply missing (no branch is invented). Every call, answer and problem is kept in the
`SearchReview` record, which the driver stores beside the group's journals: a restarted driver reads it
back instead of asking again.

A point is a turn K of the reviewed history with a checkpoint, at or after `first_turn` (a later round
inserts its turn after the previous repair) and before the last turn, whose model calls so far leave the
policy at least one more (`max_turns`).
"""

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from ..agent.journal import Turn, read_journal
from ..agent.models import Endpoint
from ..agent.runner import INSERTED
from ..errors import SproutError
from ..method.review import answer_problems, cap_middle, first_json_object
from .config import ReviewConfig

OBSERVATION_CAP = 3_000  # per turn, head and tail
TEXT_CAP = 2_000  # per thought or command
VERIFIER_CAP = 8_000  # tail of the grader's output
MIN_CALL_S = 2.0  # a call is not started with less time left than this
SYSTEM = ("You review a coding agent's failed attempt at a task, to teach it. The agent's sandbox was saved after "
          "every turn, so the attempt can continue from any earlier turn, exactly as it was then.")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Repair(_Record):
    """A turn to execute at a point: the reviewer's reasoning (the agent's own voice) and one command."""

    reasoning: str = Field(min_length=1)
    command: str = Field(min_length=1)


class ReviewedPoint(_Record):
    turn: StrictInt
    reason: str = ""
    repairs: list[Repair] = []

    @field_validator("reason", mode="before")
    @classmethod
    def _any_reason(cls, value: object) -> str:
        return value if isinstance(value, str) else ""


class ReviewCall(_Record):
    purpose: str  # analysis, points or repairs
    seconds: float
    tokens_in: int = 0
    tokens_out: int = 0
    answer: str = ""  # capped
    problems: list[str] = []


class SearchReview(_Record):
    """What one review decided, and how: kept as JSON beside the group's journals."""

    reviewed: str  # the journal reviewed
    points: list[ReviewedPoint]
    analysis: str = ""
    fallback: str | None = None  # why the points came from the fallback rule
    calls: list[ReviewCall] = []


@dataclass
class ReviewTask:
    instruction: str
    journal: Path  # the failed rollout (a branch's history includes its parents' turns)
    verifier_output: str
    points: int  # at most this many
    candidates: int  # repairs per point (0: none asked)
    max_turns: int  # model calls a trajectory may make
    first_turn: int = 1  # the earliest valid point
    deadline: float = float("inf")  # unix time
    stop: threading.Event | None = None  # set: no further call (the group was deleted or the driver closes)


@dataclass
class HistoryTurn:
    turn: Turn
    inserted: bool  # written by a reviewer, not the policy


def history(journal: Path) -> list[HistoryTurn]:
    """The turns behind a rollout: its parents' up to each branch point, then its own."""
    record = read_journal(journal)
    parent = record.header.parent
    earlier = [] if parent is None else [t for t in history(Path(parent.journal)) if t.turn.turn <= parent.turn]
    own = [HistoryTurn(t, any((m.get("extra") or {}).get(INSERTED) for m in t.new_messages)) for t in record.turns]
    return earlier + own


def valid_turns(turns: list[HistoryTurn], task: ReviewTask) -> list[int]:
    last = turns[-1].turn.turn if turns else 0
    return [t.turn.turn for t in turns if task.first_turn <= t.turn.turn < last and t.turn.checkpoint
            and t.turn.n_calls < task.max_turns]


class Reviewer:
    """Calls the configured reviewer, at most `max_concurrent_requests` calls at once in this process."""

    def __init__(self, config: ReviewConfig, key_env: str | None):
        self.config = config
        self.endpoint = Endpoint(config.endpoint.rstrip("/"), key_env=config.api_key_env or key_env)
        self.calls = threading.BoundedSemaphore(config.max_concurrent_requests)

    def review(self, task: ReviewTask) -> SearchReview:
        turns = history(task.journal)
        valid = valid_turns(turns, task)
        conversation = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": self._fit(trajectory_prompt(task, turns)) + ANALYSE}]
        record = SearchReview(reviewed=str(task.journal), points=[])
        record.analysis = self._ask(conversation, task, record, "analysis", None) or ""
        if not valid:
            record.fallback = "no turn of this rollout can be branched from"
            return record
        record.points = self._ask(conversation, task, record, "points", lambda a: _points(a, valid, task.points)) or []
        if not record.points:
            record.points = fallback_points(valid, task.points)
            record.fallback = "; ".join(record.calls[-1].problems)[:1000] or "no usable answer"
        if task.candidates:
            repairs = self._ask(conversation, task, record, "repairs",
                                lambda a: _repairs(a, record.points, task.candidates)) or {}
            for point in record.points:
                point.repairs = repairs.get(point.turn, [])
        return record

    def fallback(self, task: ReviewTask, why: str) -> SearchReview:
        """The fallback rule's points, without a call (a review that failed in a way nothing foresaw)."""
        try:
            valid = valid_turns(history(task.journal), task)
        except SproutError:
            valid = []
        return SearchReview(reviewed=str(task.journal), points=fallback_points(valid, task.points) if valid else [],
                            fallback=why[:1000])

    def _ask(self, conversation: list[dict], task: ReviewTask, record: SearchReview, purpose: str, parse):
        """One question (asked again once when the answer cannot be used); the parsed answer, or None."""
        if purpose in QUESTIONS:  # the analysis question is already the conversation's last message
            conversation.append({"role": "user", "content": QUESTIONS[purpose](task)})
        for attempt in range(2 if parse else 1):
            call = ReviewCall(purpose=purpose, seconds=0.0)
            record.calls.append(call)
            if task.stop is not None and task.stop.is_set():
                call.problems.append("stopped: the group was deleted or the driver is closing")
                return None
            answer = self._call(conversation, task.deadline, call, json_mode=parse is not None)
            if answer is None:
                return None
            conversation.append({"role": "assistant", "content": answer})
            if parse is None:
                return answer
            try:
                return parse(answer)
            except (ValueError, TypeError) as e:
                call.problems.append("; ".join(answer_problems(e)[:5]))
                if attempt == 0:
                    conversation.append({"role": "user", "content": f"That answer cannot be used: {call.problems[-1]}. "
                                         "Reply with only the JSON object, in the form asked."})
        return None

    def _call(self, messages: list[dict], deadline: float, call: ReviewCall, *, json_mode: bool) -> str | None:
        """The answer's text; None (the problem recorded) when the call failed or found no time: calls wait
        for a free place among `max_concurrent_requests`, and none starts or runs past `deadline`."""
        if deadline - time.time() < MIN_CALL_S or not self.calls.acquire(timeout=deadline - time.time() - MIN_CALL_S):
            call.problems.append("no time left for the call")
            return None
        try:
            return self._post(messages, min(self.config.timeout_s, deadline - time.time()), call, json_mode)
        finally:
            self.calls.release()

    def _post(self, messages: list[dict], left: float, call: ReviewCall, json_mode: bool) -> str | None:
        body = {"model": self.config.model, "messages": messages, "temperature": self.config.temperature,
                "max_tokens": self.config.max_output_tokens}
        if self.config.reasoning_effort:
            body["reasoning_effort"] = self.config.reasoning_effort
        if json_mode:
            body["response_format"] = {"type": "json_object"}
        headers = {"Authorization": f"Bearer {self.endpoint.key}"} if self.endpoint.key else {}
        started = time.monotonic()
        try:
            response = httpx.post(f"{self.endpoint.url}/chat/completions", json=body, headers=headers, timeout=left)
            response.raise_for_status()
            data = response.json()
            message = data["choices"][0]["message"]
            answer = next((text for text in (message.get("content"), message.get("reasoning_content"))
                           if isinstance(text, str) and text), "")
            usage = data.get("usage") or {}
            call.tokens_in, call.tokens_out = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            call.problems.append(f"the call failed: {type(e).__name__}: {e}"[:500])
            return None
        finally:
            call.seconds = round(time.monotonic() - started, 3)
        call.answer = answer[:8_000]
        return answer

    def _fit(self, text: str) -> str:
        """The prompt cut to the configured size: its head and tail, the middle left out."""
        limit = self.config.prompt_chars - 2_000  # room for the questions and answers that follow
        return cap_middle(text, limit)


ANALYSE = ("\n\n# First question\n\nWhat went wrong in this attempt, where, and why? What should the agent have "
           "done instead? Answer in plain words.")
QUESTIONS = {
    "points": lambda task: (
        f"Choose up to {task.points} turn(s) K to continue the attempt from, the best first. Continuing from K "
        "restores the sandbox and the conversation exactly as they were after turn K; choose K before the first "
        "mistake and as late as possible, to keep the good work. Reply with JSON only: "
        '{"points": [{"turn": K, "reason": "one sentence"}]}'),
    "repairs": lambda task: (
        f"For each turn K you chose, write {task.candidates} different next turn(s) for the agent to take right "
        "after turn K, each a different way forward: its reasoning, in the agent's own voice, from what it has seen "
        "so far (never mention this review, the grader or tests it has not seen), and exactly one bash command. "
        'Reply with JSON only: {"repairs": [{"turn": K, "candidates": [{"reasoning": "...", "command": "..."}]}]}'),
}


def trajectory_prompt(task: ReviewTask, turns: list[HistoryTurn]) -> str:
    lines = ["# Task", "", task.instruction.strip(), "", f"# The agent's attempt ({len(turns)} turns)", ""]
    for item in turns:
        turn = item.turn
        by = " (written by a reviewer in an earlier round)" if item.inserted else ""
        lines.append(f"## Turn {turn.turn}{by} (exit code {'-' if turn.exit_code is None else turn.exit_code})")
        thought = turn.thought.strip() or _reasoning(turn)
        if thought:
            lines.append(f"thought: {cap_middle(thought, TEXT_CAP)}")
        lines += [f"$ {cap_middle(command, TEXT_CAP)}" for command in turn.commands]
        lines += ["output:", cap_middle(turn.observation, OBSERVATION_CAP) or "(none)", ""]
    tail = task.verifier_output.strip()
    tail = tail if len(tail) <= VERIFIER_CAP else "[...]\n" + tail[-VERIFIER_CAP:]
    lines += ["# The grader's output (the attempt failed)", "", tail or "(no output)"]
    return "\n".join(lines)


def _reasoning(turn: Turn) -> str:
    return next((str(m.get("reasoning_content") or "") for m in turn.new_messages if m.get("role") == "assistant"), "")


class _Points(_Record):
    points: list[ReviewedPoint]


class _CandidatesAt(_Record):
    turn: StrictInt
    candidates: list[object]  # each read on its own: one bad candidate does not spoil the others


class _Repairs(_Record):
    repairs: list[_CandidatesAt]


def _points(answer: str, valid: list[int], n: int) -> list[ReviewedPoint]:
    chosen: list[ReviewedPoint] = []
    invalid: list[int] = []
    for point in _Points.model_validate(_lenient(first_json_object(answer))).points:
        if point.turn not in valid:
            invalid.append(point.turn)
        elif all(p.turn != point.turn for p in chosen):
            chosen.append(ReviewedPoint(turn=point.turn, reason=point.reason))
    if not chosen:
        raise ValueError(f"no valid point was chosen (got turns {invalid}; valid: {_ranges(valid)})")
    return chosen[:n]


def _repairs(answer: str, points: list[ReviewedPoint], n: int) -> dict[int, list[Repair]]:
    wanted = {p.turn for p in points}
    found: dict[int, list[Repair]] = {}
    for entry in _Repairs.model_validate(_lenient(first_json_object(answer))).repairs:
        if entry.turn in wanted:
            found.setdefault(entry.turn, []).extend(_usable(entry.candidates))
    if not any(found.values()):
        raise ValueError(f"no usable repairs (a reasoning and a command each) for the chosen turns {sorted(wanted)}")
    return {turn: repairs[:n] for turn, repairs in found.items()}


def _usable(candidates: list[object]) -> list[Repair]:
    usable = []
    for candidate in candidates:
        try:
            usable.append(Repair.model_validate(candidate))
        except ValidationError:
            continue
    return usable


def _lenient(value: object) -> object:
    """Reviewers add keys of their own; only the ones asked for are read."""
    if isinstance(value, dict):
        return {k: _lenient(v) for k, v in value.items() if k in _KEYS}
    if isinstance(value, list):
        return [_lenient(v) for v in value]
    return value


_KEYS = {"points", "turn", "reason", "repairs", "candidates", "reasoning", "command"}


def fallback_points(valid: list[int], n: int) -> list[ReviewedPoint]:
    """Evenly spaced valid turns: the i-th of n is the valid turn at position round(len * i / (n + 1))."""
    picks = sorted({valid[min(len(valid) - 1, round(len(valid) * i / (n + 1)))] for i in range(1, n + 1)})
    return [ReviewedPoint(turn=turn, reason="fallback rule: evenly spaced") for turn in picks]


def _ranges(turns: list[int]) -> str:
    return ", ".join(map(str, turns)) if len(turns) <= 12 else f"{turns[0]}..{turns[-1]} (with checkpoints)"
