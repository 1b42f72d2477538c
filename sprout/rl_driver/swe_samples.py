"""A sample of a SWE-rebench V2 instance: the agent works in a sandbox of the instance's image in
`/<repo name>`; at its end the agent's change is taken as a diff against `base_commit` and graded as the
official harness grades it, in a fresh sandbox of the image (sprout.tasks.swe_rebench_grade)."""

import socket
import threading
from functools import cache
from pathlib import Path

from ..agent.journal import Outcome
from ..agent.runner import RolloutCancelled, run_rollout
from ..method.backend import RolloutDone
from ..sandbox import Sandbox, Store
from ..tasks import GradeResult
from ..tasks.pull import ensure_present, pull_policy
from ..tasks.swe_rebench import Instance, InstanceSet, load_instances, repo_dir
from ..tasks.swe_rebench_grade import Parsers, SweGrade, agent_diff, grade_instance, load_parsers
from .config import SweRebenchSpec


def run_swe_sample(store: Store, plan, stop: threading.Event) -> RolloutDone:
    """Runs `plan` (a SamplePlan of a SWE-rebench instance) in this process; its sandbox goes at the end."""
    from ..method.executor import discard

    spec: SweRebenchSpec = plan.swe
    instance = _instance(spec.dataset_path, spec.dataset_sha256, spec.instance_id)
    parsers = _parsers(spec.parser_path, spec.grader_revision)
    request = plan.rollout_request()
    rollout = request.spec
    rollout.image, rollout.cwd = instance.image_name, repo_dir(instance)
    ensure_present(store, instance.image_name, pull_policy(None), what=f"instance {instance.instance_id}'s image")
    sandbox = store.create_sandbox(store.import_image(instance.image_name), label=request.attempt)
    graded: list[SweGrade] = []

    def grade_at_the_end(live: Sandbox, outcome: Outcome) -> None:
        if outcome.final_checkpoint:
            graded.append(grade_instance(store, instance, agent_diff(live, instance), parsers,
                                         timeout_s=plan.grade_wall_s, network=spec.verifier_network == "allow"))

    try:
        result = run_rollout(rollout, store, sandbox=sandbox, stop=stop, on_finish=grade_at_the_end)
    except RolloutCancelled:
        discard(store, rollout.journal)
        raise
    return RolloutDone(result.outcome, socket.gethostname(), grade_result(graded[0]) if graded else None)


def grade_result(grade: SweGrade) -> GradeResult:
    """A SWE-rebench grade as the driver's grade record: a verdict of 0 or 1, or none (error)."""
    verdict = "error" if grade.reward is None else ("pass" if grade.reward >= 1 else "fail")
    return GradeResult(reward=grade.reward, rewards={} if grade.reward is None else {"reward": grade.reward},
                       verdict=verdict, verifier_output=grade.log_tail, error=grade.error or grade.zero_reason,
                       duration_s=grade.duration_s, mode="fresh", decided_by="reward",
                       touched_test_paths=grade.touched_test_paths)


def _instance(path: Path, sha256: str | None, instance_id: str) -> Instance:
    return _dataset(path, sha256).get(instance_id)


@cache
def _dataset(path: Path, sha256: str | None) -> InstanceSet:
    """A dataset file read once per driver process (it may hold tens of thousands of rows)."""
    return load_instances(path, sha256)


@cache
def _parsers(path: Path, grader_revision: str | None) -> Parsers:
    return load_parsers(path, grader_revision)
