"""Getting a benchmark as its users already do, `get_dataset(...)`, pinned by a version.

Registry datasets come through Harbor's own dataset client (the code path of `harbor download`): the
Harbor registry by default, or a legacy registry.json (`registry_url`, `registry_path`), whose entries
name each task's git repository, commit and path. SWE-bench Pro is a git checkout of its repository
at a tag (v2.0.0: its `v2/` directory), with every file that `v2/SHA256SUMS` lists checked and
`hard51_ids.txt` among them. Either way the tasks directory gets a `dataset.toml` naming the dataset (so
`prepare` records that name and Harbor's digest, not `local/...`) and `sprout-dataset.json`: the name,
the ref, where it came from (and the commit a tag resolved to) and the digest.
"""

import asyncio
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..errors import SproutError, UsageError
from .provenance import dataset_manifest

SWE_BENCH_PRO = "scaleapi/swe-bench-pro"
SWE_BENCH_PRO_GIT = "https://github.com/scaleapi/SWE-bench_Pro-os"
RECORD = "sprout-dataset.json"


class DatasetRecord(BaseModel):
    """What `get_dataset` fetched (sprout-dataset.json in the tasks directory)."""

    model_config = ConfigDict(extra="forbid")

    name: str  # org/name, as the tasks directory's dataset.toml now says
    ref: str  # the version or tag asked for
    source: str  # the registry, or the git repository
    revision: str | None = None  # the commit a git tag resolved to
    tasks_dir: str
    tasks: int
    digest: str  # Harbor's dataset digest of the tasks directory
    checked: list[str] = []  # files checked against the source's checksums (SWE-bench Pro's SHA256SUMS)

    def origin(self) -> str:
        return f"{self.source}@{self.revision}" if self.revision else self.source


def read_record(tasks_dir: Path) -> DatasetRecord | None:
    """The record `get_dataset` left in a tasks directory, if it did (one that does not parse is an error)."""
    path = Path(tasks_dir) / RECORD
    if not path.is_file():
        return None
    try:
        return DatasetRecord.model_validate_json(path.read_text())
    except ValueError as e:
        raise SproutError(f"{path} is not a record of sprout datasets get: {' '.join(str(e).split())[:200]}") from None


def get_dataset(spec: str, output: Path, *, registry_url: str | None = None, registry_path: Path | None = None,
                git_url: str | None = None, overwrite: bool = False) -> DatasetRecord:
    """Fetches `spec` (NAME@REF) into `output`; returns (and writes) its record."""
    name, _, ref = spec.partition("@")
    if not name or not ref:
        raise UsageError(f"name the dataset with its version, NAME@REF (got {spec!r}): an unpinned dataset moves")
    if output.exists() and any(output.iterdir()):
        if not overwrite:
            raise SproutError(f"{output} is not empty (--overwrite replaces what it holds)")
        shutil.rmtree(output)
    output.mkdir(parents=True, exist_ok=True)
    if name == SWE_BENCH_PRO:
        source = git_url or SWE_BENCH_PRO_GIT
        revision, checked = _swe_bench_pro(source, ref, output)
        tasks_dir = output / "tasks"
    else:
        source = _harbor(name, ref, output, registry_url, registry_path)
        revision, checked, tasks_dir = None, [], output
    manifest = dataset_manifest(tasks_dir, name)
    (tasks_dir / "dataset.toml").write_text(manifest.to_toml())
    record = DatasetRecord(name=name, ref=ref, source=source, revision=revision, tasks_dir=str(tasks_dir),
                           tasks=len(manifest.tasks), digest=f"sha256:{manifest.compute_content_hash()}",
                           checked=checked)
    (tasks_dir / RECORD).write_text(record.model_dump_json(indent=2) + "\n")
    return record


def _harbor(name: str, ref: str, output: Path, registry_url: str | None, registry_path: Path | None) -> str:
    """The dataset's tasks through Harbor's registry client, one directory each in `output`; the source."""
    from harbor.registry.client.base import EmptyDatasetError, UnavailableDatasetTasksError
    from harbor.registry.client.factory import RegistryClientFactory

    if registry_url and registry_path:
        raise UsageError("pass --registry-url or --registry-path, not both")
    try:
        client = RegistryClientFactory.create(registry_url=registry_url, registry_path=registry_path)
        items = asyncio.run(client.download_dataset(f"{name}@{ref}", overwrite=True, output_dir=output, export=True))
    except (EmptyDatasetError, UnavailableDatasetTasksError, KeyError, ValueError, OSError) as e:
        raise SproutError(f"dataset {name}@{ref}: {' '.join(str(e).split()) or type(e).__name__}") from None
    except subprocess.CalledProcessError as e:  # Harbor's client runs git for each task's repository
        raise SproutError(f"dataset {name}@{ref}: {_failed_git(e)}") from None
    if not items:
        raise SproutError(f"dataset {name}@{ref} has no tasks")
    return str(registry_path or registry_url or "the Harbor registry")


def _failed_git(error: subprocess.CalledProcessError) -> str:
    """One line for a git command Harbor's client ran that failed: what it ran on and git's last words."""
    args = [str(a) for a in error.cmd] if isinstance(error.cmd, list) else [str(error.cmd)]
    target = next((a for a in args if "://" in a or a.startswith("git@")), "a task's repository")
    stderr = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else str(error.stderr or "")
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith(("fatal:", "error:"))),
                lines[-1] if lines else f"exit status {error.returncode}")
    return f"git {args[1] if len(args) > 1 else ''} of {target} failed: {said}"


def _swe_bench_pro(git_url: str, tag: str, output: Path) -> tuple[str, list[str]]:
    """`v2/` of the repository at `tag` into `output`, every file SHA256SUMS lists checked; (commit, checked)."""
    with tempfile.TemporaryDirectory(prefix="sprout-dataset-") as tmp:
        clone = Path(tmp) / "repo"
        _git("clone", "--quiet", "--depth", "1", "--branch", tag, "--", git_url, str(clone))
        commit = _git("-C", str(clone), "rev-parse", "HEAD").strip()
        v2 = clone / "v2"
        if not (v2 / "SHA256SUMS").is_file() or not (v2 / "tasks").is_dir():
            raise SproutError(f"{git_url} at {tag} has no v2/SHA256SUMS and v2/tasks/: not SWE-bench Pro v2")
        checked = _check_sums(v2)
        if "hard51_ids.txt" not in checked:
            raise SproutError(f"{git_url} at {tag}: v2/SHA256SUMS does not list hard51_ids.txt")
        shutil.copytree(v2, output, symlinks=True, dirs_exist_ok=True)
    return commit, checked


def _check_sums(root: Path) -> list[str]:
    """Every file `root/SHA256SUMS` lists, checked; the checked paths (a mismatch or a missing file stops)."""
    checked = []
    for line in (root / "SHA256SUMS").read_text().splitlines():
        if not line.strip():
            continue
        digest, _, rel = line.strip().partition("  ")
        rel = rel.removeprefix("*").removeprefix("./")
        path = root / rel
        if not path.is_file():
            raise SproutError(f"SHA256SUMS lists {rel}, which the checkout lacks")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest.lower():
            raise SproutError(f"{rel} does not match its SHA256SUMS line: the checkout is not the published one")
        checked.append(rel)
    return checked


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=3600)
    if proc.returncode != 0:
        raise SproutError(f"git {args[0]} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return proc.stdout
