"""The driver's configuration: where tasks are, who may call it, where groups are kept, where samples run.

A JSON file (`serve --config FILE`, written by `sprout services setup`) with the keys of the
contract's driver config that apply to Harbor tasks; command-line flags override it:

    {"driver_token_env": "SPROUT_RL_DRIVER_TOKEN", "ledger": "/srv/rl/driver.sqlite3",
     "data_dir": "/srv/rl", "tasks_dir": "/srv/tasks", "local_slots": 4,
     "miles": {"api_key_env": "SPROUT_MODEL_API_KEY",
               "tasks": {"task-1": {"task_dir": "/srv/other/task-1", "grade": {"profile": "harbor"}}}}}

Every task in `tasks_dir` (its directory name is the task_id) is graded by its own Harbor verifier; a
`miles.tasks` entry names a task elsewhere and must say how it is graded.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..agent import defaults
from ..errors import SproutError
from ..method.review import ReviewerConfig
from ..sandbox import backends
from ..sandbox.backends import BackendName
from ..settings import settings
from ..tasks.dataset import task_dirs
from ..tasks.pull import PullPolicy
from ..tasks.swe_rebench import SweRebenchRef

DEFAULT_PORT = 11001
DEFAULT_DATA_DIR = Path("~/.local/share/sprout/rl-driver")


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GradeConfig(_Config):
    """harbor: the task's own Harbor verifier, live in the sample's sandbox; grade: the `spec`'s."""

    profile: Literal["harbor", "grade"] = "harbor"
    spec: SweRebenchRef | None = None  # a SWE-rebench V2 instance, graded as the official harness

    @model_validator(mode="after")
    def _spec_with_grade(self) -> "GradeConfig":
        if (self.profile == "grade") != (self.spec is not None):
            raise ValueError('profile "grade" takes a spec (a SWE-rebench V2 instance), "harbor" none')
        return self


class TaskEntry(_Config):
    task_dir: Path | None = None  # a Harbor task (profile harbor)
    grade: GradeConfig | None = None  # required to serve the task: how its samples are rewarded

    @model_validator(mode="after")
    def _harbor_has_a_dir(self) -> "TaskEntry":
        if self.grade is not None and self.grade.profile == "harbor" and self.task_dir is None:
            raise ValueError("a Harbor task (grade profile harbor) needs task_dir")
        return self


DEFAULT_CONTINUATION = ("You are continuing this task from a saved point of an earlier attempt: the sandbox is as it "
                        "was then. Keep working on the task, then submit.")


class ReviewConfig(ReviewerConfig):
    """The reviewer of search groups, a model the operator configures (a request never names one): the one
    reviewer config (sprout.method.review.ReviewerConfig: model, temperature, max_output_tokens,
    prompt_chars, reasoning_effort, max_concurrent_requests, ...) and where it is served."""

    profile: Literal["review"] = "review"
    endpoint: str = Field(description="a Chat Completions base URL (…/v1)")
    api_key_env: str | None = Field(None, description="the variable holding its key (default: miles.api_key_env)")
    continuation_prompt: str = Field(DEFAULT_CONTINUATION, description=(
        "sent as a user message before a branch continues, wrapped in <sprout_training_hint> and stripped at "
        'export; "" sends none'))


class MilesSection(_Config):
    api_key_env: str | None = None  # the variable whose value is sent as the policy's key (never echoed)
    grade_wall_seconds: float = Field(600.0, ge=240)  # a SWE-rebench grade's test commands, at most
    review: ReviewConfig | None = None  # required to serve search groups
    tasks: dict[str, TaskEntry] = {}


class DriverConfig(_Config):
    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_PORT, ge=1, le=65535)
    driver_token_env: str | None = "SPROUT_RL_DRIVER_TOKEN"  # set and non-empty: callers need this bearer token
    ledger: str | None = None  # a SQLite file, or a SQLAlchemy URL (the Run Store's PostgreSQL); default in data_dir
    data_dir: Path = DEFAULT_DATA_DIR  # journals and verifier files of every sample
    tasks_dir: Path | None = None
    local_slots: int = Field(4, ge=1)  # samples run at once in this process (without a Run Store)
    runstore_url: str | None = None  # default $SPROUT_RUNSTORE_URL; with a token, samples run as Run Store jobs
    runstore_token_env: str = "SPROUT_RUNSTORE_TOKEN"
    poll_interval_s: float = Field(1.0, gt=0)  # the longest wait for a Run Store job's events (a stop acts then)
    runtime_bin: Path | None = None  # the confined runtime's binary (default $SPROUT_RUNTIME_BIN)
    backend: BackendName = backends.DEFAULT  # of the samples' sandboxes
    pull: PullPolicy | None = None
    command_timeout_s: int = Field(defaults.COMMAND_TIMEOUT_S, ge=1)
    token_limit: int = Field(defaults.TOKEN_LIMIT, ge=1)  # tokens per sample, all calls together
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    abandon_after_s: float | None = Field(120.0, gt=0)  # a running group no client polled this long is cancelled
    prepare_hosts: bool = True  # over a Run Store: import the served tasks' images on every live host at start
    branch_affinity_s: float = Field(60.0, ge=0)  # over a Run Store: a branch waits this long for its checkpoint's host
    keep_checkpoints: bool = False  # keep a DELETEd group's checkpoints (default: released, as evaluation does)
    miles: MilesSection = MilesSection()

    @property
    def ledger_url(self) -> str:
        ledger = self.ledger or str(self.data_path / "driver.sqlite3")
        return ledger if "://" in ledger else f"sqlite:///{Path(ledger).expanduser().resolve()}"

    @property
    def data_path(self) -> Path:
        return self.data_dir.expanduser().resolve()

    def driver_token(self) -> str:
        return os.environ.get(self.driver_token_env, "") if self.driver_token_env else ""

    def runstore(self) -> tuple[str, str] | None:
        """The Run Store's URL and token when both are configured, else None (samples run here)."""
        url = self.runstore_url or settings().runstore_url
        token = os.environ.get(self.runstore_token_env, "")
        return (url, token) if url and token else None


def load_config(path: Path | None) -> DriverConfig:
    if path is None:
        return DriverConfig()
    try:
        return DriverConfig.model_validate_json(path.read_bytes())
    except OSError as e:
        raise SproutError(f"cannot read the driver config {path}: {e.strerror}") from None
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        raise SproutError(f"invalid driver config {path}: {problems}") from None


class TaskNotServed(SproutError):
    """A request names a task this driver does not know or cannot grade (answered 400)."""


@dataclass
class ServedTask:
    """A task the driver serves: a Harbor task directory, or a SWE-rebench V2 instance."""

    task_dir: Path | None = None
    swe: SweRebenchRef | None = None


def served_task_dirs(config: DriverConfig) -> list[Path]:
    """The Harbor task directories this driver serves (their images go to every host ahead of time)."""
    listed = [e.task_dir.expanduser().resolve() for e in config.miles.tasks.values() if e.task_dir is not None]
    found = task_dirs(config.tasks_dir.expanduser().resolve()) if config.tasks_dir is not None else []
    return sorted(set(listed) | {d.resolve() for d in found})


def served_task(config: DriverConfig, task_id: str) -> ServedTask:
    """What `task_id` names: a configured task, else the Harbor task `tasks_dir/<task_id>`."""
    entry = config.miles.tasks.get(task_id)
    if entry is not None:
        if entry.grade is None:
            raise TaskNotServed(f"Configure Sprout tasks[{task_id!r}].grade for message rollout rewards")
        if entry.grade.spec is not None:
            return ServedTask(swe=entry.grade.spec)
        assert entry.task_dir is not None
        return ServedTask(task_dir=entry.task_dir.expanduser().resolve())
    if config.tasks_dir is not None and task_id not in (".", "..") and "/" not in task_id:
        candidate = config.tasks_dir.expanduser().resolve() / task_id
        if (candidate / "task.toml").is_file():
            return ServedTask(task_dir=candidate)
    where = f"a directory of {config.tasks_dir}" if config.tasks_dir else "a --tasks-dir directory"
    raise TaskNotServed(f"unknown task_id {task_id!r}: it is neither {where} nor a configured task")
