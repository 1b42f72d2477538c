"""Pinning an evaluation: Harbor's digests, the preparation manifest, and the state of Sprout's own checkout.

- A task's digest is Harbor's task content hash (`Packager.compute_content_hash`, written `sha256:<hex>`),
  the one Harbor's lock files, `harbor add` and `harbor sync` write.
- A dataset's digest is Harbor's dataset manifest hash (`DatasetManifest.compute_content_hash`) over
  every task directory of the tasks directory, plus the `[[files]]` a `dataset.toml` there lists
  (their digests computed from the files beside it, as `harbor sync` does). Task names do not enter it.
"""

import hashlib
import os
import re
import subprocess
from datetime import datetime
from importlib import metadata
from pathlib import Path

from harbor.models.dataset.manifest import DatasetFileRef, DatasetInfo, DatasetManifest, DatasetTaskRef
from harbor.models.dataset.paths import DatasetPaths
from harbor.publisher.packager import Packager
from pydantic import BaseModel, Field, ValidationError

from .. import __version__
from ..agent.journal import now
from ..checkout import CHECKOUT
from ..errors import SproutError
from ..tasks.dataset import TaskIdsFile, task_dirs

SOURCE_REPO = CHECKOUT  # the checkout Sprout runs from
MANIFEST_KIND = "sprout.preparation"


def task_digest(task_dir: Path) -> str:
    """Harbor's content hash of a task directory, as `sha256:<hex>`."""
    content_hash, _ = Packager.compute_content_hash(Path(task_dir))
    return f"sha256:{content_hash}"


def file_digest(path: Path) -> str:
    return f"sha256:{Packager.compute_file_hash(Path(path))}"


def _harbor_name(name: str) -> str:
    """A name in Harbor's `org/name` form (characters Harbor refuses become '-')."""
    parts = [re.sub(r"[^A-Za-z0-9._-]", "-", p).lstrip(".-_") or "x" for p in name.split("/", 1)]
    return "/".join(parts) if len(parts) == 2 else f"local/{parts[0]}"


def dataset_manifest(tasks_dir: Path, name: str | None = None) -> DatasetManifest:
    """Harbor's dataset manifest of a tasks directory: every task directory with its digest."""
    tasks_dir = Path(tasks_dir).resolve()
    toml_path = DatasetPaths(tasks_dir).manifest_path
    try:
        declared = DatasetManifest.from_toml_file(toml_path) if toml_path.is_file() else None
    except (ValueError, ValidationError) as e:  # tomllib.TOMLDecodeError is a ValueError
        raise SproutError(f"{toml_path} is not a valid Harbor dataset.toml: {' '.join(str(e).split())[:300]}") from None
    files = []
    for ref in declared.files if declared else []:
        path = tasks_dir / ref.path
        if not path.is_file():
            raise SproutError(f"{toml_path} lists the file {ref.path}, which is not in {tasks_dir}")
        files.append(DatasetFileRef(path=ref.path, digest=file_digest(path)))
    dataset_name = name or (declared.dataset.name if declared else _harbor_name(tasks_dir.name))
    org = dataset_name.split("/")[0]
    tasks = [DatasetTaskRef(name=_harbor_name(f"{org}/{d.name}"), digest=task_digest(d)) for d in task_dirs(tasks_dir)]
    return DatasetManifest(dataset=DatasetInfo(name=_harbor_name(dataset_name)), tasks=tasks, files=files)


def dataset_digest(tasks_dir: Path) -> str:
    """Harbor's dataset digest of a tasks directory, as `sha256:<hex>`."""
    return f"sha256:{dataset_manifest(tasks_dir).compute_content_hash()}"


def sha256_of(path: Path) -> str:
    return f"sha256:{hashlib.sha256(Path(path).read_bytes()).hexdigest()}"


# ------------------------------------------------------------------ the preparation manifest

class PreparedImage(BaseModel):
    reference: str  # the podman name
    image_id: str
    key: str  # the store's image key


class PreparedTask(BaseModel):
    name: str  # the task's directory name
    digest: str
    image: PreparedImage | None = None
    problem: str | None = None  # why the task cannot run (then it has no image)


class PreparedDataset(BaseModel):
    name: str
    source: str  # the tasks directory it was prepared from
    digest: str
    ref: str | None = None  # the version or tag `sprout datasets get` fetched (its sprout-dataset.json)
    origin: str | None = None  # where that came from: a registry, or a git repository (and its commit)


class PrepTool(BaseModel):
    name: str = "sprout.eval.prepare"
    version: str = __version__
    harbor_version: str = metadata.version("harbor")
    git_commit: str | None = None
    dirty: bool = False


class FlakyExclusion(BaseModel):
    """The tasks left out because a gate with trials found them flaky (`--exclude-flaky SUMMARY`)."""

    gate_summary: str  # the gate's summary.json
    sha256: str  # of that file, as read
    trials: int
    tasks: list[str]


class PreparationManifest(BaseModel):
    kind: str = MANIFEST_KIND
    schema_version: int = 1
    dataset: PreparedDataset
    tasks: list[PreparedTask]
    task_ids: TaskIdsFile | None = None  # the --task-ids-file that chose `tasks` (None: every task)
    excluded_flaky: FlakyExclusion | None = None  # tasks not prepared: a gate found them flaky
    prep_tool: PrepTool
    created: datetime = Field(default_factory=now)

    def task(self, name: str) -> PreparedTask | None:
        return next((t for t in self.tasks if t.name == name), None)


def read_manifest(path: Path) -> PreparationManifest:
    try:
        return PreparationManifest.model_validate_json(Path(path).read_text())
    except FileNotFoundError:
        raise SproutError(f"no preparation manifest at {path} (write one: sprout prepare "
                          "--tasks-dir DIR -o FILE)") from None
    except ValidationError as e:
        first = e.errors()[0]
        raise SproutError(f"{path} is not a Sprout preparation manifest ({'.'.join(map(str, first['loc']))}: "
                          f"{first['msg']})") from None


class Pinning(BaseModel):
    """What an evaluation was pinned to, as its summary records it."""

    task: str
    task_digest: str
    dataset_digest: str
    dataset_name: str
    manifest_path: str
    manifest_sha256: str
    prepared_image: PreparedImage | None


def check_pinning(task_dir: Path, dataset_digest_arg: str, manifest_path: Path) -> Pinning:
    """Refuses (SproutError, showing both values) unless the task, its dataset and the manifest agree.
    A symlinked task directory belongs to the dataset that holds the link, under the link's name."""
    task_dir = Path(os.path.abspath(task_dir))
    if not task_dir.is_dir():
        raise SproutError(f"no task directory {task_dir}")
    manifest = read_manifest(manifest_path)
    computed_dataset = dataset_digest(task_dir.parent)
    if dataset_digest_arg != computed_dataset:
        raise SproutError(f"dataset digest mismatch: --dataset-digest is {dataset_digest_arg} but the tasks "
                          f"directory {task_dir.parent} has {computed_dataset}")
    if manifest.dataset.digest != computed_dataset:
        raise SproutError(f"dataset digest mismatch: the manifest {manifest_path} has {manifest.dataset.digest} "
                          f"but the tasks directory {task_dir.parent} has {computed_dataset}")
    computed_task = task_digest(task_dir)
    prepared = manifest.task(task_dir.name)
    if prepared is None:
        raise SproutError(f"the manifest {manifest_path} does not list the task {task_dir.name} "
                          f"(its digest here is {computed_task})")
    if prepared.digest != computed_task:
        raise SproutError(f"task digest mismatch for {task_dir.name}: the manifest {manifest_path} has "
                          f"{prepared.digest} but the task directory has {computed_task}")
    if prepared.problem:
        raise SproutError(f"the manifest marks the task {task_dir.name} as not runnable: {prepared.problem}")
    return Pinning(task=task_dir.name, task_digest=computed_task, dataset_digest=computed_dataset,
                   dataset_name=manifest.dataset.name, manifest_path=str(Path(manifest_path).resolve()),
                   manifest_sha256=sha256_of(manifest_path), prepared_image=prepared.image)


# ------------------------------------------------------------------ the source checkout

class SourceState(BaseModel):
    """Sprout's own checkout: the commit, and whether uncommitted changes were allowed."""

    repo: str
    commit: str | None
    dirty: bool
    changes: list[str] = []  # `git status --porcelain` lines (at most 20)
    allow_dirty: bool = False


def source_state(repo: Path = SOURCE_REPO) -> SourceState:
    """The git state of `repo`; a directory that is not a git checkout has no commit and is not dirty."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)

    try:
        head = git("rev-parse", "HEAD")
    except OSError:
        return SourceState(repo=str(repo), commit=None, dirty=False)
    if head.returncode != 0:
        return SourceState(repo=str(repo), commit=None, dirty=False)
    status = git("status", "--porcelain")
    changes = [line for line in status.stdout.splitlines() if line.strip()]
    return SourceState(repo=str(repo), commit=head.stdout.strip(), dirty=bool(changes), changes=changes[:20])


def check_source(allow_dirty: bool, repo: Path | None = None) -> SourceState:
    """Refuses to evaluate from a checkout with uncommitted changes unless `allow_dirty` (then recorded)."""
    state = source_state(repo or SOURCE_REPO)
    if state.dirty and not allow_dirty:
        shown = ", ".join(line[3:] for line in state.changes[:5]) + (" ..." if len(state.changes) > 5 else "")
        raise SproutError(f"the Sprout checkout {state.repo} has uncommitted changes ({shown}); commit them so "
                          "the evaluation records the code it ran, or pass --allow-dirty (recorded as such)")
    return state.model_copy(update={"allow_dirty": allow_dirty})
