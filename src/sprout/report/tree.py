"""The tree of an evaluation's attempts: each branch hangs under the turn of the attempt it branched from,
with the review's reason and the mistake it named; every attempt shows its turns and reward."""

from collections.abc import Callable

from rich.text import Text
from rich.tree import Tree

from ..eval.summary import EvaluationSummary
from ..method.records import AttemptRecord, BranchPoint


def _short(text: str, width: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _headline(s: EvaluationSummary) -> str:
    result = f"solved by {s.solved_by}" if s.solved_by else s.status
    tokens = s.totals.tokens_in + s.totals.tokens_out + s.totals.review_tokens
    rounds = f" · rounds {s.config.rounds}, branches {' '.join(map(str, s.config.branches))}" \
        if s.config.method == "sprout" else ""
    return (f"{s.config.task} · {s.config.method}{rounds} · {result} · {s.totals.attempts} attempts · "
            f"{s.totals.turns} turns · {tokens:,} tokens · {s.wall_s:.1f}s · model {s.config.model}")


def _attempt_text(a: AttemptRecord) -> str:
    kind = {"first": "first attempt", "restart": "restart", "branch": "branch"}[a.kind]
    turns = f"turns {a.first_turn}-{a.last_turn}" if a.turns else "no turns"
    reward = "no reward" if a.reward is None else f"reward {a.reward:g}"
    mark = "✓" if a.solved else "✗"
    text = f"{a.id} {kind} · {turns} ({a.turns}) · {a.status} · {reward} ({a.verdict}) {mark}"
    if a.grade_error:
        text += f" · grading: {_short(a.grade_error, 60)}"
    if a.note and a.kind == "branch":
        text += f' · note: "{_short(a.note, 70)}"'
    return text


def _point_text(turn: int, review_id: str | None, reason: str | None, point: BranchPoint | None,
                fallback: bool) -> str:
    where = "from the start" if turn == 0 else f"turn {turn}"
    text = f"{where} ← {review_id}{' (fallback rule)' if fallback else ''}: {_short(reason or '', 80)}"
    if point is not None and not fallback:
        text += f" (mistake at turn {point.mistake_turn}: {_short(point.mistake, 70)})"
    return text


def _walk(s: EvaluationSummary, emit_attempt: Callable, emit_point: Callable) -> None:
    """Visits the tree: attempts without a parent, then under each attempt its branch points (by turn),
    under each point the attempts branched from it. The emitters return the node to nest under."""
    reviews = {r.id: r for r in s.reviews}
    children: dict[str, list[AttemptRecord]] = {}
    for a in s.attempts:
        if a.parent is not None:
            children.setdefault(a.parent, []).append(a)

    def visit(a: AttemptRecord, parent_node) -> None:
        node = emit_attempt(parent_node, a)
        groups: dict[tuple[int, str | None], list[AttemptRecord]] = {}
        for child in sorted(children.get(a.id, []), key=lambda c: (c.from_turn or 0, c.id)):
            groups.setdefault((child.from_turn or 0, child.review), []).append(child)
        for (turn, review_id), branch_list in groups.items():
            review = reviews.get(review_id) if review_id else None
            point = next((p for p in review.branch_points if p.turn == turn), None) if review else None
            point_node = emit_point(node, _point_text(turn, review_id, branch_list[0].reason, point,
                                                      bool(review and review.fallback)))
            for child in branch_list:
                visit(child, point_node)

    for a in s.attempts:
        if a.parent is None:
            visit(a, None)


def render_tree(s: EvaluationSummary) -> Tree:
    """The attempts of one evaluation as a rich Tree."""
    colour = "green" if s.solved_by else ("red" if s.status == "error" else "yellow")
    tree = Tree(Text(_headline(s), style=f"bold {colour}"))

    def attempt(parent, a: AttemptRecord):
        style = "green" if a.solved else ("red" if a.verdict == "error" else "")
        return (parent or tree).add(_attempt_text(a), style=style)

    _walk(s, attempt, lambda parent, text: parent.add(text, style="cyan"))
    for review in s.reviews:
        if review.fallback:
            tree.add(f"{review.id}: fallback rule used ({_short(review.fallback, 120)})", style="magenta")
    if s.error:
        tree.add(f"error: {s.error}", style="red")
    return tree


def tree_markdown(s: EvaluationSummary) -> str:
    lines = [f"## {s.config.task} ({s.config.method})", "", _headline(s), ""]

    def attempt(depth, a: AttemptRecord):
        lines.append(f"{'  ' * (depth or 0)}- **{a.id}** {_attempt_text(a).removeprefix(a.id + ' ')}")
        return (depth or 0) + 1

    def point(depth, text: str):
        lines.append(f"{'  ' * depth}- {text}")
        return depth + 1

    _walk(s, attempt, point)
    lines += [f"\n> {r.id}: fallback rule used ({r.fallback})" for r in s.reviews if r.fallback]
    if s.error:
        lines.append(f"\n> error: {s.error}")
    return "\n".join(lines) + "\n"
