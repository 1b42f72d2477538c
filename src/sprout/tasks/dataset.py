"""Dataset directories as Harbor reads them, and task-ids files that pick a subset of one.

A dataset directory holds task directories next to things that are not tasks: DeepSWE's `tasks/` has
`dataset.toml`, `manifest.json` and a symlinked README; SWE-bench Pro v2 keeps `hard51_ids.txt` and
`SHA256SUMS` beside its `tasks/`. A task-ids file (HARD-51's `hard51_ids.txt`) names tasks by their
directory names, one a line.
"""

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from .errors import TaskError

TASK_MARKERS = ("task.toml", "instruction.md", "environment")  # what makes a directory look like a task
SUMS_FILE = "SHA256SUMS"
SUMS_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")  # sha256sum's text and binary modes
SHOWN = 5  # unknown ids named in an error


def task_dirs(tasks_dir: Path) -> list[Path]:
    """The task directories of a dataset, sorted by name; the directory itself if it is a task.

    As Harbor 0.22 reads a local dataset (`Task.is_valid_dir` over `iterdir()`): entries that are not
    directories (files, symlinks to files, broken symlinks) are ignored, and symlinks to directories
    are followed (the task keeps the link's name). Harbor also drops directories that are not valid
    tasks without a word; Sprout keeps those that look like tasks (a `task.toml`, an `instruction.md`
    or an `environment/`), so that loading reports what is broken in them, and ignores the rest
    (helper directories such as `tooling/`). Hidden and `_`-prefixed directories are ignored.
    """
    tasks_dir = Path(tasks_dir)
    if not tasks_dir.is_dir():
        raise TaskError(f"no tasks directory {tasks_dir}")
    if (tasks_dir / "task.toml").exists():
        return [tasks_dir]
    return sorted(p for p in tasks_dir.iterdir()
                  if not p.name.startswith((".", "_")) and p.is_dir() and looks_like_task(p))


def looks_like_task(path: Path) -> bool:
    """Whether a directory has any of a Harbor task's landmarks (it may still be a broken task)."""
    return any((path / marker).exists() for marker in TASK_MARKERS)


# ------------------------------------------------------------------ task-ids files

class TaskIdsFile(BaseModel):
    """What a preparation or run records of the task-ids file that chose its tasks."""

    model_config = ConfigDict(extra="forbid")

    path: str  # absolute
    sha256: str  # sha256:<hex> of the file's bytes
    count: int  # distinct ids in it
    checked: bool  # True when a SHA256SUMS beside the dataset lists the file (and its digest matched)
    sums_file: str | None = None  # that SHA256SUMS


@dataclass(frozen=True)
class TaskIds:
    """The ids a task-ids file selects, and what to record of the file."""

    ids: list[str]
    record: TaskIdsFile


def parse_task_ids(text: str) -> list[str]:
    """The ids of a task-ids file's text, in order, each once; blank lines and `#` comments are skipped."""
    ids: dict[str, None] = {}
    for line in text.splitlines():
        task_id = re.sub(r"(^|\s)#.*$", "", line).strip()
        if task_id:
            ids[task_id] = None
    return list(ids)


def read_task_ids(path: Path) -> tuple[list[str], bytes]:
    """The ids in the file at `path`, and its bytes; TaskError when it cannot be read or lists none."""
    path = Path(path)
    try:
        data = path.read_bytes()
        ids = parse_task_ids(data.decode())
    except FileNotFoundError:
        raise TaskError(f"no task-ids file {path}") from None
    except IsADirectoryError:
        raise TaskError(f"the task-ids file {path} is a directory, not a file") from None
    except UnicodeDecodeError:
        raise TaskError(f"the task-ids file {path} is not UTF-8 text") from None
    except OSError as e:
        raise TaskError(f"cannot read the task-ids file {path}: {e.strerror}") from None
    if not ids:
        raise TaskError(f"the task-ids file {path} lists no task ids (one task directory name a line; "
                        "blank lines and # comments are ignored)")
    return ids, data


def check_known(ids: list[str], known: set[str], path: Path, tasks_dir: Path) -> None:
    """Refuses (TaskError naming the count and up to five of them) ids that are not tasks of the dataset."""
    unknown = [task_id for task_id in ids if task_id not in known]
    if unknown:
        shown = ", ".join(unknown[:SHOWN]) + (", ..." if len(unknown) > SHOWN else "")
        raise TaskError(f"{len(unknown)} of the {len(ids)} ids in {path} are not tasks of {tasks_dir}: "
                        f"{shown}")


def sums_files(tasks_dir: Path) -> list[Path]:
    """The SHA256SUMS files of a dataset: in its tasks directory, then in the directory above."""
    tasks_dir = Path(tasks_dir).resolve()
    return [d / SUMS_FILE for d in (tasks_dir, tasks_dir.parent) if (d / SUMS_FILE).is_file()]


def listed_digest(sums: Path, path: Path) -> str | None:
    """The hex digest `sums` (sha256sum's format, paths relative to its directory) gives for `path`."""
    try:
        relative = Path(path).resolve().relative_to(sums.parent.resolve()).as_posix()
    except ValueError:
        return None  # outside the directory that SHA256SUMS covers
    for line in sums.read_text(errors="replace").splitlines():
        match = SUMS_LINE.match(line.strip())
        if match and match.group(2).removeprefix("./") == relative:
            return match.group(1).lower()
    return None


def check_sums(path: Path, digest: str, tasks_dir: Path) -> Path | None:
    """The SHA256SUMS that lists `path` with `digest` (hex), or None; TaskError if its line differs."""
    for sums in sums_files(tasks_dir):
        listed = listed_digest(sums, path)
        if listed is None:
            continue
        if listed != digest:
            raise TaskError(f"the task-ids file {path} does not match {sums}: its sha256 is {digest}, "
                            f"{sums.name} says {listed}")
        return sums
    return None


def load_task_ids(path: Path, tasks_dir: Path) -> TaskIds:
    """The ids of a task-ids file for the dataset at `tasks_dir`, and what to record of the file.

    Refuses (TaskError, one line) a missing or empty file, ids that are not task directories of the
    dataset, and a file whose digest differs from its line in a SHA256SUMS beside the dataset.
    """
    path = Path(path)
    ids, data = read_task_ids(path)
    digest = hashlib.sha256(data).hexdigest()
    sums = check_sums(path, digest, tasks_dir)
    check_known(ids, {d.name for d in task_dirs(tasks_dir)}, path, Path(tasks_dir))
    record = TaskIdsFile(path=str(path.resolve()), sha256=f"sha256:{digest}", count=len(ids),
                         checked=sums is not None, sums_file=str(sums) if sums else None)
    return TaskIds(ids, record)


def describe(record: TaskIdsFile) -> str:
    """One line for a run's output: which ids file chose the tasks, and whether it was checked."""
    check = f"checked against {record.sums_file}" if record.checked else "unchecked: in no SHA256SUMS"
    return f"{record.count} task ids from {record.path} ({record.sha256}, {check})"
