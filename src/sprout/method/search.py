"""The methods as decisions over an executor: SPROUT (review, then branch rounds), restarts, single.

The executor runs and grades attempts and runs reviews (for real: `executor.TaskExecutor`; in the
synthetic benchmark: a simulation). Decisions depend only on the records it returns, so running a
method again over an executor that replays recorded results makes the same plans (that is resume).

SPROUT: the first attempt; if it fails, round r reviews a failed attempt (round 1: the first; later:
the best failed branch of the round before, the latest among equals) and runs branches[r] branches
from the branch points the review chose, assigned round-robin (best point first). The branches of a
round run at the same time (up to `parallel`); with early stop (the default) the first attempt that
scores 1 cancels its running siblings and ends the method.

Restarts run in waves of `wave_size` attempts at once. A wave's attempts are capped by what the budget
has left after what is committed: the finished attempts' cost plus the limits of the wave's earlier
attempts. Waves (not a sliding window) keep the plans a function of the records alone, so resume replays
them whatever order attempts finished in.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from .budget import Budget, cost
from .records import AttemptPlan, AttemptRecord, ReviewRecord

Method = Literal["sprout", "restarts", "single"]


class Executor(Protocol):
    def attempt_many(self, plans: Sequence[AttemptPlan], early_stop: bool, parallel: int) -> list[AttemptRecord]:
        """Runs `plans`, up to `parallel` at once; returns the records of those that started, in plan order.
        With `early_stop` the first that scores 1 cancels the running ones (recorded with status
        "cancelled") and those not started yet do not start."""
        ...

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
    parallel: int | None = None  # attempts at once; None: a round's branch count (restarts: the largest)


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


def wave_size(method: Method, branches: Sequence[int], parallel: int | None) -> int | None:
    """The restarts baseline's attempts at once, which its plans depend on; None for the other methods."""
    return (parallel or max(branches)) if method == "restarts" else None


def run_sequentially(attempt: Callable[[AttemptPlan], AttemptRecord], plans: Sequence[AttemptPlan],
                     early_stop: bool) -> list[AttemptRecord]:
    """`Executor.attempt_many` one plan after another, for executors that simulate attempts (tests, bench/)."""
    records: list[AttemptRecord] = []
    for plan in plans:
        records.append(attempt(plan))
        if early_stop and records[-1].solved:
            break
    return records


def run_method(config: MethodConfig, executor: Executor) -> MethodResult:
    if config.method == "sprout":
        return _sprout(config, executor)
    if config.method == "restarts":
        return _restarts(config, executor)
    return MethodResult(executor.attempt_many([_plan(config, "a1", "first")], config.early_stop, 1))


def _plan(config: MethodConfig, attempt_id: str, kind: str, **fields) -> AttemptPlan:
    return AttemptPlan(id=attempt_id, kind=kind, step_limit=config.step_limit, token_limit=config.token_limit,
                       **fields)


def _sprout(config: MethodConfig, executor: Executor) -> MethodResult:
    result = MethodResult(executor.attempt_many([_plan(config, "a1", "first")], config.early_stop, 1))
    target = result.attempts[0]
    if target.solved and config.early_stop:
        return result
    for round_number, n in enumerate(config.branches, start=1):
        review = executor.review(f"r{round_number}", round_number, target, n, list(result.attempts))
        result.reviews.append(review)
        by_id = {a.id: a for a in result.attempts}
        plans = []
        for i in range(n):
            point = review.branch_points[i % len(review.branch_points)]
            plans.append(_plan(config, f"r{round_number}b{i + 1}", "branch", round=round_number,
                               parent=owner_of(point.turn, target, by_id).id, from_turn=point.turn, note=point.note,
                               review=review.id, reason=point.reason))
        this_round = executor.attempt_many(plans, config.early_stop, config.parallel or n)
        result.attempts.extend(this_round)
        if config.early_stop and any(a.solved for a in this_round):
            return result
        failed = ([a for a in this_round if not a.solved and not a.cancelled]
                  or [a for a in result.attempts if not a.solved and not a.cancelled])
        if not failed:
            break
        order = {a.id: i for i, a in enumerate(result.attempts)}
        target = max(failed, key=lambda a: (a.reward or 0.0, order[a.id]))
    return result


def _restarts(config: MethodConfig, executor: Executor) -> MethodResult:
    result = MethodResult()
    budget, used = config.budget, 0
    wave = wave_size("restarts", config.branches, config.parallel) or 1
    while used < budget.amount:
        plans: list[AttemptPlan] = []
        committed = used
        while len(plans) < wave and committed < budget.amount:
            left = budget.amount - committed
            step_limit = min(config.step_limit, left) if budget.by == "turns" else config.step_limit
            token_limit = min(config.token_limit, left) if budget.by == "tokens" else config.token_limit
            n = len(result.attempts) + len(plans) + 1
            plans.append(AttemptPlan(id=f"a{n}", kind="first" if n == 1 else "restart", step_limit=step_limit,
                                     token_limit=token_limit))
            committed += step_limit if budget.by == "turns" else token_limit
        records = executor.attempt_many(plans, config.early_stop, wave)
        result.attempts.extend(records)
        used += sum(cost(a, budget.by) for a in records)
        if config.early_stop and any(a.solved for a in records):
            break
    return result
