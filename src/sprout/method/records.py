"""What the method decides and records: attempts, reviews and their branch points."""

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from ..agent.journal import now

AttemptKind = Literal["first", "branch", "restart"]
Verdict = Literal["pass", "fail", "error", "cancelled"]  # cancelled: not graded


class BranchPoint(BaseModel):
    """One turn to go back to: the sandbox as it was after `turn` (0: from the start), before the mistake."""

    turn: int = Field(ge=0, description="resume from the state right after this turn; 0 starts over")
    mistake_turn: int = Field(ge=1, description="the turn where the mistake happened (after `turn`)")
    mistake: str = Field(min_length=1, max_length=2000, description="what went wrong at mistake_turn")
    reason: str = Field(min_length=1, max_length=2000, description="why going back to `turn` helps")
    note: str = Field(min_length=1, max_length=4000, description="what the agent is told when it resumes")


class ReviewAnswer(BaseModel):
    """The JSON a reviewer must return."""

    branch_points: list[BranchPoint] = Field(min_length=1)


class ReviewTry(BaseModel):
    """One call to the reviewer: its raw answer (capped) and what was wrong with it."""

    raw: str
    problems: list[str] = []
    accepted: bool = False
    tokens_in: int = 0
    tokens_out: int = 0
    seconds: float = 0.0


class ReviewRecord(BaseModel):
    id: str  # r1, r2, ... (one per round)
    round: int
    reviewed: str  # the attempt reviewed
    model: str
    endpoint_host: str
    branch_points: list[BranchPoint]
    fallback: str | None = None  # why the fallback rule chose the points; None when the reviewer did
    tries: list[ReviewTry] = []
    tokens_in: int = 0
    tokens_out: int = 0
    seconds: float = 0.0
    created: datetime = Field(default_factory=now)


class AttemptPlan(BaseModel):
    """An attempt the method asks for: fresh, or a branch of `parent` at `from_turn` with `note`."""

    id: str
    kind: AttemptKind
    round: int = 0
    parent: str | None = None  # the attempt whose journal holds `from_turn`
    from_turn: int | None = None  # 0: a fresh sandbox, the note added to the instruction
    note: str | None = None
    review: str | None = None
    reason: str | None = None
    step_limit: int
    token_limit: int


class AttemptRecord(AttemptPlan):
    """A finished, graded attempt; or one cancelled when a sibling scored 1 (status and verdict
    "cancelled", no reward, no turns counted: its journal and checkpoints are discarded)."""

    journal: str  # relative to the output directory
    status: str  # the journal's outcome: submitted | limits_exceeded | error; or cancelled
    exit_status: str
    message: str = ""
    first_turn: int  # the first turn this attempt ran (a branch of turn k starts at k+1)
    turns: int  # turns this attempt ran (a branch's prefix is not counted)
    tokens_in: int
    tokens_out: int
    wall_s: float
    final_checkpoint: str | None
    reward: float | None
    rewards: dict[str, float] = {}
    verdict: Verdict
    grade_error: str | None = None
    grade_s: float = 0.0
    grade_mode: Literal["live", "branch"] | None = None  # live: in the attempt's own sandbox at its end
    verifier_output: str | None = None  # relative path of test-stdout.txt
    host: str | None = None  # where its checkpoints are (the worker's host over a Run Store)
    started: datetime
    finished: datetime = Field(default_factory=now)

    @property
    def solved(self) -> bool:
        return self.reward is not None and self.reward >= 1.0

    @property
    def cancelled(self) -> bool:
        return self.status == "cancelled"

    @property
    def last_turn(self) -> int:
        return self.first_turn + self.turns - 1

    @property
    def tokens(self) -> int:
        return self.tokens_in + self.tokens_out
