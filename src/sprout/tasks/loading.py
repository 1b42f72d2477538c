"""Reading Harbor task directories with Harbor's own models, one clear line per broken task."""

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from harbor.constants import MAIN_SERVICE_NAME
from harbor.environments.definition import COMPOSE_FILE_NAME, has_agent_environment_definition
from harbor.models.task.config import TaskConfig, TaskOS
from harbor.models.task.paths import TaskPaths
from harbor.models.task.task import Task
from harbor.models.task.verifier_mode import VerifierEnvironmentMode, resolve_task_verifier_mode
from pydantic import ValidationError

from .dataset import task_dirs
from .errors import TaskError, TaskLoadError, UnsupportedTaskError


@dataclass(frozen=True)
class TaskProblem:
    """A task directory that cannot run, and why (one line)."""

    name: str
    path: Path
    problem: str


@dataclass
class TaskSet:
    tasks: list[Task] = field(default_factory=list)
    problems: list[TaskProblem] = field(default_factory=list)


def task_name(task: Task) -> str:
    """The name Sprout shows and filters by: the task's directory name."""
    return task.task_dir.name


def load_task(task_dir: Path) -> Task:
    """The task at `task_dir`, read by harbor's Task; raises TaskLoadError or UnsupportedTaskError."""
    task_dir = Path(task_dir).resolve()
    name = task_dir.name
    paths = TaskPaths(task_dir)
    if not paths.config_path.is_file():
        raise TaskLoadError(f"task {name}: no task.toml")
    try:
        config = TaskConfig.model_validate_toml(paths.config_path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskLoadError(f"task {name}: task.toml is not valid TOML ({e})") from None
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise TaskLoadError(f"task {name}: task.toml does not fit Harbor's schema: {where}: "
                            f"{first['msg']}{more}") from None
    if not config.steps:
        if not paths.instruction_path.is_file():
            raise TaskLoadError(f"task {name}: missing instruction.md")
        shared = resolve_task_verifier_mode(config) is VerifierEnvironmentMode.SHARED
        if shared and paths.discovered_test_path_for(config.environment.os) is None:
            expected = paths.test_path_for(config.environment.os).relative_to(task_dir).as_posix()
            raise TaskLoadError(f"task {name}: missing {expected} (the verifier's entry point)")
        verifier_env = config.verifier.environment
        if not shared and not (paths.tests_dir / "Dockerfile").is_file() and not (verifier_env and verifier_env.docker_image):
            raise TaskLoadError(f'task {name}: a separate verifier ([verifier] environment_mode = "separate") needs '
                                "tests/Dockerfile or [verifier.environment].docker_image")
    if not has_agent_environment_definition(paths.environment_dir, docker_image=config.environment.docker_image):
        raise TaskLoadError(f"task {name}: no environment: add environment/Dockerfile or set "
                            "[environment].docker_image in task.toml")
    try:
        task = Task(task_dir)
    except (OSError, ValueError) as e:  # what Harbor checks beyond the above (e.g. step directories)
        raise TaskLoadError(f"task {name}: {str(e).replace(f'{task_dir}/', '')}") from None
    reasons = unsupported_features(task)
    if reasons:
        raise UnsupportedTaskError(f"task {name}: Sprout does not run " + "; ".join(reasons))
    return task


def unsupported_features(task: Task) -> list[str]:
    """What in the task Sprout does not run, each named with the task.toml field or file that asks for it."""
    config, env = task.config, task.config.environment
    reasons = []
    if (task.paths.environment_dir / COMPOSE_FILE_NAME).exists():
        reasons.append(f"multi-container services (environment/{COMPOSE_FILE_NAME})")
    if task.has_steps:
        reasons.append("multiple steps ([[steps]] in task.toml)")
    if env.gpus or env.gpu_types:
        reasons.append(f"GPUs ([environment] gpus = {env.gpus!r}, gpu_types = {env.gpu_types!r})")
    if env.tpu is not None:
        reasons.append("a TPU ([environment] tpu)")
    if env.os is TaskOS.WINDOWS:
        reasons.append('Windows containers ([environment] os = "windows")')
    services = {a.service for a in config.artifacts if not isinstance(a, str)} | {h.service for h in config.verifier.collect}
    sidecars = sorted(s for s in services if s not in (None, MAIN_SERVICE_NAME))
    if sidecars:
        reasons.append(f"sidecar services ({', '.join(map(repr, sidecars))} named by [[verifier.collect]] service "
                       "or artifacts' service)")
    return reasons


def load_tasks(tasks_dir: Path, only: list[str] | None = None) -> TaskSet:
    """Every task of a dataset (or those named in `only`); broken ones become problems, not errors."""
    dirs = task_dirs(tasks_dir)
    if only:
        known = {d.name for d in dirs}
        unknown = [name for name in only if name not in known]
        if unknown:
            raise TaskError(f"no task named {', '.join(unknown)} in {tasks_dir} "
                            f"(it has: {', '.join(sorted(known)) or 'none'})")
        dirs = [d for d in dirs if d.name in only]
    result = TaskSet()
    for path in dirs:
        try:
            result.tasks.append(load_task(path))
        except TaskError as e:
            result.problems.append(TaskProblem(path.name, path, str(e)))
    return result
