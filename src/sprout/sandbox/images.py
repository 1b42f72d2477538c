"""The base images Dockerfiles name (python:3.11-slim, debian:bookworm, ...): pulled from a registry
where one has them, else stand-ins built offline with mmdebstrap.

A host that reaches no container registry still reaches Debian's package mirror. For each official name
a recipe lists, `bootstrap` first pulls it; only a name that cannot be pulled (and that podman does not
already hold as a real image) gets the recipe's stand-in: Debian bootstrapped once into a tarball cached
in the store, imported with `podman import` and labelled `sprout.recipe`, a label images built on it
inherit, so a task image that stands on one is known (`stand_in`). A later successful pull (the set-up
run again, or `--pull always`) replaces a stand-in by the real image.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from . import podman, shell
from .errors import CommandError
from .podman import command as podman_command
from .podman import image_info

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


def stand_in(reference: str) -> bool:
    """Whether podman's image of that name is a stand-in, or built on one (it carries RECIPE_LABEL)."""
    info = image_info(reference)
    return bool(info and ((info.get("Config") or {}).get("Labels") or {}).get(RECIPE_LABEL))


def stand_ins_in_podman(tries: int = 3) -> list[str]:
    """The official names podman holds as stand-ins. The label filter reads every image podman lists, so an
    image another process removes meanwhile fails the listing ("image not known"): it is listed again."""
    command = [*podman_command(), "images", "--noheading", "--filter", f"label={RECIPE_LABEL}", "--format",
               "{{.Repository}}:{{.Tag}}"]
    for attempt in range(1, tries + 1):
        try:
            out = shell.output(command)
            break
        except CommandError as e:
            if "image not known" not in str(e) or attempt == tries:
                raise
    official = {tag for recipe in RECIPES for tag in recipe.tags}
    return sorted(name for name in out.split() if name in official)


@dataclass
class Bootstrapped:
    pulled: list[str] = field(default_factory=list)  # names a registry had (a stand-in there was replaced)
    kept: list[str] = field(default_factory=list)  # real images podman holds, which could not be pulled now
    stand_ins: dict[str, str] = field(default_factory=dict)  # name -> why its pull failed


def bootstrap(recipe: Recipe, cache_dir: Path, log=print, *, pull=podman.pull) -> Bootstrapped:
    """Makes podman hold every name of the recipe: the registry's image where `pull` gets it, else the real
    image podman already holds, else the recipe's stand-in (built once)."""
    done = Bootstrapped()
    names = image_ids_by_name()
    for tag in recipe.tags:
        answer = pull(tag)
        if answer is None:
            done.pulled.append(tag)
        elif tag in names and not stand_in(tag):
            done.kept.append(tag)
        else:
            done.stand_ins[tag] = answer
    if done.stand_ins:
        reference = _stand_in_image(recipe, cache_dir, log)
        names = image_ids_by_name()
        for tag in (f"localhost/{recipe.name}:latest", *done.stand_ins):
            if names.get(tag) != names[reference]:
                shell.run([*podman_command(), "tag", reference, tag], what="podman tag")
    for tag in done.pulled:
        log(f"  pulled    {tag}")
    for tag in done.kept:
        log(f"  kept      {tag} (podman's own; the pull failed)")
    for tag, answer in done.stand_ins.items():
        log(f"  stand-in  {tag} (Debian {recipe.suite}; the pull failed: {answer.rsplit(': ', 1)[-1]})")
    return done


def _stand_in_image(recipe: Recipe, cache_dir: Path, log) -> str:
    """The recipe's stand-in in podman (bootstrapped and imported once); its reference."""
    reference = f"localhost/{recipe.name}:{recipe.digest}"
    if reference in image_ids_by_name():
        return reference
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
    return reference
