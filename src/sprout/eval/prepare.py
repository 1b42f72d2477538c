"""Pinning a dataset, `prepare(...)`: Harbor digests, task images, a preparation manifest.

Computes every task's Harbor digest and the dataset's, builds each runnable task's image (offline,
cached by its environment's hash) and writes the manifest that an evaluation and a benchmark check
before they run. A task that cannot run is listed with its problem. With task ids only the tasks they
name are prepared (the dataset digest still covers every task) and the manifest records the file (path,
sha256, count, checked against a SHA256SUMS beside the dataset or not).
"""

from pathlib import Path

from rich.progress import Progress

from ..console import console
from ..sandbox import Store
from ..tasks import TaskError, ensure_image, load_task
from ..tasks.dataset import TaskIds, task_dirs
from ..tasks.pull import PullPolicy
from .datasets import read_record
from .provenance import (
    FlakyExclusion,
    PreparationManifest,
    PreparedDataset,
    PreparedImage,
    PreparedTask,
    PrepTool,
    dataset_manifest,
    source_state,
    task_digest,
)


def prepare(tasks_dir: Path, output: Path, *, name: str | None = None, store: Store | None = None,
            task_ids: TaskIds | None = None, pull: PullPolicy | None = None,
            exclude_flaky: FlakyExclusion | None = None) -> PreparationManifest:
    """Writes the preparation manifest of `tasks_dir` to `output` and returns it; without a store no
    images are built (and none are recorded). With `task_ids` (`load_task_ids`), only the tasks it names;
    with `exclude_flaky` (eval.gate.flaky_exclusion), not the tasks a gate found flaky (recorded)."""
    tasks_dir = Path(tasks_dir).resolve()
    harbor_manifest = dataset_manifest(tasks_dir, name)
    source = source_state()
    prepared: list[PreparedTask] = []
    dirs = [d for d in task_dirs(tasks_dir) if task_ids is None or d.name in task_ids.ids]
    if exclude_flaky is not None:
        dirs = [d for d in dirs if d.name not in exclude_flaky.tasks]
    with Progress(console=console, transient=True) as progress:
        bar = progress.add_task("preparing tasks", total=len(dirs))
        for task_dir in dirs:
            progress.update(bar, description=f"preparing {task_dir.name}")
            prepared.append(_prepare_task(task_dir, store, pull))
            progress.advance(bar)
    fetched = read_record(tasks_dir)
    manifest = PreparationManifest(
        dataset=PreparedDataset(name=harbor_manifest.dataset.name, source=str(tasks_dir),
                                digest=f"sha256:{harbor_manifest.compute_content_hash()}",
                                ref=fetched.ref if fetched else None, origin=fetched.origin() if fetched else None),
        tasks=prepared, task_ids=task_ids.record if task_ids else None, excluded_flaky=exclude_flaky,
        prep_tool=PrepTool(git_commit=source.commit, dirty=source.dirty))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(manifest.model_dump_json(indent=2))
    return manifest


def _prepare_task(task_dir: Path, store: Store | None, pull: PullPolicy | None) -> PreparedTask:
    digest = task_digest(task_dir)
    try:
        task = load_task(task_dir)
        if store is None:
            return PreparedTask(name=task_dir.name, digest=digest)
        built = ensure_image(store, task.paths.environment_dir, task.config.environment, name=task_dir.name,
                             pull=pull)
    except TaskError as e:
        return PreparedTask(name=task_dir.name, digest=digest, problem=str(e))
    image = PreparedImage(reference=built.reference, image_id=built.image.image_id, key=built.image.key)
    return PreparedTask(name=task_dir.name, digest=digest, image=image)


if __name__ == "__main__":  # the seed's form of `sprout prepare`
    from ..cli import alias

    alias("sprout.eval.prepare")
