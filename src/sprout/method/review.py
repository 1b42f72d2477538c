"""The SPROUT review: a model reads a failed rollout and its grade and chooses the turns to go back to (the
points); for the RL search it also writes repair turns to execute there. One reviewer serves an evaluation
and the RL search: the same request for the same failed trajectory, one client, one fallback rule, one
refusal policy.

The conversation, over the Chat Completions API (JSON mode asked for):

1. The trajectory (each turn's thought, commands and output; a note the agent was given before a turn;
   turns a reviewer wrote in an earlier round marked as such), the grader's output, and the question: up
   to `points` turns as JSON (`branch_points`: turn, mistake_turn, mistake, reason, note).
2. Only when repairs are wanted (`candidates`, the RL search's FF groups): `candidates` next turns for
   each point (the reviewer's, or the fallback rule's), each a reasoning in the agent's voice and one
   command.

An answer that cannot be used (an HTTP error, no JSON, schema errors, no valid point) is asked again with
the problem named, up to `retries` more times; then the **fallback rule** chooses the points and the
record says why; repairs that cannot be had are simply missing (no branch is invented). An endpoint that
answers 401, 403 or 404 (a wrong key, URL or model) is not asked again and gets no fallback:
`ReviewerRefused` (an evaluation ends with it, the RL search branches no further from that review). No
call starts, or runs, past the review's deadline.

A point K is valid when K is a turn of the trajectory from `first_turn` on and before its last turn, with
a checkpoint, whose model calls so far leave at least one more (`max_calls`); K = 0 (start over) when
`first_turn` is 0. An answered point must also name its mistake after it (K < mistake_turn <= last turn).
Invalid points are dropped (and recorded), duplicates merged, at most `points` kept. The fallback rule:
evenly spaced valid turns, the i-th of n at position round(len(valid) * i / (n + 1)) of the valid list.
"""

import json
import re
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..agent.chat import WHY, ChatError, ChatRefused, complete
from ..agent.journal import Turn
from ..agent.models import Endpoint
from ..errors import SproutError
from .records import BranchPoint, Repair, ReviewAnswer, ReviewRecord, ReviewTry, TurnNumber

T = TypeVar("T")
RAW_CAP = 8_000  # of a reviewer answer kept in the record
OBSERVATION_CAP = 3_000  # per turn, in the prompt (head and tail)
TEXT_CAP = 2_000  # per thought or command
VERIFIER_CAP = 8_000  # tail of the grader's output
CHANGES_CAP = 1_000  # per turn: what it changed on disk (with show_changes)
QUESTION_ROOM = 2_000  # characters of prompt_chars kept for the questions and answers after the trajectory
MIN_CALL_S = 2.0  # a call is not started with less time left than this
FALLBACK_NOTE = ("Your previous attempt from this point did not pass the task's tests. Reconsider the approach "
                 "you took after this point, test your work against the task's requirements, then submit.")
SYSTEM = ("You review a coding agent's failed attempt at a task. The agent's sandbox was saved after every "
          "turn, so the attempt can continue from any earlier turn, exactly as it was then. Find the mistake "
          "that made the attempt fail and choose the turns to go back to. Answer with one JSON object and "
          "nothing else.")
ANSWER_FORMAT = """{"branch_points": [{"turn": K, "mistake_turn": M, "mistake": "what went wrong at turn M",
  "reason": "why going back to turn K helps, one sentence", "note": "a short instruction to the agent"}]}"""
REPAIRS_QUESTION = (
    "For each turn K of {turns}, write {candidates} different next turn(s) for the agent to take right after "
    "turn K, each a different way forward: its reasoning, in the agent's own voice, from what it has seen so "
    "far (never mention this review, the grader or tests it has not seen), and exactly one bash command. "
    'Reply with JSON only: {{"repairs": [{{"turn": K, "candidates": [{{"reasoning": "...", "command": "..."}}]}}]}}')


class ReviewerRefused(SproutError):
    """The reviewer's endpoint answered 401, 403 or 404: its configuration is wrong, no answer will come."""


class ReviewerConfig(BaseModel):
    """How the SPROUT reviewer is asked, the same in an evaluation and in the RL search (where it is served
    is given apart: an Endpoint here, a reference to a workers' endpoint in a review job)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the reviewer's model, as its endpoint serves it")
    temperature: float = Field(0.0, ge=0, description="sampling temperature of every call")
    seed: int | None = Field(0, description="sampling seed sent with every call (None: none sent)")
    retries: int = Field(2, ge=0, description="calls again after an unusable answer, before the fallback rule")
    timeout_s: float = Field(600.0, gt=0, description="one call, at most (and never past the review's deadline)")
    max_output_tokens: int | None = Field(None, ge=16, description="completion tokens per call (None: the "
                                                                   "server's default)")
    reasoning_effort: str | None = Field(None, description="sent as is when set (reasoning models)")
    prompt_chars: int = Field(250_000, ge=4_000, description="the trajectory is cut to this many characters "
                                                             "(its head and tail kept)")
    max_concurrent_requests: int = Field(8, ge=1, description="calls in flight at once, all reviews of a "
                                                              "process together")
    show_changes: bool = Field(False, description="each turn of the trajectory also says what it changed on "
                                                  "disk (files added, changed, removed; from its journal line)")


class Step(BaseModel):
    """One turn of the reviewed trajectory (a branch's shows its parents' turns up to where it branched)."""

    turn: Turn
    note_before: str | None = None  # what the agent was told just before this turn
    inserted: bool = False  # written by a reviewer (a repair of an earlier round), not by the policy


class ReviewInput(BaseModel):
    """What a review reads and what it is asked for; crosses to a worker in a review job."""

    model_config = ConfigDict(extra="forbid")

    instruction: str
    steps: list[Step]
    verifier_output: str
    reward: float | None  # of the reviewed attempt (None: grading failed)
    points: int = Field(ge=1)  # at most this many
    candidates: int = Field(0, ge=0)  # repair turns per point (0: none asked)
    first_turn: int = Field(0, ge=0)  # the earliest valid point (0: starting over is one)
    max_calls: int = Field(ge=1)  # model calls a trajectory may make

    @property
    def last_turn(self) -> int:
        return self.steps[-1].turn.turn if self.steps else 0

    def valid_turns(self) -> list[int]:
        """The turns a point may name (module docstring)."""
        turns = [s.turn.turn for s in self.steps if max(1, self.first_turn) <= s.turn.turn < self.last_turn
                 and s.turn.checkpoint and s.turn.n_calls < self.max_calls]
        return ([0] if self.first_turn == 0 else []) + turns


def cap_middle(text: str, limit: int) -> str:
    """`text` stripped, or its head and tail when it is longer than `limit`."""
    text = text.strip()
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} chars left out ...]\n{text[-half:]}"


def _tail(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def trajectory_text(inp: ReviewInput, show_changes: bool = False) -> str:
    """The task, the trajectory turn by turn (`show_changes`: with what each changed on disk), and the
    grader's output."""
    lines = ["# Task", "", inp.instruction.strip(), "", f"# The agent's trajectory ({inp.last_turn} turns)", ""]
    for step in inp.steps:
        turn = step.turn
        if step.note_before:
            lines += [f"[before turn {turn.turn} the agent was told: {cap_middle(step.note_before, TEXT_CAP)}]", ""]
        by = " (written by a reviewer in an earlier round)" if step.inserted else ""
        lines.append(f"## Turn {turn.turn}{by} (exit code {'-' if turn.exit_code is None else turn.exit_code})")
        thought = turn.thought.strip() or _reasoning(turn)
        if thought:
            lines.append(f"thought: {cap_middle(thought, TEXT_CAP)}")
        lines += [f"$ {cap_middle(command, TEXT_CAP)}" for command in turn.commands]
        lines += ["output:", cap_middle(turn.observation, OBSERVATION_CAP) or "(none)"]
        if show_changes:
            changed = turn.changes.line() if turn.changes is not None else "not recorded"
            lines.append(f"changes on disk: {cap_middle(changed, CHANGES_CAP)}")
        lines.append("")
    reward = "none (grading failed)" if inp.reward is None else f"{inp.reward:g}"
    lines += [f"# Verifier output (the task's tests on the final state; reward {reward}, 1 is a pass)", "",
              _tail(inp.verifier_output, VERIFIER_CAP) or "(no output)"]
    return "\n".join(lines)


def _reasoning(turn: Turn) -> str:
    return next((str(m.get("reasoning_content") or "") for m in turn.new_messages if m.get("role") == "assistant"), "")


def points_question(inp: ReviewInput) -> str:
    start_over = "; K = 0 starts over from the beginning" if inp.first_turn == 0 else ""
    return "\n".join([
        "# What to answer", "",
        f"Choose up to {inp.points} turn(s) K to go back to, the best first. Going back to turn K restores the "
        "sandbox exactly as it was after turn K and continues the agent from there, with your note added as a "
        f"message to it{start_over}. Each K must come before the mistake it names (K < M) and should be as late "
        f"as possible, to keep the good work. Valid K: {_ranges(inp.valid_turns())}; M: 1 to {inp.last_turn}.",
        "", "Reply with JSON only, in this form:", ANSWER_FORMAT])


def request_messages(inp: ReviewInput, config: ReviewerConfig) -> list[dict]:
    """The first request of a review: the trajectory (cut to `prompt_chars`) and the points question."""
    trajectory = cap_middle(trajectory_text(inp, config.show_changes), config.prompt_chars - QUESTION_ROOM)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{trajectory}\n\n{points_question(inp)}"}]


def first_json_object(text: str) -> object:
    """The first JSON object in `text` (after any <think> block); ValueError when there is none."""
    text = re.sub(r"(?s)<think>.*?</think>", "", text)
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    raise ValueError("the answer holds no JSON object")


def check_points(answer: ReviewAnswer, inp: ReviewInput) -> tuple[list[BranchPoint], list[str]]:
    """The usable points (deduplicated, at most `points`) and a problem line for each dropped one."""
    valid, last = inp.valid_turns(), inp.last_turn
    usable: list[BranchPoint] = []
    problems: list[str] = []
    for i, point in enumerate(answer.branch_points, start=1):
        problem = None
        if not point.turn < point.mistake_turn <= last:
            problem = f"needs turn < mistake_turn <= {last} (got turn {point.turn}, mistake_turn {point.mistake_turn})"
        elif point.turn not in valid:
            problem = f"turn {point.turn} {_why_invalid(point.turn, inp)} (valid turns: {_ranges(valid)})"
        if problem:
            problems.append(f"branch_points[{i}]: {problem}")
        elif all(p.turn != point.turn for p in usable):
            usable.append(point)
    return usable[: inp.points], problems


def _why_invalid(turn: int, inp: ReviewInput) -> str:
    step = next((s for s in inp.steps if s.turn.turn == turn), None)
    if turn < inp.first_turn or (turn == 0 and inp.first_turn > 0):
        return f"comes before turn {max(1, inp.first_turn)}, the earliest this review may choose"
    if step is None or not step.turn.checkpoint:
        return "has no checkpoint"
    return "leaves no step to take"


def fallback_points(inp: ReviewInput) -> list[BranchPoint]:
    """The fallback rule (module docstring); no points when no turn is valid."""
    valid, last, n = inp.valid_turns(), inp.last_turn, inp.points
    picks = sorted({valid[min(len(valid) - 1, round(len(valid) * i / (n + 1)))] for i in range(1, n + 1)}) if valid else []
    return [BranchPoint(turn=t, mistake_turn=max(t + 1, last), mistake="unknown (chosen by the fallback rule)",
                        reason=f"fallback rule: evenly spaced turn {t} of {last}", note=FALLBACK_NOTE) for t in picks]


class Unusable(ValueError):
    """An answer that parsed but holds nothing usable; `problems` says why, one line each."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def answer_problems(error: ValueError) -> list[str]:
    """What is wrong with an answer: each schema error by its place, or the error's text."""
    if isinstance(error, Unusable):
        return error.problems
    if isinstance(error, ValidationError):
        return [f"{'.'.join(map(str, e['loc'])) or 'answer'}: {e['msg']}" for e in error.errors()[:10]]
    return [str(error)]


class Reviewer:
    """Asks the configured reviewer, at most `max_concurrent_requests` calls at once through this object."""

    def __init__(self, config: ReviewerConfig, endpoint: Endpoint):
        self.config, self.endpoint = config, endpoint
        self.calls = threading.BoundedSemaphore(config.max_concurrent_requests)

    def review(self, inp: ReviewInput, *, review_id: str, round_number: int, reviewed: str,
               deadline: float = float("inf"), stop: threading.Event | None = None) -> ReviewRecord:
        """The points (the reviewer's, else the fallback rule's) and, when asked for, their repairs. Raises
        only ReviewerRefused. No call starts once `stop` is set or with less than MIN_CALL_S before `deadline`
        (unix time)."""
        started = time.monotonic()
        record = ReviewRecord(id=review_id, round=round_number, reviewed=reviewed, model=self.config.model,
                              endpoint_host=self.endpoint.host, branch_points=[])
        if not inp.valid_turns():
            record.fallback = "no turn of this trajectory can be branched from"
            return record
        conversation = request_messages(inp, self.config)
        ask = _Asking(self, conversation, record, deadline, stop)
        record.branch_points = ask("points", None, lambda answer: _usable_points(answer, inp)) or []
        if not record.branch_points:
            record.branch_points = fallback_points(inp)
            problems = record.tries[-1].problems if record.tries else ["no call was made"]
            record.fallback = f"no usable answer in {len(record.tries)} call(s): {'; '.join(problems)}"[:1000]
        if inp.candidates:
            turns = ", ".join(str(p.turn) for p in record.branch_points)
            question = REPAIRS_QUESTION.format(turns=turns, candidates=inp.candidates)
            repairs = ask("repairs", question, lambda answer: _repairs(answer, record.branch_points, inp.candidates))
            for point in record.branch_points:
                point.repairs = (repairs or {}).get(point.turn, [])
        record.tokens_in, record.tokens_out = sum(t.tokens_in for t in record.tries), sum(t.tokens_out for t in record.tries)
        record.seconds = round(time.monotonic() - started, 3)
        return record

    def fallback(self, inp: ReviewInput | None, why: str, *, review_id: str, round_number: int,
                 reviewed: str) -> ReviewRecord:
        """The fallback rule's points, without a call (a review that failed in a way nothing foresaw; no
        points when even its input could not be read)."""
        return ReviewRecord(id=review_id, round=round_number, reviewed=reviewed, model=self.config.model,
                            endpoint_host=self.endpoint.host, branch_points=fallback_points(inp) if inp else [],
                            fallback=why[:1000])

    def refused(self, why: str, *, review_id: str, round_number: int, reviewed: str) -> ReviewRecord:
        """The record of a review whose endpoint refused the call: no points (none invented)."""
        return ReviewRecord(id=review_id, round=round_number, reviewed=reviewed, model=self.config.model,
                            endpoint_host=self.endpoint.host, branch_points=[], refused=why[:1000])

    def post(self, messages: list[dict], timeout_s: float, json_mode: bool) -> tuple[str, int, int]:
        """One Chat Completions call: the answer's text, prompt and completion tokens. Raises ReviewerRefused
        for 401/403/404, ChatError otherwise."""
        config = self.config
        body: dict = {"model": config.model, "messages": messages, "temperature": config.temperature}
        body |= {k: v for k, v in (("seed", config.seed), ("max_tokens", config.max_output_tokens),
                                   ("reasoning_effort", config.reasoning_effort)) if v is not None}
        if json_mode:
            body["response_format"] = {"type": "json_object"}
        try:
            data = complete(self.endpoint, body, timeout_s=timeout_s, purpose="reviewer")
        except ChatRefused as e:
            if e.status in WHY:
                raise ReviewerRefused(f"{e}; check the reviewer's URL, model and key") from None
            raise
        message = data["choices"][0]["message"]
        answer = next((text for text in (message.get("content"), message.get("reasoning_content"))
                       if isinstance(text, str) and text), "")
        usage = data["usage"] if isinstance(data.get("usage"), dict) else {}
        return answer, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


class _Asking:
    """One review's questions in one conversation, each asked again (with its problem named) while its answer
    cannot be used, within the review's deadline."""

    def __init__(self, reviewer: Reviewer, conversation: list[dict], record: ReviewRecord, deadline: float,
                 stop: threading.Event | None):
        self.reviewer, self.conversation, self.record = reviewer, conversation, record
        self.deadline, self.stop = deadline, stop

    def __call__(self, purpose: str, question: str | None, parse: Callable[[str], T]) -> T | None:
        """The parsed answer to `question` (None: it is already the conversation's last message), or None."""
        if question is not None:
            self.conversation.append({"role": "user", "content": question})
        retries = self.reviewer.config.retries
        for attempt in range(retries + 1):
            call = ReviewTry(purpose=purpose, raw="")
            self.record.tries.append(call)
            answer = self._call(call)
            if answer is None:
                if call.problems[-1].startswith("the call failed") and attempt < retries:
                    time.sleep(min(8.0, 0.5 * 2 ** attempt, max(0.0, self.deadline - time.time() - MIN_CALL_S)))
                    continue
                return None
            self.conversation.append({"role": "assistant", "content": answer})
            try:
                parsed = parse(answer)
            except ValueError as e:  # no JSON, or pydantic's ValidationError (a ValueError)
                call.problems = answer_problems(e)
                if attempt < retries:
                    self.conversation.append({"role": "user", "content": "That answer cannot be used: "
                                              + "; ".join(call.problems) + ". Reply with only the JSON object, in "
                                              "the form asked."})
                continue
            call.accepted = True
            return parsed
        return None

    def _call(self, call: ReviewTry) -> str | None:
        """The answer's text; None (the problem recorded) when stopped, out of time or the call failed."""
        if self.stop is not None and self.stop.is_set():
            call.problems.append("stopped: the review is no longer wanted")
            return None
        left = self.deadline - time.time()
        reviewer = self.reviewer
        if left < MIN_CALL_S or not reviewer.calls.acquire(timeout=min(left - MIN_CALL_S, 1e9)):
            call.problems.append("no time left for the call")
            return None
        started = time.monotonic()
        try:
            timeout = min(reviewer.config.timeout_s, self.deadline - time.time())
            answer, call.tokens_in, call.tokens_out = reviewer.post(self.conversation, timeout, json_mode=True)
        except ReviewerRefused:
            raise
        except (ChatError, TypeError, ValueError, AttributeError) as e:
            call.problems.append(f"the call failed: {type(e).__name__}: {e}"[:500])
            return None
        finally:
            reviewer.calls.release()
            call.seconds = round(time.monotonic() - started, 3)
        call.raw = answer[:RAW_CAP]
        return answer


def _usable_points(answer: str, inp: ReviewInput) -> list[BranchPoint]:
    points, problems = check_points(ReviewAnswer.model_validate(first_json_object(answer)), inp)
    if not points:
        raise Unusable([*problems, "no usable branch point"])
    return points


class _CandidatesAt(BaseModel):
    turn: TurnNumber
    candidates: list[object]  # each read on its own: one bad candidate does not spoil the others


class _Repairs(BaseModel):
    repairs: list[_CandidatesAt]


def _repairs(answer: str, points: list[BranchPoint], n: int) -> dict[int, list[Repair]]:
    wanted = {p.turn for p in points}
    found: dict[int, list[Repair]] = {}
    for entry in _Repairs.model_validate(first_json_object(answer)).repairs:
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


def _ranges(turns: list[int]) -> str:
    if not turns:
        return "none"
    if turns == list(range(turns[0], turns[-1] + 1)):
        return f"{turns[0]} to {turns[-1]}" if len(turns) > 1 else str(turns[0])
    return ", ".join(map(str, turns)) if len(turns) <= 12 else f"{turns[0]}..{turns[-1]} (with checkpoints)"
