"""python -m sprout.eval.prepare: pin a dataset: Harbor digests, task images, a preparation manifest.

    python -m sprout.eval.prepare --tasks-dir DIR -o runs/prep.json

Computes every task's Harbor digest and the dataset's, builds each runnable task's image (offline,
cached by its environment's hash) and writes the manifest that `sprout.eval.evaluate` and
`sprout.eval.benchmark` check before they run. A task that cannot run is listed with its problem.
Prints the dataset digest (pass it as --dataset-digest).
"""

import argparse
from pathlib import Path

from rich.progress import Progress

from ..console import console, errors, run_cli
from ..sandbox import Store
from ..tasks import TaskError, ensure_image, load_task
from ..tasks.loading import task_dirs
from .provenance import (PreparationManifest, PreparedDataset, PreparedImage, PreparedTask, PrepTool,
                         dataset_manifest, source_state, task_digest)


def prepare(tasks_dir: Path, output: Path, *, name: str | None = None, store: Store | None = None) -> PreparationManifest:
    """Writes the preparation manifest of `tasks_dir` to `output` and returns it; without a store no
    images are built (and none are recorded)."""
    tasks_dir = Path(tasks_dir).resolve()
    harbor_manifest = dataset_manifest(tasks_dir, name)
    source = source_state()
    prepared: list[PreparedTask] = []
    dirs = task_dirs(tasks_dir)
    with Progress(console=console, transient=True) as progress:
        bar = progress.add_task("preparing tasks", total=len(dirs))
        for task_dir in dirs:
            progress.update(bar, description=f"preparing {task_dir.name}")
            prepared.append(_prepare_task(task_dir, store))
            progress.advance(bar)
    manifest = PreparationManifest(
        dataset=PreparedDataset(name=harbor_manifest.dataset.name, source=str(tasks_dir),
                                digest=f"sha256:{harbor_manifest.compute_content_hash()}"),
        tasks=prepared, prep_tool=PrepTool(git_commit=source.commit, dirty=source.dirty))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(manifest.model_dump_json(indent=2))
    return manifest


def _prepare_task(task_dir: Path, store: Store | None) -> PreparedTask:
    digest = task_digest(task_dir)
    try:
        task = load_task(task_dir)
        if store is None:
            return PreparedTask(name=task_dir.name, digest=digest)
        built = ensure_image(store, task.paths.environment_dir, task.config.environment, name=task_dir.name)
    except TaskError as e:
        return PreparedTask(name=task_dir.name, digest=digest, problem=str(e))
    image = PreparedImage(reference=built.reference, image_id=built.image.image_id, key=built.image.key)
    return PreparedTask(name=task_dir.name, digest=digest, image=image)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m sprout.eval.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks-dir", type=Path, required=True, help="directory of Harbor task directories")
    p.add_argument("-o", "--output", type=Path, required=True, help="manifest to write (JSON)")
    p.add_argument("--name", help="dataset name, org/name (default: dataset.toml's, else local/<dir name>)")
    p.add_argument("--no-images", action="store_true", help="only digests: do not build the task images")
    p.add_argument("--store", type=Path, help="btrfs store (default: $SPROUT_STORE or ~/sprout-btrfs)")
    args = p.parse_args(argv)
    store = None if args.no_images else Store(args.store)
    manifest = prepare(args.tasks_dir, args.output, name=args.name, store=store)
    for task in manifest.tasks:
        if task.problem:
            errors.print(f"skipped: {task.problem}")
    ready = sum(1 for t in manifest.tasks if not t.problem)
    console.print(f"{manifest.dataset.name}: {ready} of {len(manifest.tasks)} tasks ready; wrote {args.output}")
    console.print(f"dataset digest {manifest.dataset.digest}")
    return 0


if __name__ == "__main__":
    run_cli(main)
