"""Sprout's outputs as Harbor jobs, beside Sprout's own files.

An evaluation's output directory is a Harbor job: `config.json` (Harbor's JobConfig), `result.json` (its
JobResult, with Harbor's own statistics over the trials) and one trial directory per attempt
(`<attempt>/config.json`, `result.json`, and `agent/trajectory.json` in Harbor's trajectory format, ATIF). So
`harbor view DIR` lists the evaluations in DIR (a benchmark's directory, or the one an evaluation was written
into), their trials with rewards, and each trajectory. A branch's trajectory starts with its parent's turns
up to the branch point, marked as copied context, then the review's note. Written with each summary: a
trial's files once its attempt is recorded (records are final), the job's result each time.

A gate's output directory holds its Harbor job in `harbor/<name>/` (`harbor view OUTPUT/harbor`): agents
`oracle` and `nop`, a trial `<task>__oracle` and `<task>__nop` per task (`__oracle-<k>` with trials), each
with the verifier's files of that attempt. It sits one level down because OUTPUT/<task>/result.json is
Sprout's verdict, which Harbor would take for a trial.
"""

import os
import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path

from harbor.models.agent.context import AgentContext
from harbor.models.job.config import JobConfig
from harbor.models.job.result import JobResult, JobStats
from harbor.models.task.id import LocalTaskId
from harbor.models.trajectories import Agent, Observation, ObservationResult, Step, ToolCall, Trajectory
from harbor.models.trajectories.metrics import Metrics
from harbor.models.trial.config import AgentConfig, TaskConfig, TrialConfig
from harbor.models.trial.result import AgentInfo, ExceptionInfo, ModelInfo, TrialResult
from harbor.models.verifier.result import VerifierResult

from .. import __version__
from ..agent.journal import Journal, Turn, read_journal
from ..errors import SproutError
from ..files import write_atomic
from ..method.records import AttemptRecord
from ..tasks.gate import TaskGate
from .provenance import task_digest
from .summary import EvaluationSummary

AGENT = "sprout"  # Harbor's agent name for Sprout's mini-swe-agent rollouts


def write_harbor_job(out: Path, summary: EvaluationSummary, task_dir: Path) -> None:
    agent = AgentConfig(name=AGENT, model_name=summary.config.model)
    config = JobConfig(job_name=out.name, jobs_dir=out.parent, n_attempts=1, agents=[agent],
                       tasks=[TaskConfig(path=task_dir)])
    write_atomic(out / "config.json", config.model_dump_json(indent=2))
    trials = []
    for attempt in summary.attempts:
        trial_dir = out / attempt.id
        result_path = trial_dir / "result.json"
        if result_path.is_file():
            trials.append(TrialResult.model_validate_json(result_path.read_text()))
            continue
        trial = _trial(out, summary, attempt, task_dir, agent)
        write_atomic(trial_dir / "config.json", trial.config.model_dump_json(indent=2))
        trajectory = _trajectory(out, summary, attempt)
        if trajectory is not None:
            write_atomic(trial_dir / "agent" / "trajectory.json", trajectory.model_dump_json(indent=2, exclude_none=True))
        write_atomic(result_path, trial.model_dump_json(indent=2))
        trials.append(trial)
    running = summary.status == "running"
    result = JobResult(id=uuid.uuid5(uuid.NAMESPACE_URL, out.resolve().as_uri()), started_at=summary.started,
                       updated_at=datetime.now(summary.started.tzinfo), finished_at=None if running else summary.finished,
                       n_total_trials=len(trials), stats=JobStats.from_trial_results(trials, n_total_trials=len(trials)),
                       trial_results=trials)
    write_atomic(out / "result.json", result.model_dump_json(indent=2))


def _trial(out: Path, summary: EvaluationSummary, attempt: AttemptRecord, task_dir: Path,
           agent: AgentConfig) -> TrialResult:
    config = TrialConfig(task=TaskConfig(path=task_dir), trial_name=attempt.id, trials_dir=out, agent=agent)
    failed = attempt.grade_error or (attempt.message if attempt.status == "error" else None)
    return TrialResult(
        task_name=summary.config.task, trial_name=attempt.id, trial_uri=(out / attempt.id).resolve().as_uri(),
        task_id=LocalTaskId(path=task_dir), task_checksum=summary.pinning.task_digest, config=config,
        agent_info=AgentInfo(name=AGENT, version=__version__, model_info=ModelInfo(name=summary.config.model)),
        agent_result=AgentContext(n_input_tokens=attempt.tokens_in, n_output_tokens=attempt.tokens_out),
        verifier_result=VerifierResult(rewards={"reward": attempt.reward, **attempt.rewards})
        if attempt.reward is not None else None,
        exception_info=ExceptionInfo(exception_type="SproutAttemptError", exception_message=failed,
                                     exception_traceback="", occurred_at=attempt.finished) if failed else None,
        started_at=attempt.started, finished_at=attempt.finished)


def _trajectory(out: Path, summary: EvaluationSummary, attempt: AttemptRecord) -> Trajectory | None:
    """The attempt's trajectory in ATIF; None when its journal cannot be read (a cancelled attempt's is gone)."""
    try:
        journal = read_journal(out / attempt.journal)
    except SproutError:
        return None
    steps = _opening(out, summary, attempt, journal)
    steps += [_agent_step(len(steps) + i + 1, turn, summary.config.model) for i, turn in enumerate(journal.turns)]
    return Trajectory(session_id=f"{out.name}/{attempt.id}", agent=Agent(name=AGENT, version=__version__,
                      model_name=summary.config.model), steps=steps,
                      notes=f"Sprout attempt {attempt.id} ({attempt.kind}); journal {attempt.journal}")


def _opening(out: Path, summary: EvaluationSummary, attempt: AttemptRecord, journal: Journal) -> list[Step]:
    """The system message and the task; for a branch, its parent's turns up to the branch point (copied
    context) and the note the branch was given."""
    messages = journal.header.messages
    steps = [Step(step_id=i + 1, source="system" if m.get("role") == "system" else "user",
                  message=str(m.get("content") or "")) for i, m in enumerate(messages[:2])]
    parent = journal.header.parent
    if parent is None:
        return steps
    source = next((a for a in summary.attempts if a.id == attempt.parent), None)
    try:
        copied = [t for t in read_journal(out / source.journal).turns if t.turn <= parent.turn] if source else []
    except SproutError:  # a parent's journal that cannot be read leaves its turns out
        copied = []
    for turn in copied:
        step = _agent_step(len(steps) + 1, turn, summary.config.model)
        step.is_copied_context = True
        steps.append(step)
    if parent.note:
        steps.append(Step(step_id=len(steps) + 1, source="user", message=parent.note))
    return steps


def _agent_step(step_id: int, turn: Turn, model: str) -> Step:
    calls = [ToolCall(tool_call_id=f"turn-{turn.turn}-{i}", function_name="bash", arguments={"command": command})
             for i, command in enumerate(turn.commands)]
    observation = Observation(results=[ObservationResult(source_call_id=calls[-1].tool_call_id if calls else None,
                                                         content=turn.observation)])
    return Step(step_id=step_id, timestamp=turn.time.isoformat(), source="agent", model_name=model,
                message=turn.thought, tool_calls=calls or None, observation=observation,
                metrics=Metrics(prompt_tokens=turn.tokens_in, completion_tokens=turn.tokens_out),
                extra={"sprout_turn": turn.turn, "checkpoint": turn.checkpoint, "exit_code": turn.exit_code,
                       **({"changes": turn.changes.line()} if turn.changes else {})})


GATE_AGENTS = ("oracle", "nop")  # Harbor's own names for the reference solution and for doing nothing


def write_harbor_gate(output: Path, gates: list[TaskGate], task_dirs: dict[str, Path], started: datetime) -> Path:
    """The gate's Harbor job, written whole (an earlier gate's is replaced): OUTPUT/harbor/<name>/, a trial
    per task, attempt and trial of the gate. `gates` are the trials' TaskGates (one per task without trials).
    Returns the job's directory."""
    job = output / "harbor" / output.resolve().name
    shutil.rmtree(job, ignore_errors=True)
    config = JobConfig(job_name=job.name, jobs_dir=job.parent, n_attempts=1,
                       agents=[AgentConfig(name=name) for name in GATE_AGENTS],
                       tasks=[TaskConfig(path=task_dirs[name]) for name in sorted(task_dirs)])
    write_atomic(job / "config.json", config.model_dump_json(indent=2))
    digests = {name: task_digest(path) for name, path in task_dirs.items()}
    trials = [_gate_trial(job, gate, agent, task_dirs[gate.task], digests[gate.task])
              for gate in sorted(gates, key=lambda g: g.log_dir) for agent in GATE_AGENTS]
    finished = datetime.now(started.tzinfo)
    result = JobResult(id=uuid.uuid5(uuid.NAMESPACE_URL, job.resolve().as_uri()), started_at=started,
                       updated_at=finished, finished_at=finished, n_total_trials=len(trials),
                       stats=JobStats.from_trial_results(trials, n_total_trials=len(trials)), trial_results=trials)
    write_atomic(job / "result.json", result.model_dump_json(indent=2))
    return job


def _gate_trial(job: Path, gate: TaskGate, agent: str, task_dir: Path, digest: str) -> TrialResult:
    """One attempt of a task's gate as a Harbor trial, its verifier's files linked from the gate's logs."""
    logs = Path(gate.log_dir)
    trial = logs.name.removeprefix("trial-") if logs.name.startswith("trial-") else ""
    name = f"{gate.task}__{agent}" + (f"-{trial}" if trial else "")
    attempt = getattr(gate, agent)
    _link_files(logs / agent, job / name)
    grade = attempt.grade if attempt else None
    error = attempt.error if attempt else gate.reason
    config = TrialConfig(task=TaskConfig(path=task_dir), trial_name=name, trials_dir=job, agent=AgentConfig(name=agent))
    result = TrialResult(
        task_name=gate.task, trial_name=name, trial_uri=(job / name).resolve().as_uri(),
        task_id=LocalTaskId(path=task_dir), task_checksum=digest, config=config,
        agent_info=AgentInfo(name=agent, version=__version__),
        verifier_result=VerifierResult(rewards={"reward": grade.reward, **grade.rewards})
        if grade and grade.reward is not None else None,
        exception_info=ExceptionInfo(exception_type="SproutGateError", exception_message=error,
                                     exception_traceback="", occurred_at=datetime.now(UTC)) if error else None)
    write_atomic(job / name / "config.json", config.model_dump_json(indent=2))
    write_atomic(job / name / "result.json", result.model_dump_json(indent=2))
    return result


def _link_files(source: Path, dest: Path) -> None:
    """The regular files under `source` (agent/, verifier/ of one attempt), hard-linked (copied across
    filesystems) at the same places under `dest`; links and anything else are left out."""
    if not source.is_dir():
        return
    for path in source.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        target = dest / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copyfile(path, target)
