"""A rollout on a SWE-rebench V2 instance: the agent works in a sandbox of the instance's image in
`/<repo name>`; at its end its change is taken as a diff against `base_commit` and graded as the official
harness grades it, in a fresh sandbox of the image (sprout.tasks.swe_rebench.grade)."""

import threading
from functools import cache
from pathlib import Path

from ...agent.journal import Outcome
from ...agent.runner import RolloutResult, RolloutSpec, run_rollout
from ...sandbox import Checkpoint, Sandbox, Store
from ..grade import GradeResult
from ..pull import ensure_present, pull_policy
from .grade import Rule, SweGrade, agent_diff, grade_instance
from .instances import Instance, InstanceSet, SweRebenchRef, load_instances, repo_dir
from .verdict import Parsers, load_parsers

GRADE_WALL_S = 600.0  # a grade's test commands, at most, unless told (the Miles example's default)


def run_swe_rollout(store: Store, spec: RolloutSpec, ref: SweRebenchRef, *, grade_wall_s: float, label: str,
                    stop: threading.Event | None = None) -> tuple[RolloutResult, GradeResult | None]:
    """Runs `spec` on the instance `ref` names (its image and working directory replace the spec's), or a
    branch of such a rollout, and grades it at the end; a stopped rollout raises RolloutCancelled."""
    instance, parsers = instance_of(ref), _parsers(ref.parser_path, ref.grader_revision)
    spec.image, spec.cwd = instance.image_name, repo_dir(instance)
    sandbox = None  # a branch starts from its checkpoint
    if spec.from_journal is None:
        ensure_present(store, instance.image_name, pull_policy(None), what=f"instance {instance.instance_id}'s image")
        sandbox = store.create_sandbox(store.import_image(instance.image_name), network=True, label=label)
    graded: list[SweGrade] = []

    def grade_at_the_end(live: Sandbox, outcome: Outcome) -> None:
        if outcome.final_checkpoint:
            graded.append(grade_instance(store, instance, agent_diff(live, instance), parsers,
                                         timeout_s=grade_wall_s, network=ref.verifier_network == "allow"))

    result = run_rollout(spec, store, sandbox=sandbox, stop=stop, on_finish=grade_at_the_end)
    return result, grade_result(graded[0]) if graded else None


def grade_checkpoint(store: Store, checkpoint: Checkpoint, ref: SweRebenchRef, *, grade_wall_s: float) -> GradeResult:
    """Grades the agent's change in a stored checkpoint (taken in a throwaway branch of it)."""
    return grade_result(grade_swe(store, ref, checkpoint, timeout_s=grade_wall_s))


def grade_swe(store: Store, ref: SweRebenchRef, change: Checkpoint | str, *, timeout_s: float,
              rule: Rule = "exact") -> SweGrade:
    """The official grade of the instance `ref` names for `change`: a checkpoint (its diff against
    base_commit) or a diff as text."""
    instance = instance_of(ref)
    diff = agent_diff(change, instance) if isinstance(change, Checkpoint) else change
    return grade_instance(store, instance, diff, _parsers(ref.parser_path, ref.grader_revision), timeout_s=timeout_s,
                          rule=rule, network=ref.verifier_network == "allow")


def grade_result(grade: SweGrade) -> GradeResult:
    """A SWE-rebench grade as a grade record: a verdict of 0 or 1, or none (error)."""
    verdict = "error" if grade.reward is None else ("pass" if grade.reward >= 1 else "fail")
    return GradeResult(reward=grade.reward, rewards={} if grade.reward is None else {"reward": grade.reward},
                       verdict=verdict, verifier_output=grade.log_tail, error=grade.error or grade.zero_reason,
                       duration_s=grade.duration_s, mode="fresh", decided_by="reward",
                       touched_test_paths=grade.touched_test_paths)


def instance_of(ref: SweRebenchRef) -> Instance:
    return ref.instance(_dataset(ref.dataset_path, ref.dataset_sha256))


@cache
def _dataset(path: Path, sha256: str | None) -> InstanceSet:
    """A dataset file read once per process (it may hold tens of thousands of rows)."""
    return load_instances(path, sha256)


@cache
def _parsers(path: Path, grader_revision: str | None) -> Parsers:
    return load_parsers(path, grader_revision)
