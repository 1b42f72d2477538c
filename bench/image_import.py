"""Image import benchmark: a task image unpacked into the store alone against on its base image, in one run.

    .venv/bin/python bench/image_import.py [--n 3] [--image docker.io/library/python:3.11-slim]

A task image is built once: `FROM --image` + a venv with pip upgraded offline + WORKDIR /app (a layer of
a few tens of MB on a base of ~300 MB, as task environments are). Each of --n rounds imports it into a
scratch store on the same btrfs filesystem three ways:
- `export | tar`: `podman export` of a container piped into tar in an empty subvolume (how the store
  unpacked every image before it copied from the image's mount);
- alone: the store's import with no related image in the store (its files copied from `podman image
  mount` into an empty subvolume);
- on its base: the store's import with --image already in the store (a snapshot of the base, then only
  the files that differ).
Medians of the time, and the bytes each copy holds that no other subvolume shares (`btrfs filesystem du`).
Everything the run makes (its scratch stores, the task image) is removed at the end.
"""

import argparse
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.table import Table

from sprout.console import console
from sprout.sandbox import Store, btrfs
from sprout.sandbox.podman import command as podman_command
from sprout.sandbox.podman import ulimit_flags

IMAGE = "docker.io/library/python:3.11-slim"
DOCKERFILE = "FROM {image}\nRUN python3 -m venv /opt/venv && /opt/venv/bin/pip --version\nWORKDIR /app\n"


def podman(*args: str) -> str:
    proc = subprocess.run([*podman_command(), *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"podman {' '.join(args[:3])} ... failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout.strip()


def export_tar(image: str, dest: Path) -> None:
    container = f"sprout-bench-unpack-{secrets.token_hex(4)}"
    podman("create", "--name", container, image, "true")
    try:
        subprocess.run(["bash", "-o", "pipefail", "-c", f"{' '.join(podman_command())} export {container} | "
                        f"tar -x -f - -C '{dest}' --numeric-owner --xattrs --xattrs-include='*'"], check=True)
    finally:
        podman("rm", "-f", container)


def drop_store(store: Store) -> None:
    for image in store.images():
        btrfs.delete(image.path)
    for path in (store.root / "images").iterdir():
        btrfs.delete(path)
    store.meta.close()
    shutil.rmtree(store.root)


def round_of(main: Store, image: str, task: str) -> dict[str, tuple[float, float]]:
    """(seconds, exclusive MB) of each way of importing `task`, each in a scratch store of its own."""
    scratch = main.root / "test-stores"
    results: dict[str, tuple[float, float]] = {}

    def measure(way: str, prepare: Callable[[Store], None], run: Callable[[Store], Path]) -> None:
        store = Store(scratch / f"bench-import-{secrets.token_hex(4)}")
        try:
            prepare(store)
            btrfs.flush(store.root)
            started = time.perf_counter()
            path = run(store)
            btrfs.flush(store.root)
            results[way] = (time.perf_counter() - started, btrfs.disk_usage([path]) / 1e6)
        finally:
            drop_store(store)

    def tar_into(store: Store) -> Path:
        dest = store.root / "images" / "exported"
        btrfs.create(dest)
        export_tar(task, dest)
        return dest

    measure("export | tar", lambda store: None, tar_into)
    measure("alone", lambda store: None, lambda store: store.import_image(task).path)
    measure("on its base", lambda store: store.import_image(image),
            lambda store: store.import_image(task).path)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3, help="rounds of each (median)")
    parser.add_argument("--image", default=IMAGE, help="the base image (present in podman)")
    args = parser.parse_args()
    main_store = Store()
    task = f"localhost/sprout-test/bench-import:{secrets.token_hex(4)}"
    with tempfile.TemporaryDirectory(prefix="sprout-bench-import-") as context:
        (Path(context) / "Dockerfile").write_text(DOCKERFILE.format(image=args.image))
        podman("build", "--pull=never", *ulimit_flags(), "-t", task, context)
    try:
        image_mb = int(podman("image", "inspect", "--format", "{{.Size}}", task)) / 1e6
        rounds = [round_of(main_store, args.image, task) for _ in range(args.n)]
    finally:
        podman("rmi", task)
    table = Table("import", "median time", "exclusive MB", "rounds (s)",
                  title=f"Store import of a task image ({image_mb:.0f} MB) built on {args.image}")
    medians = {}
    for way in rounds[0]:
        times = [r[way][0] for r in rounds]
        medians[way] = (statistics.median(times), statistics.median(r[way][1] for r in rounds))
        table.add_row(way, f"{medians[way][0]:.2f} s", f"{medians[way][1]:.1f}",
                      " ".join(f"{t:.2f}" for t in times))
    alone, shared = medians["alone"], medians["on its base"]
    table.add_row("[bold]alone / on its base[/bold]", f"{alone[0] / shared[0]:.2f}x",
                  f"{alone[1] / max(shared[1], 0.01):.0f}x", "")
    console.print(table)


if __name__ == "__main__":
    main()
