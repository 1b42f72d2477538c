"""Equal budgets: what SPROUT may spend at most, given to the restarts baseline; and pass@budget.

The rule: SPROUT runs one first attempt plus sum(branches) branches, each capped at the per-attempt
limit (`step_limit` turns, or `token_limit` tokens; a branch of turn k counts its own turns only and
stops at step_limit - k new turns). So its budget is

    budget = limit x (1 + sum(branches))

and `restarts` runs fresh attempts, each capped at min(limit, what is left), until that budget is
spent or one solves the task. `single` is one attempt (budget = limit). Turn budgets count agent
turns; token budgets count agent tokens plus, for SPROUT, the reviewer's tokens.
"""

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel

from ..errors import SproutError
from .records import AttemptRecord, ReviewRecord

BudgetBy = Literal["turns", "tokens"]


class Budget(BaseModel):
    by: BudgetBy
    amount: int
    rule: str


def equal_budget(method: str, by: BudgetBy, step_limit: int, token_limit: int, branches: Sequence[int]) -> Budget:
    """The budget of `method` under the rule above."""
    limit = step_limit if by == "turns" else token_limit
    if limit <= 0:
        raise SproutError(f"--budget-by {by} needs a positive --{'step' if by == 'turns' else 'token'}-limit")
    attempts = 1 if method == "single" else 1 + sum(branches)
    rule = f"{limit:,} {by} per attempt x {attempts} attempt{'s' if attempts > 1 else ''}"
    if method != "single":
        rule += f" (1 first + {' + '.join(map(str, branches))} branches)"
    return Budget(by=by, amount=limit * attempts, rule=rule)


def cost(attempt: AttemptRecord, by: BudgetBy) -> int:
    """What one attempt spent (at least 1, so that a loop over attempts always ends)."""
    return max(1, attempt.turns if by == "turns" else attempt.tokens)


def cost_to_solve(attempts: Sequence[AttemptRecord], reviews: Sequence[ReviewRecord], by: BudgetBy) -> int | None:
    """What was spent, in plan order, up to and including the first attempt that solved; None if none did.
    A review counts once the first branch it planned has run; a cancelled attempt counts nothing."""
    total, counted = 0, set()
    by_id = {r.id: r for r in reviews}
    for attempt in attempts:
        if attempt.cancelled:
            continue
        if by == "tokens" and attempt.review and attempt.review not in counted and attempt.review in by_id:
            counted.add(attempt.review)
            total += by_id[attempt.review].tokens_in + by_id[attempt.review].tokens_out
        total += cost(attempt, by)
        if attempt.solved:
            return total
    return None
