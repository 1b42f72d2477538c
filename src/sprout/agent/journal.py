"""The rollout journal: JSONL, one header line, one line per turn, one outcome line.

Each turn line carries only the messages that turn added; the messages up to turn k (what resuming
from turn k needs) are the header's messages plus every turn's new messages up to k. Lines are
flushed and fsynced as written, so a crash loses at most the line being written; the reader reports
a truncated last line instead of failing on it.
"""

import functools
import json
import os
import socket
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from .. import __version__
from ..checkout import CHECKOUT
from ..errors import SproutError
from ..sandbox.diff import ChangeSummary

SCHEMA_VERSION = 1
OBSERVATION_CAP = 10_000


def now() -> datetime:
    return datetime.now(UTC)


@functools.cache
def git_commit(path: Path = CHECKOUT) -> str | None:
    """The checkout's commit when this process first asks: the code it runs (a journal header records it)."""
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


class Limits(BaseModel):
    step_limit: int
    token_limit: int
    wall_time_s: int
    command_timeout_s: int


class ParentRef(BaseModel):
    journal: str
    turn: int
    checkpoint: str
    note: str | None = None


class Header(BaseModel):
    kind: Literal["header"] = "header"
    schema_version: int = SCHEMA_VERSION
    sprout_version: str = __version__
    git_commit: str | None = Field(default_factory=git_commit)
    task: str
    model: str
    model_class: str
    endpoint_host: str
    image: str
    image_key: str
    cwd: str
    limits: Limits
    started: datetime = Field(default_factory=now)
    store: str
    host: str | None = Field(default_factory=socket.gethostname)  # where the store is
    sandbox: str
    parent: ParentRef | None = None
    first_turn: int = 1
    n_calls: int = 0
    messages: list[dict[str, Any]]
    sampling: dict[str, Any] | None = None  # the sampling settings of every model call (None: the server's)


class Turn(BaseModel):
    kind: Literal["turn"] = "turn"
    turn: int
    checkpoint: str | None
    thought: str
    commands: list[str]
    observation: str
    exit_code: int | None
    tokens_in: int
    tokens_out: int
    model_latency_s: float
    command_s: float
    checkpoint_ms: float | None
    n_calls: int
    time: datetime = Field(default_factory=now)
    changes: ChangeSummary | None = None  # what the turn changed on disk (None: not known)
    new_messages: list[dict[str, Any]]


class Outcome(BaseModel):
    kind: Literal["outcome"] = "outcome"
    status: Literal["submitted", "limits_exceeded", "error"]
    exit_status: str
    message: str = ""
    submission: str = ""
    turns: int
    tokens_in: int
    tokens_out: int
    wall_s: float
    final_checkpoint: str | None
    finished: datetime = Field(default_factory=now)


class JournalWriter:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._file = open(path, "x", encoding="utf-8")
        except FileExistsError:
            raise SproutError(f"the journal {path} already exists; choose another path or remove it") from None

    def write(self, record: BaseModel) -> None:
        self._file.write(record.model_dump_json() + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class Journal(BaseModel):
    path: str
    header: Header
    turns: list[Turn]
    outcome: Outcome | None
    problems: list[str] = []

    def turn(self, number: int) -> Turn:
        for turn in self.turns:
            if turn.turn == number:
                return turn
        have = f"{self.turns[0].turn}..{self.turns[-1].turn}" if self.turns else "none"
        raise SproutError(f"{self.path} has no turn {number} (turns: {have})")

    def messages_up_to(self, number: int) -> list[dict[str, Any]]:
        messages = list(self.header.messages)
        for turn in self.turns:
            if turn.turn > number:
                break
            messages += turn.new_messages
        return messages


def read_journal(path: Path) -> Journal:
    """Reads and validates a journal; a truncated or invalid line is reported in `problems`. A path
    that is no journal (a directory, a special, binary or unreadable file) is one SproutError."""
    if path.exists() and not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise SproutError(f"{path} is {kind}, not a journal (a .jsonl file)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise SproutError(f"no journal at {path}") from None
    except UnicodeDecodeError:
        raise SproutError(f"{path} is not a journal: it is binary, not UTF-8 text") from None
    except OSError as e:
        raise SproutError(f"cannot read the journal {path}: {e.strerror or e}") from None
    if not lines:
        raise SproutError(f"{path} is empty")
    try:
        header = Header.model_validate_json(lines[0])
    except ValidationError as e:
        raise SproutError(f"{path}: the first line is not a Sprout journal header ({e.error_count()} errors)") from None
    turns, outcome, problems = [], None, []
    for number, line in enumerate(lines[1:], start=2):
        try:
            record = json.loads(line)
            record_kind = record.get("kind") if isinstance(record, dict) else None
            if record_kind == "turn":
                turns.append(Turn.model_validate_json(line))
            elif record_kind == "outcome":
                outcome = Outcome.model_validate_json(line)
            else:
                problems.append(f"line {number}: unknown record kind {record_kind!r}")
        except json.JSONDecodeError:
            last = number == len(lines)
            problems.append(f"line {number} is truncated" + (" (the run probably crashed while writing it)"
                                                                  if last else ""))
        except ValidationError as e:
            problems.append(f"line {number}: invalid {record_kind} record ({e.error_count()} errors)")
    if outcome is None and not problems:
        problems.append("no outcome line: the run is still going, or it crashed")
    return Journal(path=str(path), header=header, turns=turns, outcome=outcome, problems=problems)
