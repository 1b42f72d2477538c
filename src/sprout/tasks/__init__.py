"""Layer 3: Harbor tasks on Sprout sandboxes — loading, task images, Harbor's verifier over a
sandbox (a Harbor environment), and grading a checkpoint in a branch."""

from typing import TYPE_CHECKING

from ..lazy import exports
from .errors import TaskError, TaskImageError, TaskLoadError, UnsupportedTaskError

if TYPE_CHECKING:
    from .grade import GradeResult, grade_async
    from .harbor_env import CommandTimeoutError, SproutEnvironment, start_task_sandbox
    from .images import TaskImage, ensure_image, image_reference
    from .loading import TaskProblem, TaskSet, load_task, load_tasks, task_name, unsupported_features

__getattr__ = exports(__name__, {
    ".grade": ["GradeResult", "grade_async"],  # grade() itself: sprout.tasks.grade.grade (the name is its module's)
    ".harbor_env": ["CommandTimeoutError", "SproutEnvironment", "start_task_sandbox"],
    ".images": ["TaskImage", "ensure_image", "image_reference"],
    ".loading": ["TaskProblem", "TaskSet", "load_task", "load_tasks", "task_name", "unsupported_features"],
})

__all__ = ["TaskError", "TaskImageError", "TaskLoadError", "UnsupportedTaskError", "GradeResult",
           "grade_async", "SproutEnvironment", "start_task_sandbox", "CommandTimeoutError", "TaskImage", "ensure_image",
           "image_reference", "TaskProblem", "TaskSet", "load_task", "load_tasks", "task_name",
           "unsupported_features"]
