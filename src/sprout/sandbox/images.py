"""Base images built offline with mmdebstrap, imported into podman under the names Dockerfiles use.

No container registry is reachable from these hosts; Debian's package mirror is. Each recipe is
bootstrapped once into a tarball cached in the store, imported with `podman import`, and tagged.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from . import shell
from .podman import command as podman_command

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RECIPE_LABEL = "sprout.recipe"
# Debian marks its Python "externally managed"; images like python:3.11-slim let `pip install` work.
ALLOW_PIP = 'rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED'


@dataclass(frozen=True)
class Recipe:
    name: str
    packages: tuple[str, ...]
    tags: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = (("PATH", PATH), ("LANG", "C.UTF-8"))
    cmd: tuple[str, ...] = ("bash",)
    hooks: tuple[str, ...] = field(default=())
    suite: str = "bookworm"

    @property
    def digest(self) -> str:
        text = json.dumps([self.suite, self.packages, self.env, self.cmd, self.hooks])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


RECIPES = (
    Recipe(
        name="sprout/bookworm-python",
        packages=("bash", "ca-certificates", "python3", "python3-pip", "python3-venv", "python-is-python3",
                  "python3-pytest", "git", "procps", "patch", "less"),
        tags=("docker.io/library/python:3.11-slim", "docker.io/library/python:3.11",
              "docker.io/library/python:3.12-slim", "docker.io/library/python:3.12",
              "docker.io/library/python:3-slim", "docker.io/library/python:latest"),
        cmd=("python3",),
        hooks=(ALLOW_PIP,),
    ),
    Recipe(
        name="sprout/bookworm",
        packages=("bash", "ca-certificates", "procps", "less"),
        tags=("docker.io/library/debian:bookworm", "docker.io/library/debian:bookworm-slim",
              "docker.io/library/debian:12", "docker.io/library/debian:12-slim",
              "docker.io/library/debian:latest", "docker.io/library/ubuntu:22.04",
              "docker.io/library/ubuntu:24.04", "docker.io/library/ubuntu:latest"),
    ),
)


def image_ids_by_name() -> dict[str, str]:
    """Every name podman knows (registry/repo:tag) -> image id, in one podman call."""
    out = shell.output([*podman_command(), "images", "--noheading", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}"])
    return dict(line.split() for line in out.splitlines() if line.strip() and "<none>" not in line)


def bootstrap(recipe: Recipe, cache_dir: Path, log=print) -> str:
    """Makes sure podman has the recipe's image under all its tags; returns the image's reference."""
    reference = f"localhost/{recipe.name}:{recipe.digest}"
    names = image_ids_by_name()
    if reference not in names:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tarball = cache_dir / f"{recipe.name.replace('/', '_')}-{recipe.digest}.tar"
        if not tarball.exists():
            log(f"  bootstrapping {recipe.name} ({recipe.suite}) with mmdebstrap, about 30 s ...")
            partial = tarball.with_suffix(".partial.tar")
            hooks = [f"--customize-hook={hook}" for hook in recipe.hooks]
            shell.run(["mmdebstrap", "--variant=minbase", "--quiet", f"--include={','.join(recipe.packages)}",
                       *hooks, recipe.suite, str(partial)], what=f"mmdebstrap {recipe.name}", timeout=1800)
            partial.rename(tarball)
        changes = [f"ENV={k}={v}" for k, v in recipe.env] + [f"CMD={json.dumps(list(recipe.cmd))}",
                                                            f"LABEL={RECIPE_LABEL}={recipe.digest}"]
        args = [arg for change in changes for arg in ("--change", change)]
        shell.run([*podman_command(), "import", *args, str(tarball), reference], what=f"podman import {recipe.name}")
        names = image_ids_by_name()
    for tag in (f"localhost/{recipe.name}:latest", *recipe.tags):
        if names.get(tag) != names[reference]:
            shell.run([*podman_command(), "tag", reference, tag], what="podman tag")
    return reference
