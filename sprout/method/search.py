"""The methods as decisions over an executor: SPROUT (review, then branch rounds), restarts, single.

The executor runs and grades attempts and runs reviews (for real: `executor.TaskExecutor`; in the
synthetic benchmark: a simulation). Decisions depend only on the records it returns, so running a
method again over an executor that replays recorded results makes the same plans (that is resume).

SPROUT: the first attempt; if it fails, round r reviews a failed attempt (round 1: the first; later:
the best failed branch of the round before, the latest among equals) and runs branches[r] branches
from the branch points the review chose, assigned round-robin (best point first). With early stop
(the default) everything ends as soon as an attempt scores 1.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from .budget import Budget, cost
from .records import AttemptPlan, AttemptRecord, ReviewRecord

Method = Literal["sprout", "restarts", "single"]


class Executor(Protocol):
    def attempt(self, plan: AttemptPlan) -> AttemptRecord: ...

    def review(self, review_id: str, round_number: int, target: AttemptRecord, n: int,
               attempts: Sequence[AttemptRecord]) -> ReviewRecord: ...


@dataclass
class MethodConfig:
    method: Method
    branches: list[int]  # per round
    early_stop: bool
    step_limit: int
    token_limit: int
    budget: Budget


@dataclass
class MethodResult:
    attempts: list[AttemptRecord] = field(default_factory=list)
    reviews: list[ReviewRecord] = field(default_factory=list)

    @property
    def solved_by(self) -> AttemptRecord | None:
        return next((a for a in self.attempts if a.solved), None)


def owner_of(turn: int, attempt: AttemptRecord, by_id: dict[str, AttemptRecord]) -> AttemptRecord:
    """The attempt whose journal holds `turn` of `attempt`'s trajectory (a branch's prefix is its parent's)."""
    while attempt.from_turn is not None and attempt.parent is not None and turn <= attempt.from_turn:
        attempt = by_id[attempt.parent]
    return attempt


def run_method(config: MethodConfig, executor: Executor) -> MethodResult:
    if config.method == "sprout":
        return _sprout(config, executor)
    if config.method == "restarts":
        return _restarts(config, executor)
    return MethodResult([executor.attempt(_plan(config, "a1", "first"))])


def _plan(config: MethodConfig, attempt_id: str, kind: str, **fields) -> AttemptPlan:
    return AttemptPlan(id=attempt_id, kind=kind, step_limit=config.step_limit, token_limit=config.token_limit,
                       **fields)


def _sprout(config: MethodConfig, executor: Executor) -> MethodResult:
    result = MethodResult([executor.attempt(_plan(config, "a1", "first"))])
    target = result.attempts[0]
    if target.solved and config.early_stop:
        return result
    for round_number, n in enumerate(config.branches, start=1):
        review = executor.review(f"r{round_number}", round_number, target, n, list(result.attempts))
        result.reviews.append(review)
        by_id = {a.id: a for a in result.attempts}
        this_round: list[AttemptRecord] = []
        for i in range(n):
            point = review.branch_points[i % len(review.branch_points)]
            owner = owner_of(point.turn, target, by_id)
            attempt = executor.attempt(_plan(
                config, f"r{round_number}b{i + 1}", "branch", round=round_number, parent=owner.id,
                from_turn=point.turn, note=point.note, review=review.id, reason=point.reason))
            result.attempts.append(attempt)
            this_round.append(attempt)
            if attempt.solved and config.early_stop:
                return result
        failed = [a for a in this_round if not a.solved] or [a for a in result.attempts if not a.solved]
        if not failed:
            break
        order = {a.id: i for i, a in enumerate(result.attempts)}
        target = max(failed, key=lambda a: (a.reward or 0.0, order[a.id]))
    return result


def _restarts(config: MethodConfig, executor: Executor) -> MethodResult:
    result = MethodResult()
    budget, used = config.budget, 0
    while used < budget.amount:
        left = budget.amount - used
        step_limit = min(config.step_limit, left) if budget.by == "turns" else config.step_limit
        token_limit = min(config.token_limit, left) if budget.by == "tokens" else config.token_limit
        n = len(result.attempts) + 1
        attempt = executor.attempt(AttemptPlan(id=f"a{n}", kind="first" if n == 1 else "restart",
                                               step_limit=step_limit, token_limit=token_limit))
        result.attempts.append(attempt)
        used += cost(attempt, budget.by)
        if attempt.solved and config.early_stop:
            break
    return result
