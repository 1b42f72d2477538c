"""Layer 3: Harbor tasks on Sprout sandboxes — loading, task images, Harbor's verifier over a
sandbox (a Harbor environment), and grading a checkpoint in a branch."""

from .errors import TaskError, TaskImageError, TaskLoadError, UnsupportedTaskError
from .grade import GradeResult, grade, grade_async
from .harbor_env import CommandTimeoutError, SproutEnvironment, start_task_sandbox
from .images import TaskImage, ensure_image, image_reference
from .loading import TaskProblem, TaskSet, load_task, load_tasks, task_name, unsupported_features

__all__ = ["TaskError", "TaskImageError", "TaskLoadError", "UnsupportedTaskError", "GradeResult", "grade",
           "grade_async", "SproutEnvironment", "start_task_sandbox", "CommandTimeoutError", "TaskImage", "ensure_image",
           "image_reference", "TaskProblem", "TaskSet", "load_task", "load_tasks", "task_name",
           "unsupported_features"]
