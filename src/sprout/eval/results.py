"""Tables over many evaluations: per task (solved by which attempt, turns, tokens) and pass@budget per method.

pass@B is the share of tasks solved having spent at most B agent turns (everything run before the
solving attempt, and that attempt, counts), at multiples of the per-attempt step limit up to the
method's full budget: the curve compares methods at equal cost.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from ..method.budget import equal_budget
from .summary import SUMMARY, EvaluationSummary, read_summary


def find_summaries(directory: Path) -> list[EvaluationSummary]:
    """The evaluation in `directory`, or those in its subdirectories (sorted by name)."""
    directory = Path(directory)
    if (directory / SUMMARY).exists():
        return [read_summary(directory)]
    return [read_summary(p.parent) for p in sorted(directory.glob(f"*/{SUMMARY}"))]


@dataclass
class MethodRow:
    method: str
    tasks: int
    solved: int
    budget_turns: int
    pass_at: dict[int, float]  # budget in turns -> share of tasks solved within it
    turns_per_solve: float | None
    tokens_per_solve: float | None


def _budget_points(step_limit: int, budget: int) -> list[int]:
    points, m = [], 1
    while m * step_limit < budget:
        points.append(m * step_limit)
        m *= 2
    return points + [budget]


def method_rows(summaries: Sequence[EvaluationSummary]) -> list[MethodRow]:
    """One row per method (in first-seen order), over the tasks evaluated with it."""
    by_method: dict[str, list[EvaluationSummary]] = {}
    for summary in summaries:
        by_method.setdefault(summary.config.method, []).append(summary)
    rows = []
    for method, group in by_method.items():
        step_limit = min(s.config.step_limit for s in group)
        budget = max(equal_budget(method, "turns", s.config.step_limit, s.config.token_limit, s.config.branches).amount
                     for s in group)
        costs = [s.cost_to_solve("turns") for s in group]
        solved = [c for c in costs if c is not None]
        tokens = [s.cost_to_solve("tokens") for s in group if s.solved_by]
        rows.append(MethodRow(
            method=method, tasks=len(group), solved=len(solved), budget_turns=budget,
            pass_at={b: sum(1 for c in solved if c <= b) / len(group) for b in _budget_points(step_limit, budget)},
            turns_per_solve=sum(solved) / len(solved) if solved else None,
            tokens_per_solve=sum(t for t in tokens if t is not None) / len(tokens) if tokens else None))
    return rows


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def pass_table(rows: Sequence[MethodRow]) -> Table:
    budgets = sorted({b for row in rows for b in row.pass_at})
    table = Table("method", "tasks", "solved", *[f"pass@{b}" for b in budgets], "turns/solve", "tokens/solve",
                  title="pass@budget (agent turns spent, at equal budget)")
    for row in rows:
        cells = [f"{row.pass_at[b]:.0%}" if b in row.pass_at else "" for b in budgets]
        table.add_row(row.method, str(row.tasks), f"{row.solved} ({row.solved / row.tasks:.0%})", *cells,
                      _fmt(row.turns_per_solve), _fmt(row.tokens_per_solve, 0))
    return table


def pass_markdown(rows: Sequence[MethodRow]) -> str:
    budgets = sorted({b for row in rows for b in row.pass_at})
    head = ["method", "tasks", "solved", *[f"pass@{b}" for b in budgets], "turns/solve", "tokens/solve"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [f"{row.pass_at[b]:.0%}" if b in row.pass_at else "" for b in budgets]
        lines.append("| " + " | ".join([row.method, str(row.tasks), f"{row.solved} ({row.solved / row.tasks:.0%})",
                                        *cells, _fmt(row.turns_per_solve), _fmt(row.tokens_per_solve, 0)]) + " |")
    return "\n".join(lines) + "\n"


def task_rows(summaries: Sequence[EvaluationSummary]) -> list[list[str]]:
    """Per evaluation: task, method, status, solved by, attempts, turns, tokens, best reward, wall time."""
    rows = []
    for s in sorted(summaries, key=lambda s: (s.config.task, s.config.method)):
        tokens = s.totals.tokens_in + s.totals.tokens_out + s.totals.review_tokens
        rows.append([s.config.task, s.config.method, s.status, s.solved_by or "-", str(s.totals.attempts),
                     str(s.totals.turns), f"{tokens:,}", _fmt(s.best_reward, 2), f"{s.wall_s:.0f}s"])
    return rows


TASK_COLUMNS = ["task", "method", "status", "solved by", "attempts", "turns", "tokens", "best reward", "wall"]


def task_table(summaries: Sequence[EvaluationSummary]) -> Table:
    table = Table(*TASK_COLUMNS, title="per task")
    for row in task_rows(summaries):
        table.add_row(*row)
    return table


def task_markdown(summaries: Sequence[EvaluationSummary]) -> str:
    lines = ["| " + " | ".join(TASK_COLUMNS) + " |", "|" + "---|" * len(TASK_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in task_rows(summaries)]
    return "\n".join(lines) + "\n"
