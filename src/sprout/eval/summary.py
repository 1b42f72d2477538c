"""summary.json of an evaluation: its configuration (and hash), provenance, every attempt and review."""

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from .. import __version__
from ..agent.journal import now
from ..errors import SproutError
from ..files import write_atomic
from ..method.budget import Budget, BudgetBy, cost_to_solve
from ..method.records import AttemptRecord, ReviewRecord
from ..method.search import Method
from .provenance import Pinning, PreparedImage, SourceState

SUMMARY = "summary.json"
Status = Literal["running", "solved", "unsolved", "error", "interrupted", "lost"]  # lost: AttemptsLost


class EvaluationConfig(BaseModel):
    """Everything that decides which attempts run: an output can only be resumed with the same hash."""

    task: str
    task_digest: str
    dataset_digest: str
    method: Method
    rounds: int
    branches: list[int]
    early_stop: bool
    budget: Budget
    model: str
    model_class: str
    review_model: str | None
    step_limit: int
    token_limit: int
    wall_time_s: int
    command_timeout_s: int
    review_retries: int
    seed: int
    commit: str | None
    wave: int | None = None  # restarts run this many attempts at once (their limits depend on it); None: 1
    review_changes: bool = False  # the reviewer read what each turn changed on disk

    def digest(self) -> str:
        """The hash of the fields; `wave` and `review_changes` only when set, so runs from before they existed
        keep theirs. How many of SPROUT's branches run at once is not here: it does not change the plans."""
        unset = {"wave"} if self.wave is None else set()
        unset |= set() if self.review_changes else {"review_changes"}
        text = json.dumps(self.model_dump(mode="json", exclude=unset), sort_keys=True)
        return f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"

    def differences(self, other: "EvaluationConfig") -> list[str]:
        mine, theirs = self.model_dump(mode="json"), other.model_dump(mode="json")
        return [f"{k}: {theirs[k]} -> {mine[k]}" for k in mine if mine[k] != theirs.get(k)]


class ImageInfo(BaseModel):
    reference: str
    image_id: str
    key: str
    prepared: PreparedImage | None  # what the preparation manifest recorded
    source: str | None = None  # present, pulled, built or cached (sprout.tasks.images)
    warning: str | None = None  # e.g. the prebuilt image could not be pulled and its Dockerfile was built
    stand_in: bool | None = None  # the image is, or is built on, an offline stand-in base image


class Totals(BaseModel):
    attempts: int = 0
    turns: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    review_tokens: int = 0
    turns_to_solve: int | None = None  # spent up to and including the solving attempt
    tokens_to_solve: int | None = None


class EvaluationSummary(BaseModel):
    kind: Literal["sprout.evaluation"] = "sprout.evaluation"
    schema_version: int = 1
    config: EvaluationConfig
    config_hash: str
    pinning: Pinning
    source: SourceState
    image: ImageInfo
    endpoint_host: str
    review_endpoint_host: str | None
    runstore: str | None = None  # the Run Store whose workers ran the attempts (None: in-process)
    runstore_group: str | None = None  # the group of its jobs there (this session's), which `sprout view` follows
    host_trust: bool | None = None  # sandboxes got the host's CA bundle and proxy settings (sprout.sandbox.trust)
    sprout_version: str = __version__
    status: Status = "running"
    error: str | None = None
    solved_by: str | None = None
    best_reward: float | None = None
    started: datetime = Field(default_factory=now)
    finished: datetime | None = None
    wall_s: float = 0.0  # summed over every session that worked on it
    sessions: int = 1
    totals: Totals = Totals()
    attempts: list[AttemptRecord] = []
    reviews: list[ReviewRecord] = []
    regrade: int = 0  # each graded attempt re-graded this many times from its final checkpoint (pass_rate)

    def refresh(self) -> None:
        """Recomputes the totals, the best reward and who solved it from the attempts."""
        rewards = [a.reward for a in self.attempts if a.reward is not None]
        self.best_reward = max(rewards) if rewards else None
        self.solved_by = next((a.id for a in self.attempts if a.solved), None)
        self.totals = Totals(
            attempts=len(self.attempts), turns=sum(a.turns for a in self.attempts),
            tokens_in=sum(a.tokens_in for a in self.attempts), tokens_out=sum(a.tokens_out for a in self.attempts),
            review_tokens=sum(r.tokens_in + r.tokens_out for r in self.reviews),
            turns_to_solve=cost_to_solve(self.attempts, self.reviews, "turns"),
            tokens_to_solve=cost_to_solve(self.attempts, self.reviews, "tokens"))

    def cost_to_solve(self, by: BudgetBy) -> int | None:
        return self.totals.turns_to_solve if by == "turns" else self.totals.tokens_to_solve


def read_summary(out: Path) -> EvaluationSummary:
    path = Path(out) / SUMMARY
    try:
        return EvaluationSummary.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise SproutError(f"no evaluation at {out} (no {SUMMARY})") from None
    except ValidationError as e:
        raise SproutError(f"{path} is not a Sprout evaluation summary ({e.error_count()} errors)") from None


def write_summary(out: Path, summary: EvaluationSummary) -> None:
    """Writes summary.json atomically (a reader never sees half of it)."""
    write_atomic(Path(out) / SUMMARY, summary.model_dump_json(indent=2))
