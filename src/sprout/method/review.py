"""The review: a model reads a failed trajectory and the verifier's output and picks turns to go back to.

The reviewer is called over the Chat Completions API with httpx (JSON mode asked for) and must answer
with a `ReviewAnswer` JSON object; the first JSON object in its content is used. An answer that cannot
be used (HTTP error, no JSON, schema errors, no valid turn) is retried with the problem explained, up
to `retries` more times; then the **fallback rule** chooses the points, and the record says why. An
endpoint that answers 401, 403 or 404 (a wrong key, URL or model) is not retried and gets no fallback:
`ReviewerRefused` ends the evaluation with that error.

    evenly spaced earlier turns: for n branches over a trajectory of T turns, the distinct turns
    round(T * i / (n + 1)) for i = 1..n, clipped to the valid range 0..min(T, step_limit) - 1,
    each with a generic note.

A point is valid when 0 <= turn < mistake_turn <= T, turn < step_limit (the branch has a step left)
and turn 0 or that turn has a checkpoint. Invalid points are dropped (and recorded); duplicates
(same turn) are merged; at most n are kept.
"""

import json
import re
import time
from dataclasses import dataclass

import httpx
from pydantic import ValidationError

from ..agent.models import Endpoint
from ..errors import SproutError
from .records import BranchPoint, ReviewAnswer, ReviewRecord, ReviewTry
from .trajectory import Step

RAW_CAP = 8_000  # of a reviewer answer kept in the record
OBSERVATION_CAP = 2_000  # per turn, in the prompt (head and tail)
TEXT_CAP = 1_500  # per thought or command
VERIFIER_CAP = 6_000  # tail of the verifier's output
FALLBACK_NOTE = ("Your previous attempt from this point did not pass the task's tests. Reconsider the approach "
                 "you took after this point, test your work against the task's requirements, then submit.")
SYSTEM = ("You review a coding agent's failed attempt at a task. The agent's sandbox was saved after every "
          "turn, so the attempt can continue from any earlier turn. Find the mistake that made the attempt "
          "fail and choose the turns to go back to. Answer with one JSON object and nothing else.")
ANSWER_FORMAT = """{"branch_points": [{"turn": K, "mistake_turn": M, "mistake": "what went wrong at turn M",
  "reason": "why going back to turn K helps, one sentence", "note": "a short instruction to the agent"}]}"""


REFUSALS = {401: "the key was refused", 403: "access is forbidden", 404: "no such URL or model"}


class ReviewerRefused(SproutError):
    """The reviewer's endpoint answered 401, 403 or 404: its configuration is wrong, no answer will come."""


@dataclass
class ReviewerConfig:
    model: str
    endpoint: Endpoint
    retries: int = 2  # further calls after an unusable answer
    seed: int = 0
    temperature: float = 0.0
    timeout_s: float = 600.0


@dataclass
class ReviewInput:
    instruction: str
    steps: list[Step]
    verifier_output: str
    reward: float | None
    n: int  # how many branch points are wanted
    step_limit: int


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


def prompt(inp: ReviewInput) -> str:
    last = inp.steps[-1].turn.turn if inp.steps else 0
    lines = ["# Task", "", inp.instruction.strip(), "",
             f"# The agent's trajectory ({last} turns)", ""]
    for step in inp.steps:
        turn = step.turn
        if step.note_before:
            lines += [f"[before turn {turn.turn} the agent was told: {cap_middle(step.note_before, TEXT_CAP)}]", ""]
        lines.append(f"## Turn {turn.turn} (exit code {'-' if turn.exit_code is None else turn.exit_code})")
        if turn.thought.strip():
            lines.append(f"thought: {cap_middle(turn.thought, TEXT_CAP)}")
        lines += [f"$ {cap_middle(command, TEXT_CAP)}" for command in turn.commands]
        lines += ["output:", cap_middle(turn.observation, OBSERVATION_CAP) or "(none)", ""]
    reward = "none (grading failed)" if inp.reward is None else f"{inp.reward:g}"
    lines += [f"# Verifier output (the task's tests on the final state; reward {reward}, 1 is a pass)", "",
              _tail(inp.verifier_output, VERIFIER_CAP) or "(no output)", "",
              "# What to answer", "",
              (f"Choose up to {inp.n} turn(s) K to go back to, the best first. Going back to turn K restores the "
              "sandbox exactly as it was after turn K and continues the agent from there, with your note added "
              "as a message to it; K = 0 starts over from the beginning. Each K must come before the mistake it "
              f"names (K < M) and should be as late as possible, to keep the good work. Valid K: 0 to "
              f"{max_turn(inp)}; M: 1 to {last}."), "", "Reply with JSON only, in this form:", ANSWER_FORMAT]
    return "\n".join(lines)


def max_turn(inp: ReviewInput) -> int:
    last = inp.steps[-1].turn.turn if inp.steps else 0
    return max(0, min(last, inp.step_limit) - 1)


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
    """The usable points (deduplicated, at most n) and a problem line for each dropped one."""
    last = inp.steps[-1].turn.turn if inp.steps else 0
    with_checkpoint = {s.turn.turn for s in inp.steps if s.turn.checkpoint}
    points: list[BranchPoint] = []
    problems: list[str] = []
    for i, point in enumerate(answer.branch_points, start=1):
        problem = None
        if not point.turn < point.mistake_turn <= last:
            problem = f"needs turn < mistake_turn <= {last} (got turn {point.turn}, mistake_turn {point.mistake_turn})"
        elif point.turn > max_turn(inp):
            problem = f"turn {point.turn} leaves no step to take (valid turns: 0 to {max_turn(inp)})"
        elif point.turn and point.turn not in with_checkpoint:
            problem = f"turn {point.turn} has no checkpoint"
        if problem:
            problems.append(f"branch_points[{i}]: {problem}")
        elif all(p.turn != point.turn for p in points):
            points.append(point)
    return points[: inp.n], problems


def fallback_points(inp: ReviewInput) -> list[BranchPoint]:
    """The fallback rule (module docstring)."""
    last = inp.steps[-1].turn.turn if inp.steps else 0
    top = max_turn(inp)
    turns = sorted({max(0, min(top, round(last * i / (inp.n + 1)))) for i in range(1, inp.n + 1)})
    return [BranchPoint(turn=t, mistake_turn=max(t + 1, last), mistake="unknown (chosen by the fallback rule)",
                        reason=f"fallback rule: evenly spaced turn {t} of {last}", note=FALLBACK_NOTE) for t in turns]


def _call(config: ReviewerConfig, messages: list[dict]) -> tuple[str, int, int]:
    headers = {"Authorization": f"Bearer {config.endpoint.key}"} if config.endpoint.key else {}
    body = {"model": config.model, "messages": messages, "temperature": config.temperature, "seed": config.seed,
            "response_format": {"type": "json_object"}}
    response = httpx.post(f"{config.endpoint.url}/chat/completions", json=body, headers=headers,
                          timeout=config.timeout_s)
    if response.status_code >= 400:
        try:
            detail = response.json().get("error", {}).get("message", "")
        except (ValueError, AttributeError):
            detail = response.text[:300]
        if response.status_code in REFUSALS:
            raise ReviewerRefused(
                f"the reviewer endpoint {config.endpoint.url} answered HTTP {response.status_code} for model "
                f"{config.model!r} ({REFUSALS[response.status_code]}): {detail[:300]}; check the reviewer's URL, "
                "model and key")
        raise httpx.HTTPStatusError(f"HTTP {response.status_code}: {detail}", request=response.request,
                                    response=response)
    data = response.json()
    content = data["choices"][0]["message"].get("content") or ""
    usage = data.get("usage") or {}
    return content, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def review(config: ReviewerConfig, inp: ReviewInput, *, review_id: str, round_number: int, reviewed: str) -> ReviewRecord:
    """Asks the reviewer (retrying unusable answers), else applies the fallback rule. Raises only
    `ReviewerRefused`, when the endpoint refuses the call (401, 403, 404)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt(inp)}]
    tries: list[ReviewTry] = []
    points: list[BranchPoint] = []
    started = time.monotonic()
    for attempt in range(config.retries + 1):
        t0 = time.monotonic()
        try:
            content, tokens_in, tokens_out = _call(config, messages)
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
            tries.append(ReviewTry(raw="", problems=[f"the call failed: {type(e).__name__}: {e}"[:500]],
                                   seconds=round(time.monotonic() - t0, 3)))
            if attempt < config.retries:
                time.sleep(min(8.0, 0.5 * 2 ** attempt))
            continue
        record = ReviewTry(raw=content[:RAW_CAP], tokens_in=tokens_in, tokens_out=tokens_out,
                           seconds=round(time.monotonic() - t0, 3))
        tries.append(record)
        try:
            answer = ReviewAnswer.model_validate(first_json_object(content))
            points, record.problems = check_points(answer, inp)
            if not points:
                record.problems.append("no usable branch point")
        except ValueError as e:  # no JSON, or pydantic's ValidationError (a ValueError)
            record.problems = answer_problems(e)
        if points:
            record.accepted = True
            break
        messages += [{"role": "assistant", "content": content},
                     {"role": "user", "content": "That answer cannot be used: " + "; ".join(record.problems)
                      + ". Reply with only the JSON object, in the form given above."}]
    fallback = None
    if not points:
        points = fallback_points(inp)
        fallback = f"no usable answer in {len(tries)} call(s): {'; '.join(tries[-1].problems)}"[:1000]
    return ReviewRecord(id=review_id, round=round_number, reviewed=reviewed, model=config.model,
                        endpoint_host=config.endpoint.host, branch_points=points, fallback=fallback, tries=tries,
                        tokens_in=sum(t.tokens_in for t in tries), tokens_out=sum(t.tokens_out for t in tries),
                        seconds=round(time.monotonic() - started, 3))


def answer_problems(error: ValueError) -> list[str]:
    """What is wrong with an answer: each schema error by its place, or the error's text."""
    if isinstance(error, ValidationError):
        return [f"{'.'.join(map(str, e['loc'])) or 'answer'}: {e['msg']}" for e in error.errors()[:10]]
    return [str(error)]

