"""SWE-rebench V2: instances from the dataset's file (instances), the official verdict on a test log
(verdict), grading as the official harness in a fresh sandbox (grade), Harbor task directories for
`sprout.eval` (harbor), and the command line (`sprout swe-rebench`)."""

from typing import TYPE_CHECKING

from ...lazy import exports
from .instances import (
    Instance,
    InstanceSet,
    SweRebenchError,
    SweRebenchRef,
    load_instances,
    read_patches,
    repo_dir,
    task_prompt,
)
from .verdict import Parsers, SweGradeError, load_parsers, official_log, strip_timing, verdict

if TYPE_CHECKING:
    from .grade import SweGrade, agent_diff, grade_instance, touched_test_paths

__getattr__ = exports(__name__, {
    ".grade": ["SweGrade", "agent_diff", "grade_instance", "touched_test_paths"],
})

__all__ = [
    "Instance", "InstanceSet", "Parsers", "SweGrade", "SweGradeError", "SweRebenchError", "SweRebenchRef",
    "agent_diff", "grade_instance", "load_instances", "load_parsers", "official_log", "read_patches", "repo_dir",
    "strip_timing", "task_prompt", "touched_test_paths", "verdict",
]
