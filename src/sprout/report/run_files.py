"""What the viewer's pages share: the base of its JSON models, and reading only inside a run directory."""

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..errors import SproutError


class View(BaseModel):
    """JSON the page receives: unknown fields are refused, so a page and its API never drift apart silently."""

    model_config = ConfigDict(extra="forbid")


def inside(root: Path, relative: str) -> Path:
    """`relative` in the run directory `root`, refused when it (or a link on the way) leads outside."""
    resolved_root = root.resolve()
    path = (resolved_root / relative).resolve()
    if not path.is_relative_to(resolved_root):
        raise SproutError(f"{relative} is outside the run directory {root}: not shown")
    return path
