"""Turns one rollout journal (mini-swe-agent's messages) into the Chat Completions messages Miles trains on.

Miles's importer fails the whole group on one bad message (sprout.rl_driver.protocol.check_messages), so the export
is strict where Miles is: the four API roles only, content a string or null, every tool call with a
unique id and answered by a tool message, no training-hint tags in user or system content. Everything
mini-swe-agent or litellm adds for its own bookkeeping (`extra`, `function_call`, `thinking_blocks`...)
is left behind: a strict reader rejects keys it does not know.

What is dropped, and why:
- `exit` messages: mini-swe-agent's end-of-run marker, not an API role.
- a turn whose tool calls were never answered (the run was cut off mid-turn), with everything after it:
  Miles needs every call answered, and inventing an observation would train on a context that never
  happened. The one exception is a run that ended by submitting (the environment raises `Submitted`
  instead of answering the submitting call): that turn is the one that finished the task, so its calls
  get a short tool answer instead of being cut. Nothing after the last assistant message trains, so the
  invented answer shapes no trained token.
- a tool message that answers no pending call: Miles refuses it, and it carries nothing a call needs.
- a user message that held only a training hint (a branch's continuation prompt): once the hint is
  stripped nothing is left of it, and an empty user turn would be rendered and trained around.

Provenance: `prefix` is how many of the input messages a branch restored (its parent's history up to
the branch point); the export says how many exported messages that became, and at which exported
positions the assistant turns no model call produced (marked `extra.sprout_inserted`) stand.
"""

import json
from dataclasses import dataclass
from typing import Any

from minisweagent.models.utils.actions_toolcall import BASH_TOOL

from ..agent.journal import Journal
from ..agent.runner import INSERTED
from ..errors import SproutError
from .protocol import ROLES, strip_hints

TOOLS_BY_MODEL_CLASS: dict[str, list[dict]] = {"tools": [BASH_TOOL], "text": []}
SUBMITTED_ANSWER = "Submitted."


class ExportError(SproutError):
    """A journal that cannot become a trajectory Miles accepts (nothing trainable, or a role it refuses)."""


@dataclass
class ExportedMessages:
    messages: list[dict]
    hints_removed_any: bool
    model_calls: int  # assistant messages kept
    tool_calls: int  # tool calls kept
    trimmed: int  # input messages (exits not counted) cut off with an unanswered turn
    prefix_messages: int = 0  # exported messages that came from the restored history
    inserted_messages: list[int] | None = None  # exported positions of assistant turns no model call produced


def _text(content: Any) -> str | None:
    """Miles takes a string or null, never mini-swe-agent's multimodal list of parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (part.get("text") if isinstance(part, dict) else part for part in content)
        return "".join(text for text in texts if isinstance(text, str))
    return str(content)


def _arguments(arguments: Any) -> str:
    """Miles decodes arguments itself; a string is kept as the model wrote it."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps({} if arguments is None else arguments)


class _Ids:
    """Hands out call ids unique in the trajectory: a model's own id where it is new, else `call_<n>`."""

    def __init__(self, messages: list[dict]):
        self.taken = {str(c.get("id")) for m in messages for c in (m.get("tool_calls") or []) if c.get("id")}
        self.taken |= {str(m["tool_call_id"]) for m in messages if m.get("tool_call_id")}
        self.used: set[str] = set()
        self.counter = 0

    def assign(self, raw: str | None) -> str:
        if raw and raw not in self.used:
            self.used.add(raw)
            return raw
        while (fresh := f"call_{self.counter + 1}") in self.taken or fresh in self.used:
            self.counter += 1
        self.counter += 1
        self.used.add(fresh)
        return fresh


def _raw_id(value: Any) -> str | None:
    return str(value) if value else None


def _assistant(message: dict, ids: _Ids) -> tuple[dict, list[tuple[str | None, str]]]:
    """The assistant message Miles accepts, and its calls as (id in the journal, id in the export)."""
    calls, pending = [], []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        raw = _raw_id(call.get("id"))
        new = ids.assign(raw)
        pending.append((raw, new))
        calls.append({"id": new, "type": "function", "function": {
            "name": str(function.get("name") or ""), "arguments": _arguments(function.get("arguments"))}})
    content = _text(message.get("content"))
    out: dict = {"role": "assistant", "content": content if content is not None or calls else ""}
    if calls:
        out["tool_calls"] = calls
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        out["reasoning_content"] = reasoning
    return out, pending


def _answer(pending: list[tuple[str | None, str]], raw: str | None) -> str | None:
    """A tool message answers the earliest pending call with its id; None when it answers none."""
    for index, (call_raw, new) in enumerate(pending):
        if call_raw == raw:
            del pending[index]
            return new
    return None


def _submitted(messages: list[dict]) -> bool:
    last = messages[-1] if messages else {}
    return last.get("role") == "exit" and (last.get("extra") or {}).get("exit_status") == "Submitted"


def export_messages(messages: list[dict], *, answer_submission: bool = True, prefix: int = 0) -> ExportedMessages:
    """Raises ExportError when nothing trainable is left (no assistant message) or a role is not an API role.
    `answer_submission=False` cuts a submitting turn like any other unanswered one; `prefix`: the first
    that many input messages are the restored history."""
    raw = [m for m in messages if m.get("role") != "exit"]
    if bad := sorted({str(m.get("role")) for m in raw} - ROLES):
        raise ExportError(f"the rollout has messages with roles Miles does not accept: {', '.join(bad)}")
    state = _Conversion(raw, sum(m.get("role") != "exit" for m in messages[:prefix]))
    closed = state.run()
    trimmed = 0
    if state.pending and closed and answer_submission and _submitted(messages):
        state.out += [{"role": "tool", "content": SUBMITTED_ANSWER, "tool_call_id": new}
                      for _, new in state.pending]
    elif state.pending:
        if state.cut[1] < state.prefix:
            raise ExportError("the restored history has a turn whose tool calls were never answered: the branch "
                              "cannot be exported after it")
        state.out, trimmed = state.out[:state.cut[0]], len(raw) - state.cut[1]
    hints = any(index < len(state.out) for index in state.hinted)
    exported = _result(state.out, hints, trimmed)
    exported.prefix_messages = min(state.prefix_out, len(state.out))
    exported.inserted_messages = [index for index in state.inserted if index < len(state.out)]
    return exported


class _Conversion:
    """One pass over the messages; stops at an assistant message that finds the previous turn unanswered."""

    def __init__(self, raw: list[dict], prefix: int):
        self.raw, self.ids, self.prefix = raw, _Ids(raw), prefix
        self.out: list[dict] = []
        self.pending: list[tuple[str | None, str]] = []
        self.cut = (0, 0)  # (position in out, position in raw) of the last assistant message
        self.hinted: list[int] = []  # positions in out whose hints were removed
        self.inserted: list[int] = []  # positions in out of inserted assistant turns
        self.prefix_out = 0  # messages in out that came from the first `prefix` raw messages

    def run(self) -> bool:
        """True when every message was read, False when an unanswered turn stopped the pass."""
        for position, message in enumerate(self.raw):
            if position == self.prefix:
                self.prefix_out = len(self.out)
            role = message["role"]
            if role == "assistant":
                if self.pending:
                    return False
                exported, self.pending = _assistant(message, self.ids)
                self.cut = (len(self.out), position)
                if (message.get("extra") or {}).get(INSERTED):
                    self.inserted.append(len(self.out))
                self.out.append(exported)
            elif role == "tool":
                answered = _answer(self.pending, _raw_id(message.get("tool_call_id")))
                if answered is not None:
                    self.out.append({"role": "tool", "content": _text(message.get("content")) or "",
                                     "tool_call_id": answered})
            else:
                content, removed = strip_hints(_text(message.get("content")) or "")
                if removed:
                    self.hinted.append(len(self.out))
                    if not content:
                        continue  # a hint and nothing else
                self.out.append({"role": role, "content": content})
        if len(self.raw) <= self.prefix:
            self.prefix_out = len(self.out)
        return True


def _result(out: list[dict], hints: bool, trimmed: int) -> ExportedMessages:
    model_calls = sum(m["role"] == "assistant" for m in out)
    if not model_calls:
        raise ExportError("the rollout has no complete model turn to train on (no assistant message is left)")
    return ExportedMessages(messages=out, hints_removed_any=hints, model_calls=model_calls,
                            tool_calls=tool_call_count(out), trimmed=trimmed)


def tool_call_count(messages: list[dict]) -> int:
    """Miles sums `tool_calls` from consumed_budget; counted on what is exported, not on what was cut."""
    return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")


def journal_messages(journal: Journal) -> list[dict]:
    """The whole conversation: the header holds what came before turn 1 (a branch's restored history)."""
    messages = list(journal.header.messages)
    for turn in journal.turns:
        messages += turn.new_messages
    return messages


def restored_messages(journal: Journal) -> int:
    """How many of journal_messages() a branch restored from its parent (its note, if any, came after)."""
    header = journal.header
    if header.parent is None:
        return 0
    return len(header.messages) - (1 if header.parent.note else 0)
