"""The benchmark-like fixtures (tests/fixtures/bench-like) made runnable: their prebuilt images pushed to
a local registry and absent from podman, and their placeholders filled in (@REGISTRY@, @PIP_INDEX@).
Used by tests/tasks/test_benchmark_like.py and bench/gate.py."""

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sprout.sandbox.podman import command as podman_command
from tests.conftest import PYTHON_IMAGE, REPO
from tests.registry import LocalRegistry
from tests.tls_index import TlsIndex

FIXTURES = REPO / "tests" / "fixtures" / "bench-like"
PUSHED = {"tb2-like": "sprout-test/tb2-like:1", "deepswe-like": "sprout-test/deepswe-like:1"}


@contextmanager
def bench_like_dataset(registry: LocalRegistry, root: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """(tasks dir, the environment Sprout's processes need: the index's CA bundle and the registry's
    registries.conf). The images pulled meanwhile are removed from podman afterwards."""
    index = TlsIndex(root / "index")
    pushed = []
    try:
        for task, name in PUSHED.items():
            built = f"localhost/sprout-test/{task}-build:1"
            subprocess.run([*podman_command(), "build", "--pull=never", "-q", "-t", built, str(FIXTURES / task / "environment")],
                           check=True, capture_output=True)
            pushed.append(registry.push(built, name))
            registry.remove_local(built)
        pushed.append(registry.push(PYTHON_IMAGE, "sprout-test/pro-base:1"))
        for ref in pushed:
            registry.remove_local(ref)
        tasks = root / "tasks"
        shutil.copytree(FIXTURES, tasks)
        for path in tasks.rglob("*"):
            if path.is_file() and path.name in ("task.toml", "Dockerfile"):
                path.write_text(path.read_text().replace("@REGISTRY@", registry.host).replace("@PIP_INDEX@", index.url))
        yield tasks, {"SPROUT_HOST_CA_BUNDLE": str(index.ca_bundle), **registry.env}
    finally:
        index.close()
        for ref in pushed:
            subprocess.run([*podman_command(), "rmi", ref], capture_output=True)
