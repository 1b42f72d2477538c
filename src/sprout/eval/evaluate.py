"""One task, pinned, with SPROUT (review + branch rounds) or a baseline: `evaluate(EvaluateConfig)`.

The first attempt is an agent rollout in the task's image (a checkpoint per turn), graded by Harbor's
verifier in its live sandbox after its final checkpoint. `sprout`: when it fails, a reviewer model picks turns
before the mistake and round r runs branches[r] branches from them, at the same time (`parallel`; the first
to score 1 cancels the others). `restarts`: fresh attempts with SPROUT's budget, in waves (see
sprout.method.search and sprout.method.budget). `single`: one attempt.

Refused: a dataset digest other than the tasks directory's Harbor digest, a manifest that does not list the
task with its digest, uncommitted changes in Sprout's checkout (unless `allow_dirty`), and an output that
holds a different run (unless `overwrite`). With SPROUT_RUNSTORE_URL and SPROUT_RUNSTORE_TOKEN set
(`eval "$(sprout services env)"`), rollouts, grades and reviews run as Run Store jobs on its workers;
otherwise in this process. Both give the same summary. Over a Run Store the workers' keys are used only for
endpoints configured on them (`model_endpoint_name`, default "default"); a plain `model_endpoint` URL is
called with no key. The same run into the same output resumes: finished attempts and reviews are kept,
interrupted ones are rerun. Output: summary.json, attempts/<id>.jsonl, reviews/<id>.json, verifier/<id>/
(`sprout report task OUT` shows it).
"""

import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from harbor.models.task.task import Task
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from ..agent import defaults
from ..agent.journal import now
from ..agent.models import Endpoint
from ..agent.runner import TurnEvent
from ..console import console, errors
from ..errors import SproutError, UsageError
from ..jobs.endpoints import check_name
from ..jobs.journals import release
from ..jobs.local import Jobs, LocalJobs
from ..jobs.remote import RunStoreJobs, configured_client
from ..method.budget import BudgetBy, equal_budget
from ..method.review import Reviewer, ReviewerConfig
from ..method.search import Method, MethodConfig, MethodResult, run_method, wave_size
from ..sandbox import Store, trust
from ..sandbox import backends as sandbox_backends
from ..sandbox.backends import BackendName
from ..sandbox.slots import host_slot_count
from ..tasks import TaskImage, ensure_image, load_task
from ..tasks.pull import PullPolicy
from .executor import AgentConfig, AttemptsLost, TaskExecutor
from .harbor_job import write_harbor_job
from .provenance import Pinning, SourceState, check_pinning, check_source
from .regrade import regrade_attempts
from .summary import SUMMARY, EvaluationConfig, EvaluationSummary, ImageInfo, read_summary, write_summary


class EvaluationOptions(BaseModel):
    """How tasks are evaluated: everything `sprout evaluate` and `sprout benchmark` share."""

    model_config = ConfigDict(extra="forbid")

    dataset_digest: str = Field(description="the Harbor digest of the tasks directory (sha256:...); must match")
    preparation_manifest: Path = Field(description="the manifest `sprout prepare` wrote; it must list the task")
    model: str = Field(description="the agent's model, as its endpoint serves it")
    model_endpoint: str | None = Field(None, description="its Chat Completions base URL (default $OPENAI_BASE_URL)")
    model_key_env: str | None = Field(None, description="the variable holding its key (default OPENAI_API_KEY)")
    model_endpoint_name: str | None = Field(None, description="over a Run Store: an endpoint the workers configured")
    model_class: Literal["tools", "text"] = Field("tools", description="tool calls, or text command blocks")
    rounds: int = Field(2, description="SPROUT's review and branch rounds")
    branches: list[int] = Field([4, 3], description="branches per round, one number per round")
    review_model: str | None = Field(None, description="the reviewer's model (default: the agent's)")
    review_endpoint: str | None = Field(None, description="the reviewer's base URL (default: the agent's)")
    review_key_env: str | None = Field(None, description="the variable holding the reviewer's key")
    review_endpoint_name: str | None = Field(None, description="over a Run Store: the reviewer's worker endpoint")
    review_retries: int = Field(2, ge=0, description="calls again after an unusable review answer")
    review_changes: bool = Field(False, description="the reviewer also reads what each turn changed on disk "
                                                    "(recorded in the summary)")
    early_stop: bool = Field(True, description="the first attempt to score 1 cancels its running siblings")
    parallel: int | None = Field(None, description="attempts at once (default: a round's branch count)")
    budget_by: BudgetBy = Field("turns", description="what the restarts baseline's equal budget counts")
    step_limit: int = Field(defaults.STEP_LIMIT, description="model calls per attempt")
    token_limit: int = Field(defaults.TOKEN_LIMIT, description="agent tokens per attempt")
    wall_time_limit: int | None = Field(None, description="seconds per attempt (default: the task's, else 3600)")
    command_timeout: int = Field(defaults.COMMAND_TIMEOUT_S, description="seconds per agent command")
    seed: int = Field(0, description="the sampling seed sent to the reviewer")
    store: Path | None = Field(None, description="the btrfs store (default $SPROUT_STORE)")
    runtime_bin: Path | None = Field(None, description="the confined runtime (default $SPROUT_RUNTIME_BIN)")
    backend: BackendName = Field(sandbox_backends.DEFAULT, description="the sandboxes' backend")
    pull: PullPolicy | None = Field(None, description="when task images are pulled (default $SPROUT_PULL_POLICY)")
    keep_checkpoints: bool = Field(False, description="keep the attempts' checkpoints after a finished evaluation")
    regrade: int = Field(0, ge=0, description="grade each graded attempt this many more times from its final "
                         "checkpoint, in branches, and record its pass rate (here, not over a Run Store)")
    allow_dirty: bool = Field(False, description="run from a checkout with uncommitted changes (recorded)")
    overwrite: bool = Field(False, description="replace what the output holds instead of resuming or refusing")
    affinity_timeout: float = Field(60.0, gt=0, description="over a Run Store: seconds a branch waits for its host")
    quiet: bool = Field(False, description="no per-turn lines")


class EvaluateConfig(EvaluationOptions):
    """One evaluation: a task, a method, an output directory, and how."""

    task_dir: Path = Field(description="the Harbor task directory")
    output: Path = Field(description="the output directory; resumed when it holds the same run")
    method: Method = Field("sprout", description="sprout, restarts or single")


def check_rounds(rounds: int, branches: list[int]) -> None:
    if rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {rounds}")
    if len(branches) != rounds:
        raise UsageError(f"--rounds {rounds} needs {rounds} --branches value{'s' if rounds > 1 else ''} (one per "
                         f"round), got {len(branches)}: {' '.join(map(str, branches))}")
    if any(b < 1 for b in branches):
        raise UsageError(f"every --branches value must be at least 1, got {' '.join(map(str, branches))}")


def check_parallel(parallel: int | None) -> None:
    if parallel is not None and parallel < 1:
        raise UsageError(f"--parallel must be at least 1, got {parallel}")


def endpoints(options: EvaluationOptions, *, remote: bool, review: bool = True) -> tuple[Endpoint, Endpoint | None]:
    """The agent's and (with `review`) the reviewer's endpoints. In-process: URLs with keys from this
    environment. Over a Run Store: a name configured on the workers (their URL and key) or a plain URL
    (called with no key)."""
    if not remote:
        for flag in ("model", "review"):
            if getattr(options, f"{flag}_endpoint_name"):
                raise UsageError(f"--{flag}-endpoint-name names an endpoint of a Run Store's workers; without "
                                 f"SPROUT_RUNSTORE_URL and SPROUT_RUNSTORE_TOKEN pass --{flag}-endpoint URL "
                                 f"(and --{flag}-key-env VAR)")
        endpoint = Endpoint.resolve(options.model_endpoint, options.model_key_env)
        return endpoint, (Endpoint.resolve(options.review_endpoint or endpoint.url,
                                           options.review_key_env or endpoint.key_env) if review else None)
    endpoint = _remote_endpoint(options, "model") or Endpoint("", None, name="default")
    return endpoint, (_remote_endpoint(options, "review") or endpoint) if review else None


def _remote_endpoint(options: EvaluationOptions, flag: str) -> Endpoint | None:
    """--{flag}-endpoint-name or --{flag}-endpoint over a Run Store (None: neither given)."""
    url, name = getattr(options, f"{flag}_endpoint"), getattr(options, f"{flag}_endpoint_name")
    if getattr(options, f"{flag}_key_env"):
        raise UsageError(f"--{flag}-key-env does not apply over a Run Store: workers call with the keys of their "
                         f"own configured endpoints; name one with --{flag}-endpoint-name NAME, or pass "
                         f"--{flag}-endpoint URL alone for an endpoint that needs no key")
    if url and name:
        raise UsageError(f"pass --{flag}-endpoint URL or --{flag}-endpoint-name NAME, not both")
    if name:
        try:
            return Endpoint("", None, name=check_name(name))
        except ValueError as e:
            raise UsageError(f"--{flag}-endpoint-name: {e}") from None
    return Endpoint(Endpoint.resolve(url, None, require_key=False).url, None) if url else None


@dataclass
class _Run:
    """What an evaluation run has settled before its first attempt."""

    config: EvaluateConfig
    task: Task
    recorded: EvaluationConfig  # what its summary records (and hashes)
    pinning: Pinning
    source: SourceState
    endpoint: Endpoint
    review_endpoint: Endpoint | None
    parallel: int | None
    store: Store
    client: object | None  # a Run Store client, or None: here


def evaluate(config: EvaluateConfig, *, out: Console = console) -> EvaluationSummary:
    """Runs (or resumes) one evaluation; returns its summary (also in summary.json). `out` shows progress."""
    run = _settle(config)
    previous = _open_output(config.output, run.recorded, run.store, overwrite=config.overwrite)
    if previous is not None and previous.status in ("solved", "unsolved"):
        out.print(f"{config.output}: already finished ({previous.status}); nothing to do")
        return previous
    config.output.mkdir(parents=True, exist_ok=True)
    out.print(f"[bold]{run.pinning.task}[/bold] · {config.method} · model {config.model} @ {run.endpoint.host} · "
              f"budget {run.recorded.budget.rule} · output {config.output}", markup=True)
    if run.source.dirty:
        errors.print(f"warning: running from a checkout with uncommitted changes (--allow-dirty): "
                     f"{len(run.source.changes)} changed path(s), recorded in the summary")
    image = _task_image(run, out)
    summary = _new_summary(run, image, previous)
    jobs = _jobs(run, image, summary, out)
    executor = _executor(run, image, jobs, summary, previous, out)
    result = _run_method(run, executor, summary)
    if config.regrade:
        _regrade(run, summary, out)
    _write_harbor_job(config, summary, out)
    if not config.keep_checkpoints:
        release(run.store, [config.output / a.journal for a in summary.attempts if not a.cancelled])
    colour = "green" if result.solved_by else "yellow"
    out.print(f"[{colour}]{summary.status}[/{colour}]" + (f" by {summary.solved_by}" if summary.solved_by else "")
              + f" · {summary.totals.attempts} attempts · {summary.totals.turns} turns · "
              f"{summary.totals.tokens_in + summary.totals.tokens_out:,} agent tokens"
              + (f" + {summary.totals.review_tokens:,} review" if summary.reviews else "")
              + f" · {summary.wall_s:.1f}s", markup=True)
    out.print(f"  view: sprout report task {config.output}", markup=False)
    return summary


def _write_harbor_job(config: EvaluateConfig, summary: EvaluationSummary, out: Console) -> None:
    """The output directory as a Harbor job too (sprout.eval.harbor_job); a failure there is a warning, never
    the evaluation's end."""
    try:
        write_harbor_job(config.output, summary, config.task_dir)
    except (ValueError, OSError) as e:  # pydantic's ValidationError is a ValueError
        out.print(f"warning: the Harbor job files were not written: {' '.join(str(e).split())[:300]}", markup=False)


def _regrade(run: _Run, summary: EvaluationSummary, out: Console) -> None:
    """--regrade N: every graded attempt's pass rate over N more grades, in the summary."""
    out.print(f"  re-grading each attempt {run.config.regrade} times from its final checkpoint", markup=False)
    regrade_attempts(run.store, run.task, summary.attempts, run.config.regrade, pull=run.config.pull)
    summary.regrade = run.config.regrade
    write_summary(run.config.output, summary)
    for attempt in summary.attempts:
        if attempt.pass_rate is not None:
            passed = round(attempt.pass_rate * (len(attempt.regrades) + 1))
            out.print(f"  {attempt.id}: passed {passed} of {len(attempt.regrades) + 1} grades "
                      f"({attempt.pass_rate:.0%})", markup=False)


def _settle(config: EvaluateConfig) -> _Run:
    """The checks, the pinning, the endpoints and the recorded configuration of a run."""
    check_rounds(config.rounds, config.branches)
    check_parallel(config.parallel)
    source = check_source(config.allow_dirty)
    pinning = check_pinning(config.task_dir, config.dataset_digest, config.preparation_manifest)
    task = load_task(config.task_dir)
    client = configured_client()  # a Run Store: its workers make the model calls, with their keys
    if client is not None and config.regrade:
        raise UsageError("--regrade runs without a Run Store for now: the attempts' final checkpoints are on the "
                         "workers' hosts")
    endpoint, review_endpoint = endpoints(config, remote=client is not None, review=config.method == "sprout")
    wall_time = config.wall_time_limit or int(task.config.agent.timeout_sec or defaults.WALL_TIME_S)
    budget = equal_budget(config.method, config.budget_by, config.step_limit, config.token_limit, config.branches)
    recorded = EvaluationConfig(
        task=pinning.task, task_digest=pinning.task_digest, dataset_digest=pinning.dataset_digest,
        method=config.method, rounds=config.rounds, branches=config.branches, early_stop=config.early_stop,
        budget=budget, model=config.model, model_class=config.model_class,
        review_model=(config.review_model or config.model) if config.method == "sprout" else None,
        step_limit=config.step_limit, token_limit=config.token_limit, wall_time_s=wall_time,
        command_timeout_s=config.command_timeout, review_retries=config.review_retries,
        review_changes=config.review_changes and config.method == "sprout", seed=config.seed,
        commit=source.commit, wave=_wave(config.method, config.branches, config.parallel))
    recorded, parallel = _recorded_wave(config.output, recorded, config.parallel)
    store = Store(config.store, runtime_bin=config.runtime_bin, backend=config.backend)
    return _Run(config, task, recorded, pinning, source, endpoint, review_endpoint, parallel, store, client)


def _task_image(run: _Run, out: Console) -> TaskImage:
    image = ensure_image(run.store, run.task.paths.environment_dir, run.task.config.environment, name=run.pinning.task,
                         log_path=run.config.output / "image-build.log", pull=run.config.pull)
    if image.warning:
        errors.print(f"warning: {image.warning}")
    prepared = run.pinning.prepared_image
    if prepared is not None and prepared.image_id != image.image.image_id:
        errors.print(f"warning: the task's image is {image.image.image_id}, not {prepared.image_id} as prepared "
                     "(rebuilt since); both are recorded")
    return image


def _new_summary(run: _Run, image: TaskImage, previous: EvaluationSummary | None) -> EvaluationSummary:
    summary = EvaluationSummary(
        config=run.recorded, config_hash=run.recorded.digest(), pinning=run.pinning, source=run.source,
        image=ImageInfo(reference=image.reference, image_id=image.image.image_id, key=image.image.key,
                        prepared=run.pinning.prepared_image, source=image.source, warning=image.warning,
                        stand_in=image.stand_in),
        host_trust=trust.host_trust().enabled, endpoint_host=run.endpoint.host,
        review_endpoint_host=run.review_endpoint.host if run.review_endpoint else None)
    if previous is not None:
        summary.started, summary.wall_s, summary.sessions = previous.started, previous.wall_s, previous.sessions + 1
    return summary


def _jobs(run: _Run, image: TaskImage, summary: EvaluationSummary, out: Console) -> Jobs:
    """Where the attempts run: here, or as Run Store jobs when a Run Store is configured."""
    if run.client is None:
        wanted, slots = run.parallel or max(run.config.branches), host_slot_count()
        if wanted > slots:
            out.print(f"  note: {wanted} attempts at once asked; this host runs at most {slots} at once, shared "
                      "with its other evaluations and gates ($SPROUT_HOST_SLOTS)", markup=False)
        return LocalJobs(run.store, run.task, image.image)
    group_id = f"eval-{run.pinning.task}-{uuid.uuid4().hex[:8]}"
    jobs = RunStoreJobs(run.client, task_dir=run.config.task_dir, group_id=group_id,
                        affinity_timeout_s=run.config.affinity_timeout, backend=run.config.backend)
    summary.runstore, summary.runstore_group = run.client.url, group_id  # type: ignore[attr-defined]
    out.print(f"  running as Run Store jobs at {summary.runstore} (group {group_id})", markup=False)
    return jobs


def _executor(run: _Run, image: TaskImage, jobs: Jobs, summary: EvaluationSummary,
              previous: EvaluationSummary | None, out: Console) -> TaskExecutor:
    """The executor of the run's attempts and reviews; every record it makes is saved to summary.json."""
    config = run.config
    session_start, base_wall = time.monotonic(), summary.wall_s
    reviewer = Reviewer(ReviewerConfig(model=run.recorded.review_model or config.model, retries=config.review_retries,
                                       seed=config.seed, show_changes=run.recorded.review_changes),
                        run.review_endpoint) if run.review_endpoint else None

    def save() -> None:
        summary.attempts, summary.reviews = list(executor.attempts), list(executor.reviews)
        summary.refresh()
        summary.wall_s = round(base_wall + time.monotonic() - session_start, 3)
        write_summary(config.output, summary)
        _write_harbor_job(config, summary, out)

    executor = TaskExecutor(
        store=run.store, jobs=jobs, task=run.task, image=image, reviewer=reviewer, out=config.output,
        agent=AgentConfig(model=config.model, endpoint=run.endpoint, model_class=config.model_class,
                          wall_time_s=run.recorded.wall_time_s, command_timeout_s=config.command_timeout),
        recorded_attempts=previous.attempts if previous else (), recorded_reviews=previous.reviews if previous else (),
        on_record=save, on_turn=None if config.quiet else _turn_printer(out),
        log=lambda text: out.print(text, markup=False))
    save()
    return executor


def _run_method(run: _Run, executor: TaskExecutor, summary: EvaluationSummary) -> MethodResult:
    """The method over the executor; the summary's status follows (interrupted, error, solved, unsolved)."""
    config = run.config
    method = MethodConfig(method=config.method, branches=config.branches, early_stop=config.early_stop,
                          step_limit=config.step_limit, token_limit=config.token_limit, budget=run.recorded.budget,
                          parallel=run.parallel)
    try:
        result = run_method(method, executor)
    except KeyboardInterrupt:
        summary.status = "interrupted"
        executor.on_record()
        raise
    except SproutError as e:
        summary.status, summary.error = "lost" if isinstance(e, AttemptsLost) else "error", str(e)
        executor.on_record()
        raise
    summary.status = "solved" if result.solved_by else "unsolved"
    summary.finished = now()
    executor.on_record()
    return result


def _wave(method: Method, branches: list[int], parallel: int | None) -> int | None:
    """The restarts' wave size when it is not 1 (it decides their plans, so it is part of the run); None
    otherwise, so that sequential runs keep their configuration hash."""
    wave = wave_size(method, branches, parallel)
    return wave if wave and wave > 1 else None


def _recorded_wave(out: Path, config: EvaluationConfig, parallel: int | None) -> tuple[EvaluationConfig, int | None]:
    """Without --parallel, a restarts run recorded with another wave (one at a time, as before waves
    existed) resumes with its own: the wave decides the plans, so it is part of the run."""
    if parallel is not None or config.method != "restarts" or not (out / SUMMARY).exists():
        return config, parallel
    try:
        previous = read_summary(out)
    except SproutError:
        return config, parallel
    recorded = config.model_copy(update={"wave": previous.config.wave})
    if previous.config_hash == config.digest() or previous.config_hash != recorded.digest():
        return config, parallel
    console.print(f"  resuming with the recorded wave of {previous.config.wave or 1} restart(s) at once", markup=False)
    return recorded, previous.config.wave or 1


def _open_output(out: Path, config: EvaluationConfig, store: Store, *, overwrite: bool) -> EvaluationSummary | None:
    """The previous summary of the same run (to resume), None for a fresh output (emptied first with
    `overwrite`); refuses a different run."""
    if not out.exists() or not any(out.iterdir()):
        return None
    try:
        previous = read_summary(out) if (out / SUMMARY).exists() else None
    except SproutError:
        previous = None
    if previous is not None and previous.config_hash == config.digest() and not overwrite:
        return previous
    if not overwrite:
        if previous is None:
            raise SproutError(f"{out} exists and is not a Sprout evaluation of this run; pass --overwrite to "
                              "replace it or choose another --output")
        changed = "; ".join(config.differences(previous.config)) or "the configuration"
        raise SproutError(f"{out} holds a different run ({changed}); pass --overwrite to replace it or choose "
                          "another --output")
    release(store, sorted((out / "attempts").glob("*.jsonl")))
    shutil.rmtree(out)
    return None


def _turn_printer(out: Console) -> Callable[[str, TurnEvent], None]:
    def show(attempt_id: str, event: TurnEvent) -> None:
        turn = event.turn
        command = (turn.commands[0] if turn.commands else "(no command)").replace("\n", " ")
        out.print(f"  {attempt_id:<6} turn {turn.turn:>3}  rc={'-' if turn.exit_code is None else turn.exit_code:<3} "
                  f"{command[:90]}", markup=False, style="dim")

    return show


if __name__ == "__main__":  # the seed's form of `sprout evaluate`
    from ..cli import alias

    alias("sprout.eval.evaluate")
