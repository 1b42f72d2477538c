"""Files readers may look at while they are written."""

from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Writes `text` to `path` through a temporary file and a rename, so a reader (a viewer, a resumed run)
    sees the old file or the new one, never half of one. Creates the parent directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
