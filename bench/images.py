"""Image benchmark: pulling a task image from a registry against building it, measured in one run.

    .venv/bin/python bench/images.py [--n 3] [--image docker.io/library/python:3.11-slim]

The registry is a real one on 127.0.0.1 (Debian's docker-registry, tests/registry.py; install it with
ops/setup_podman.sh). Pull: a copy of --image whose layer is made unique (a nonce file added to its
exported rootfs, so that no layer of it is already in podman's store) is pushed there and removed
locally; each of --n rounds times a full `podman pull` of it (download, gunzip, layer write) and removes
it again. Build: `podman build --pull=never --no-cache` of `FROM --image` + `RUN pip --version` +
`WORKDIR /app`, --n times (Sprout's own build flags, minus the host-CA mount). Medians, and their ratio.
Everything the run makes (names under localhost/sprout-test/ and the registry's) is removed at the end.
"""

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rich.table import Table

from sprout.console import console
from sprout.sandbox.podman import command as podman_command
from sprout.sandbox.podman import ulimit_flags

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.registry import LocalRegistry  # noqa: E402 - the repository's tests package, importable from REPO

IMAGE = "docker.io/library/python:3.11-slim"
DOCKERFILE = "FROM {image}\nRUN pip --version\nWORKDIR /app\n"


def podman(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*podman_command(), *args], capture_output=True, text=True, check=False,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise SystemExit(f"podman {' '.join(args[:3])} ... failed: {proc.stderr.strip()[-500:]}")
    return proc


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def exists(ref: str) -> bool:
    return podman("image", "exists", ref, check=False).returncode == 0


def unique_copy(image: str, ref: str, workdir: Path) -> None:
    """`image`'s rootfs plus a nonce file, imported as `ref` (one layer no other image shares), with
    its Env, Cmd and WorkingDir."""
    config = json.loads(podman("image", "inspect", image).stdout)[0]["Config"]
    container = f"sprout-test-bench-{secrets.token_hex(4)}"
    podman("create", "--name", container, image, "true")
    try:
        rootfs = workdir / "rootfs.tar"
        podman("export", "-o", str(rootfs), container)
    finally:
        podman("rm", "-f", container, check=False)
    nonce = workdir / "nonce" / "etc"
    nonce.mkdir(parents=True)
    (nonce / "sprout-bench-nonce").write_text(secrets.token_hex(16) + "\n")
    subprocess.run(["tar", "-rf", str(rootfs), "-C", str(nonce.parent), "etc/sprout-bench-nonce"], check=True)
    changes = [f"ENV={e}" for e in config.get("Env") or []]
    if config.get("Cmd"):
        changes.append(f"CMD {json.dumps(config['Cmd'])}")
    if config.get("WorkingDir"):
        changes.append(f"WORKDIR {config['WorkingDir']}")
    podman("import", *[a for c in changes for a in ("--change", c)], str(rootfs), ref)
    rootfs.unlink()


def registry_bytes(registry: LocalRegistry, name: str) -> int:
    """Bytes a pull of `name` downloads: its manifest's layers and config, as stored (compressed)."""
    repository, tag = name.rsplit(":", 1)
    accept = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"
    request = urllib.request.Request(f"{registry.url}/v2/{repository}/manifests/{tag}", headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=10) as answer:
        manifest = json.load(answer)
    return sum(layer["size"] for layer in manifest["layers"]) + manifest["config"]["size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3, help="rounds of each (median)")
    parser.add_argument("--image", default=IMAGE, help="the base image (present in podman)")
    args = parser.parse_args()
    if not exists(args.image):
        raise SystemExit(f"podman has no {args.image} (ops/setup_podman.sh bootstraps it)")
    tag = secrets.token_hex(4)
    source = f"localhost/sprout-test/bench-pull:{tag}"
    name = f"sprout-test/bench-python:{tag}"
    built = [f"localhost/sprout-test/bench-build:{tag}-{i}" for i in range(args.n)]
    pulls: list[float] = []
    builds: list[float] = []
    with tempfile.TemporaryDirectory(prefix="sprout-bench-images-") as tmp, LocalRegistry() as registry:
        ref = registry.ref(name)
        try:
            copy_s = timed(lambda: unique_copy(args.image, source, Path(tmp)))
            size = int(podman("image", "inspect", "--format", "{{.Size}}", source).stdout)
            push_s = timed(lambda: registry.push(source, name))
            wire = registry_bytes(registry, name)
            registry.remove_local(ref)
            registry.remove_local(source)  # its only other name: the image and its layer are gone now
            assert not exists(ref) and not exists(source)
            for _ in range(args.n):
                pulls.append(timed(lambda: podman("pull", "--quiet", ref, env=registry.env)))
                assert exists(ref)
                registry.remove_local(ref)

            context = Path(tmp) / "context"
            context.mkdir()
            (context / "Dockerfile").write_text(DOCKERFILE.format(image=args.image))
            flags = ["--pull=never", "--no-cache", *ulimit_flags(), "-f", str(context / "Dockerfile")]
            for out in built:
                builds.append(timed(lambda out=out: podman("build", *flags, "-t", out, str(context))))
                podman("rmi", out)  # and its intermediate images (untagged parents)
        finally:
            for leftover in [ref, source, *built]:
                if exists(leftover):
                    registry.remove_local(leftover)
        startup_ms = registry.startup_s * 1000

    pull, build = statistics.median(pulls), statistics.median(builds)
    table = Table("", "median", "rounds", "notes",
                  title=f"Task image: pull from a local registry vs build (base {args.image})")
    table.add_row("registry start (docker-registry serve to GET /v2/ 200)", f"{startup_ms:.0f} ms", "1", "")
    table.add_row("unique copy of the base (export + nonce + import)", f"{copy_s:.1f} s", "1", "set-up, not timed below")
    table.add_row("podman push to the registry", f"{push_s:.1f} s", "1",
                  f"{size / 1e6:.0f} MB image, {wire / 1e6:.0f} MB compressed in the registry")
    table.add_row("[bold]podman pull[/bold] (no layer present locally)", f"{pull:.2f} s", str(len(pulls)),
                  " ".join(f"{t:.2f}" for t in pulls) + f"  ({wire / 1e6 / pull:.0f} MB/s compressed)")
    table.add_row("[bold]podman build --pull=never --no-cache[/bold]", f"{build:.2f} s", str(len(builds)),
                  " ".join(f"{t:.2f}" for t in builds) + "  (FROM base, RUN pip --version, WORKDIR /app)")
    table.add_row("[bold]ratio pull / build[/bold]", f"{pull / build:.2f}x", "",
                  "pull is faster" if pull < build else "build is faster")
    console.print(table)


if __name__ == "__main__":
    main()
