"""SWE-rebench V2 instances: rows of the dataset's JSONL (or parquet) file, pinned by the file's sha256.

A row carries what grading needs: `instance_id`, `repo`, `base_commit`, `test_patch`, `FAIL_TO_PASS`,
`PASS_TO_PASS` (lists; some dumps store them as JSON strings of lists, accepted too), `image_name`,
`install_config` (`test_cmd`: a list, a single string becomes one; `log_parser`: the parser's name; the
rest kept) and `problem_statement`. Other fields (`language`, `meta`, ...) are ignored. A bad row is
reported with its line and id and does not stop the others.
"""

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import TaskLoadError

CHUNK = 1 << 20


class SweRebenchError(TaskLoadError):
    """A dataset file that cannot be used as a whole (missing, wrong sha256, unreadable format)."""


class InstallConfig(BaseModel):
    """`install_config` of a row; only `test_cmd` and `log_parser` are used (never `install`)."""

    model_config = ConfigDict(extra="allow")

    test_cmd: list[str]
    log_parser: str
    install: list[str] = Field(default_factory=list)

    @field_validator("test_cmd", "install", mode="before")
    @classmethod
    def _commands(cls, value: Any) -> Any:
        """A single string is one command; blank entries are dropped (as the official harness does)."""
        if isinstance(value, str):
            value = [value]
        if value is None:
            return []
        if isinstance(value, list):
            return [item for item in value if isinstance(item, str) and item.strip()]
        return value

    @field_validator("test_cmd")
    @classmethod
    def _some_test_cmd(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("install_config.test_cmd has no command")
        return value

    @field_validator("log_parser")
    @classmethod
    def _some_parser(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("install_config.log_parser is empty")
        return value


class Instance(BaseModel):
    """One SWE-rebench V2 task, as grading needs it. `patch` (the reference fix) is kept when present."""

    model_config = ConfigDict(extra="ignore")

    instance_id: str = Field(min_length=1)
    repo: str
    base_commit: str = Field(min_length=1)
    test_patch: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    image_name: str = Field(min_length=1)
    install_config: InstallConfig
    problem_statement: str = ""
    patch: str = ""

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _test_list(cls, value: Any) -> Any:
        """A list, or a JSON string of a list (as some dumps store it); None is an empty list."""
        if value is None:
            return []
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError("is a string that is not a JSON list of test names") from None
        return value

    @field_validator("install_config", mode="before")
    @classmethod
    def _config(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                raise ValueError("is a string that is not a JSON object") from None
        return value

    @field_validator("repo")
    @classmethod
    def _repo(cls, value: str) -> str:
        if "/" not in value or not value.strip("/"):
            raise ValueError(f"{value!r} is not owner/name")
        return value


class RowProblem(BaseModel):
    """A row that could not be loaded: `row` is the 1-based line (JSONL) or 0-based row (parquet/JSON)."""

    row: int
    instance_id: str | None
    problem: str


class InstanceSet(BaseModel):
    path: str
    sha256: str  # of the file, hex
    instances: list[Instance]
    problems: list[RowProblem]

    def by_id(self) -> dict[str, Instance]:
        return {instance.instance_id: instance for instance in self.instances}

    def get(self, instance_id: str) -> Instance:
        for instance in self.instances:
            if instance.instance_id == instance_id:
                return instance
        bad = next((p for p in self.problems if p.instance_id == instance_id), None)
        why = f": its row was rejected ({bad.problem})" if bad else ""
        raise SweRebenchError(f"no instance {instance_id!r} in {self.path}{why}")


def read_patches(path: Path) -> dict[str, str]:
    """{instance_id: patch} from a patches file in the official format (scripts/eval.py's --patches: a JSON
    list of {"instance_id": ..., "patch": ...}). An entry without a patch is an error naming its instance
    (the official harness grades the reference patch there instead, silently)."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SweRebenchError(f"patches file {path}: {e}") from None
    if not isinstance(entries, list):
        raise SweRebenchError(f"patches file {path}: the official format is a JSON list of "
                              '{"instance_id": ..., "patch": ...}')
    patches: dict[str, str] = {}
    for number, entry in enumerate(entries, 1):
        instance_id = entry.get("instance_id") if isinstance(entry, dict) else None
        if not isinstance(instance_id, str) or not instance_id:
            raise SweRebenchError(f"patches file {path}: entry {number} has no instance_id")
        if not isinstance(entry.get("patch"), str):
            raise SweRebenchError(f"patches file {path}: {instance_id} has no patch (a string; \"\" for an empty one)")
        if instance_id in patches:
            raise SweRebenchError(f"patches file {path}: {instance_id} has two patches")
        patches[instance_id] = entry["patch"]
    return patches


def repo_dir(instance: Instance) -> str:
    """The repository's directory in the instance image: `/<repo name>` (`owner/name` -> `/name`)."""
    return "/" + PurePosixPath(instance.repo.strip("/")).name


class SweRebenchRef(BaseModel):
    """One instance of a pinned dataset file with the parsers file that grades it: the grade spec the
    Miles example writes for a SWE-rebench V2 task."""

    model_config = ConfigDict(extra="forbid")

    benchmark: Literal["swe-rebench-v2"] = "swe-rebench-v2"
    instance_id: str = Field(min_length=1)
    dataset_path: Path
    dataset_sha256: str | None = None  # the dataset file's, checked when given
    parser_path: Path  # the official log_parsers.py
    grader_revision: str | None = None  # "sha256:<hex>" of the parsers file, checked when given
    verifier_network: Literal["allow", "deny"] = "allow"  # the official harness grades with the network
    image: str | None = None  # a stand-in for the instance's image_name (e.g. a local build, offline)

    def instance(self, instances: InstanceSet) -> Instance:
        """The instance this names in `instances`, its image the stand-in when one is named."""
        found = instances.get(self.instance_id)
        return found.model_copy(update={"image_name": self.image}) if self.image else found


def task_prompt(instance: Instance) -> str:
    """The agent's task, as the Miles example words it."""
    return f"Work in {repo_dir(instance)} and fix this issue:\n\n{instance.problem_statement}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str | None, what: str) -> str:
    """The file's sha256 (hex); raises SweRebenchError when `expected` (hex or `sha256:hex`) differs."""
    actual = file_sha256(path)
    if expected is not None and expected.lower().removeprefix("sha256:") != actual:
        raise SweRebenchError(f"{what} {path} has sha256 {actual}, not the pinned {expected}")
    return actual


def load_instances(path: Path | str, sha256: str | None = None) -> InstanceSet:
    """The instances of a dataset file (.jsonl, .json list, or .parquet with pyarrow), its sha256 checked
    when given; bad rows (unparsable, missing fields, duplicate ids) are listed in `problems`."""
    path = Path(path)
    if not path.is_file():
        raise SweRebenchError(f"no SWE-rebench dataset file at {path}")
    digest = check_sha256(path, sha256, "the dataset file")
    instances: list[Instance] = []
    problems: list[RowProblem] = []
    seen: set[str] = set()
    for row, record, error in _rows(path):
        instance_id = record.get("instance_id") if isinstance(record, dict) else None
        instance_id = instance_id if isinstance(instance_id, str) and instance_id else None
        if error is None:
            try:
                instance = Instance.model_validate(record)
            except ValidationError as e:
                error = _describe(e)
            else:
                if instance.instance_id in seen:
                    error = "a duplicate instance_id (an earlier row has it)"
                else:
                    seen.add(instance.instance_id)
                    instances.append(instance)
        if error is not None:
            problems.append(RowProblem(row=row, instance_id=instance_id, problem=error))
    return InstanceSet(path=str(path), sha256=digest, instances=instances, problems=problems)


def _rows(path: Path) -> list[tuple[int, Any, str | None]]:
    """(row number, record, problem reading it) for every row of the file."""
    if path.suffix == ".parquet":
        return [(i, record, None) for i, record in enumerate(_parquet_rows(path))]
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SweRebenchError(f"{path} is not a JSON file: {e}") from None
        if not isinstance(data, list):
            raise SweRebenchError(f"{path}: a .json dataset must be a list of rows")
        return [(i, record, None if isinstance(record, dict) else "not a JSON object") for i, record in
                enumerate(data)]
    rows: list[tuple[int, Any, str | None]] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                rows.append((number, None, f"not JSON: {e}"))
                continue
            rows.append((number, record, None if isinstance(record, dict) else "not a JSON object"))
    return rows


def _parquet_rows(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SweRebenchError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), "
                              "or convert the file to JSONL") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds; all mean an unreadable file
        raise SweRebenchError(f"{path} is not a readable parquet file: {e}") from None


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "row"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)
