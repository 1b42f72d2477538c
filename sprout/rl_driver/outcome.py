"""A search task's outcome from its roots, which Sprout and Miles both compute."""

from __future__ import annotations


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
