"""A search task's outcome from its roots, which Sprout and Miles both compute."""

from __future__ import annotations

from typing import TypeGuard


def search_outcome(planned: int, graded: int, resolved: int) -> str:
    """The label of a search task from its roots: ``planned`` (``search.roots``), ``graded`` (roots whose
    grade gave a verdict; a failed slot is not graded) and ``resolved`` (graded roots with reward 1).

    ======================================  ==============
    condition                               outcome
    ======================================  ==============
    graded == 0                             ``ungraded``
    resolved == graded == planned           ``TT``
    resolved == graded < planned            ``TT_partial``
    1 <= resolved < graded                  ``TF``
    resolved == 0, graded == planned        ``FF``
    resolved == 0, graded < planned         ``FF_partial``
    ======================================  ==============

    Raises ValueError unless the counts are ints with ``0 <= resolved <= graded <= planned``.
    """
    counts = (planned, graded, resolved)
    if any(type(count) is not int for count in counts) or not 0 <= resolved <= graded <= planned:
        raise ValueError(
            f"expected ints with 0 <= resolved <= graded <= planned, got {planned=}, {graded=}, {resolved=}"
        )
    if graded == 0:
        return "ungraded"
    every_root_graded = graded == planned
    if resolved == graded:
        return "TT" if every_root_graded else "TT_partial"
    if resolved == 0:
        return "FF" if every_root_graded else "FF_partial"
    return "TF"


def root_counts(planned: int, roots: list[dict | None]) -> dict[str, int]:
    """The counts Miles recomputes from the returned roots: `roots` holds each root slot's trajectory (None
    when its actor failed or it has not returned); a root is graded when its grade gave a verdict
    (`metadata.zero_reason` is null) and resolved when it is graded with reward 1."""
    graded_roots = [t for t in roots if graded(t)]
    return {"planned": planned, "graded": len(graded_roots), "resolved": sum(1 for t in graded_roots if resolved(t))}


def graded(trajectory: dict | None) -> TypeGuard[dict]:
    """The trajectory's grade gave a verdict (no `zero_reason`)."""
    return trajectory is not None and trajectory["metadata"].get("zero_reason") is None


def resolved(trajectory: dict | None) -> bool:
    return graded(trajectory) and trajectory["reward"] == 1


def failed(trajectory: dict | None) -> bool:
    """Graded, and not resolved."""
    return graded(trajectory) and trajectory["reward"] != 1


def annotate(trajectories: list[dict], counts: dict[str, int]) -> None:
    """Adds the search's outcome and root counts to every trajectory's `metadata.search`."""
    outcome = search_outcome(**counts)
    for trajectory in trajectories:
        search = trajectory["metadata"].get("search") or {}
        trajectory["metadata"]["search"] = {**search, "outcome": outcome, "root_counts": dict(counts)}
