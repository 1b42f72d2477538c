"""What the method decides and records: attempts, reviews and their branch points."""

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, Field

from ..agent.journal import now

AttemptKind = Literal["first", "branch", "restart"]
Verdict = Literal["pass", "fail", "error", "cancelled"]  # cancelled: not graded


def _no_bool(value: object) -> object:
    if isinstance(value, bool):  # JSON's true is no turn number (pydantic would read it as 1)
        raise ValueError("a turn is a number, not a boolean")
    return value


TurnNumber = Annotated[int, BeforeValidator(_no_bool)]


class Repair(BaseModel):
    """A turn to execute at a point (the RL search's repairs): the reviewer's reasoning, in the agent's own
    voice, and one command. Keys a reviewer adds of its own are ignored."""

    reasoning: str = Field(min_length=1)
    command: str = Field(min_length=1)


class BranchPoint(BaseModel):
    """One turn to go back to: the sandbox as it was after `turn` (0: from the start), before the mistake."""

    turn: TurnNumber = Field(ge=0, description="resume from the state right after this turn; 0 starts over")
    mistake_turn: TurnNumber = Field(ge=1, description="the turn where the mistake happened (after `turn`)")
    mistake: str = Field(min_length=1, max_length=2000, description="what went wrong at mistake_turn")
    reason: str = Field(min_length=1, max_length=2000, description="why going back to `turn` helps")
    note: str = Field(min_length=1, max_length=4000, description="what the agent is told when it resumes")
    repairs: list[Repair] = Field([], description="turns to execute there first (the RL search asks for them)")


class ReviewAnswer(BaseModel):
    """The JSON a reviewer must return."""

    branch_points: list[BranchPoint] = Field(min_length=1)


class ReviewTry(BaseModel):
    """One call to the reviewer: what it was asked for, its raw answer (capped) and what was wrong with it."""

    purpose: Literal["points", "repairs"] = "points"
    raw: str
    problems: list[str] = []
    accepted: bool = False
    tokens_in: int = 0
    tokens_out: int = 0
    seconds: float = 0.0


class ReviewRecord(BaseModel):
    """What one review decided, and how (sprout.method.review): kept beside an evaluation's attempts, and
    beside an RL search group's journals (a restarted process reads it back instead of asking again)."""

    id: str  # r1, r2, ... (one per round); in the RL search, round-<n>-<reviewed sample>
    round: int
    reviewed: str  # the attempt reviewed (an evaluation's attempt id; the RL search's journal)
    model: str
    endpoint_host: str
    branch_points: list[BranchPoint]
    fallback: str | None = None  # why the fallback rule chose the points; None when the reviewer did
    refused: str | None = None  # the endpoint refused the call (401, 403, 404): no points, none invented
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
    regrades: list[float | None] = []  # --regrade N: the rewards of N more grades of its final checkpoint
    pass_rate: float | None = None  # with regrades: the share of its N + 1 grades that scored 1
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
