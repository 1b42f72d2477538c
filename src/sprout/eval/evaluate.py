"""python -m sprout.eval.evaluate: one task, pinned, with SPROUT (review + branch rounds) or a baseline.

    python -m sprout.eval.evaluate --task-dir DIR/<task> --dataset-digest sha256:... \\
        --preparation-manifest runs/prep.json --output runs/<task>-sprout --method sprout \\
        --model M --model-endpoint URL --model-key-env VAR --rounds 2 --branches 4 3

The first attempt is an agent rollout in the task's image (a checkpoint per turn), graded by Harbor's
verifier in its live sandbox after its final checkpoint. `sprout`: when it fails, a reviewer model picks turns
before the mistake and round r runs branches[r] branches from them, at the same time (--parallel; the
first to score 1 cancels the others). `restarts`: fresh attempts with SPROUT's budget, in waves (see
sprout.method.search and sprout.method.budget). `single`: one attempt.

Refused: --dataset-digest other than the tasks directory's Harbor digest, a manifest that does not
list the task with its digest, uncommitted changes in Sprout's checkout (unless --allow-dirty), and
an --output that holds a different run (unless --overwrite). With SPROUT_RUNSTORE_URL and
SPROUT_RUNSTORE_TOKEN set (`eval "$(python -m sprout.services env)"`), rollouts, grades and reviews run
as Run Store jobs on its workers; otherwise in this process. Both give the same summary. Over a Run Store
the workers' keys are used only for endpoints configured on them: --model-endpoint-name NAME (default
"default"); a plain --model-endpoint URL is called with no key. The same run into the same --output
resumes: finished attempts and reviews are kept, interrupted ones are rerun. Output: summary.json,
attempts/<id>.jsonl, reviews/<id>.json, verifier/<id>/; view it with `python -m ops.report task OUT`.
"""

import argparse
import os
import shutil
import time
import uuid
from pathlib import Path

from ..agent import defaults
from ..agent.journal import now
from ..agent.models import Endpoint
from ..agent.runner import TurnEvent
from ..console import console, errors, run_cli
from ..errors import SproutError
from ..jobs.endpoints import check_name
from ..jobs.journals import release
from ..jobs.local import LocalJobs
from ..jobs.remote import RunStoreJobs, configured_client
from ..method.budget import equal_budget
from ..method.review import Reviewer, ReviewerConfig
from ..method.search import MethodConfig, run_method, wave_size
from ..sandbox import Store, backends, trust
from ..sandbox.slots import SLOTS_ENV, host_slot_count
from ..tasks import ensure_image, load_task
from ..tasks.pull import PULL_HELP, PULL_POLICIES
from .executor import AgentConfig, TaskExecutor
from .provenance import check_pinning, check_source
from .summary import SUMMARY, EvaluationConfig, EvaluationSummary, ImageInfo, read_summary, write_summary

DEFAULTS = {"rounds": 2, "branches": [4, 3], "step_limit": defaults.STEP_LIMIT, "token_limit": defaults.TOKEN_LIMIT,
            "command_timeout": defaults.COMMAND_TIMEOUT_S, "review_retries": 2, "seed": 0, "model_retries": 4}


def add_arguments(group, *, single_task: bool = True) -> list[argparse.Action]:
    """Adds the evaluation flags to a parser or group (the benchmark shares all but the task's and
    output's); returns the actions."""
    actions: list[argparse.Action] = []

    def add(*flags, **kwargs) -> None:
        actions.append(group.add_argument(*flags, **kwargs))

    if single_task:
        add("--task-dir", type=Path, required=True, help="the Harbor task directory to evaluate")
        add("--output", type=Path, required=True,
            help="output directory (e.g. runs/<task>-sprout); resumed when it holds the same run")
    add("--dataset-digest", required=True,
        help="Harbor dataset digest (sha256:...) of the tasks directory; must match what it is now")
    add("--preparation-manifest", type=Path, required=True,
        help="JSON from `python -m sprout.eval.prepare`; must list the task with its digest")
    add("--model", required=True, help="the agent's model, as the endpoint serves it")
    add("--model-endpoint", help="Chat Completions base URL (default: $OPENAI_BASE_URL); over a Run Store it is "
                                 "called with no key")
    add("--model-key-env", help="variable holding the API key (default OPENAI_API_KEY); never recorded; in-process only")
    add("--model-endpoint-name", metavar="NAME",
        help="over a Run Store: a model endpoint configured on the workers (services.json), called with their "
             "key (default: default, unless --model-endpoint is given)")
    add("--model-class", choices=["tools", "text"], default="tools",
        help="tools: tool calls (default); text: ```mswea_bash_command blocks, for endpoints without tools")
    add("--rounds", type=int, default=DEFAULTS["rounds"], help="SPROUT review+branch rounds (default 2)")
    add("--branches", type=int, nargs="+", default=DEFAULTS["branches"], metavar="B",
        help="branches per round, one number per round (default 4 3); also sets the restarts budget")
    add("--review-model", help="the reviewer's model (default: --model)")
    add("--review-endpoint", help="the reviewer's base URL (default: the agent's endpoint)")
    add("--review-key-env", help="variable holding the reviewer's key (default: the agent's); in-process only")
    add("--review-endpoint-name", metavar="NAME",
        help="over a Run Store: the reviewer's endpoint configured on the workers (default: the agent's endpoint)")
    add("--review-retries", type=int, default=DEFAULTS["review_retries"],
        help="calls again after an unusable review answer before the fallback rule (default 2)")
    add("--no-early-stop", dest="early_stop", action="store_false",
        help="run every planned attempt even after one scores 1 (by default the first to score 1 cancels "
             "its running siblings)")
    add("--parallel", type=int, metavar="N",
        help="attempts at once: a round's branches in threads here, or jobs submitted at once to a Run Store "
             "(default: the round's branch count; restarts: the largest --branches value, in waves); here, "
             "at most the host's slots ($SPROUT_HOST_SLOTS), shared by every evaluation and gate on the host")
    add("--budget-by", choices=["turns", "tokens"], default="turns",
        help="what the restarts baseline's equal budget counts (default turns): limit x (1 + sum(branches))")
    add("--step-limit", type=int, default=DEFAULTS["step_limit"],
        help=f"turns per attempt (a branch of turn k gets step-limit - k more; default {defaults.STEP_LIMIT})")
    add("--token-limit", type=int, default=DEFAULTS["token_limit"],
        help=f"agent tokens per attempt (default {defaults.TOKEN_LIMIT:,})")
    add("--wall-time-limit", type=int,
        help=f"seconds per attempt (default: the task's [agent].timeout_sec, else {defaults.WALL_TIME_S})")
    add("--command-timeout", type=int, default=DEFAULTS["command_timeout"],
        help=f"seconds per agent command (default {defaults.COMMAND_TIMEOUT_S})")
    add("--model-retries", type=int, default=DEFAULTS["model_retries"],
        help="tries per agent model call, with backoff on 429/5xx (default 4)")
    add("--seed", type=int, default=DEFAULTS["seed"], help="sampling seed sent to the reviewer (default 0)")
    add("--runtime-bin", type=Path,
        help="run commands through this sprout-runtime (default: $SPROUT_RUNTIME_BIN, else podman exec)")
    add("--store", type=Path, help="btrfs store (default: $SPROUT_STORE or ~/sprout-btrfs)")
    add("--backend", choices=backends.names(), default=backends.DEFAULT, help=backends.help_text())
    add("--pull", choices=PULL_POLICIES, default=None, help=PULL_HELP)
    add("--keep-checkpoints", action="store_true",
        help="keep the attempts' checkpoints after a finished evaluation (to branch from them later)")
    add("--allow-dirty", action="store_true",
        help="run from a checkout with uncommitted changes (development; recorded in the summary)")
    add("--overwrite", action="store_true",
        help="start afresh: remove what --output holds (and its checkpoints) instead of resuming or refusing")
    add("--affinity-timeout", type=float, default=60.0,
        help="over a Run Store: seconds a branch or grade waits for the host holding its checkpoint before "
             "any worker takes it and ships the checkpoint (default 60)")
    add("--quiet", action="store_true", help="no per-turn lines")
    return actions


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sprout.eval.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=["sprout", "restarts", "single"], default="sprout",
                   help="sprout: review and branch rounds (default); restarts: fresh attempts at equal budget; "
                        "single: one attempt")
    add_arguments(p)
    return p


def check_rounds(rounds: int, branches: list[int]) -> None:
    if rounds < 1:
        raise SproutError(f"--rounds must be at least 1, got {rounds}")
    if len(branches) != rounds:
        raise SproutError(f"--rounds {rounds} needs {rounds} --branches value{'s' if rounds > 1 else ''} (one per "
                          f"round), got {len(branches)}: {' '.join(map(str, branches))}")
    if any(b < 1 for b in branches):
        raise SproutError(f"every --branches value must be at least 1, got {' '.join(map(str, branches))}")


def check_parallel(parallel: int | None) -> None:
    if parallel is not None and parallel < 1:
        raise SproutError(f"--parallel must be at least 1, got {parallel}")


def endpoints(args: argparse.Namespace, *, remote: bool, review: bool = True) -> tuple[Endpoint, Endpoint | None]:
    """The agent's and (with `review`) the reviewer's endpoints. In-process: URLs with keys from this
    environment. Over a Run Store: a name configured on the workers (their URL and key) or a plain URL
    (called with no key)."""
    if not remote:
        for flag in ("model", "review"):
            if getattr(args, f"{flag}_endpoint_name"):
                raise SproutError(f"--{flag}-endpoint-name names an endpoint of a Run Store's workers; without "
                                  f"SPROUT_RUNSTORE_URL and SPROUT_RUNSTORE_TOKEN pass --{flag}-endpoint URL "
                                  f"(and --{flag}-key-env VAR)")
        endpoint = Endpoint.resolve(args.model_endpoint, args.model_key_env)
        return endpoint, (Endpoint.resolve(args.review_endpoint or endpoint.url, args.review_key_env or endpoint.key_env)
                          if review else None)
    endpoint = remote_endpoint(args, "model") or Endpoint("", None, name="default")
    return endpoint, (remote_endpoint(args, "review") or endpoint) if review else None


def remote_endpoint(args: argparse.Namespace, flag: str) -> Endpoint | None:
    """--{flag}-endpoint-name or --{flag}-endpoint over a Run Store (None: neither given)."""
    url, name = getattr(args, f"{flag}_endpoint"), getattr(args, f"{flag}_endpoint_name")
    if getattr(args, f"{flag}_key_env"):
        raise SproutError(f"--{flag}-key-env does not apply over a Run Store: workers call with the keys of their "
                          f"own configured endpoints; name one with --{flag}-endpoint-name NAME, or pass "
                          f"--{flag}-endpoint URL alone for an endpoint that needs no key")
    if url and name:
        raise SproutError(f"pass --{flag}-endpoint URL or --{flag}-endpoint-name NAME, not both")
    if name:
        try:
            return Endpoint("", None, name=check_name(name))
        except ValueError as e:
            raise SproutError(f"--{flag}-endpoint-name: {e}") from None
    return Endpoint(Endpoint.resolve(url, None, require_key=False).url, None) if url else None


def evaluate(args: argparse.Namespace) -> EvaluationSummary:
    """Runs (or resumes) one evaluation as the flags say; returns its summary (also in summary.json)."""
    check_rounds(args.rounds, args.branches)
    check_parallel(args.parallel)
    source = check_source(args.allow_dirty)
    pinning = check_pinning(args.task_dir, args.dataset_digest, args.preparation_manifest)
    task = load_task(args.task_dir)
    client = configured_client()  # a Run Store: its workers make the model calls, with their keys
    endpoint, review_endpoint = endpoints(args, remote=client is not None, review=args.method == "sprout")
    os.environ["MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT"] = str(max(1, args.model_retries))
    wall_time = args.wall_time_limit or int(task.config.agent.timeout_sec or defaults.WALL_TIME_S)
    budget = equal_budget(args.method, args.budget_by, args.step_limit, args.token_limit, args.branches)
    config = EvaluationConfig(
        task=pinning.task, task_digest=pinning.task_digest, dataset_digest=pinning.dataset_digest,
        method=args.method, rounds=args.rounds, branches=args.branches, early_stop=args.early_stop, budget=budget,
        model=args.model, model_class=args.model_class,
        review_model=(args.review_model or args.model) if args.method == "sprout" else None,
        step_limit=args.step_limit, token_limit=args.token_limit, wall_time_s=wall_time,
        command_timeout_s=args.command_timeout, review_retries=args.review_retries, seed=args.seed,
        commit=source.commit, wave=_wave(args.method, args.branches, args.parallel))
    config, args.parallel = _recorded_wave(args.output, config, args.parallel)
    store = Store(args.store, runtime_bin=args.runtime_bin, backend=args.backend)
    previous = _open_output(args.output, config, store, overwrite=args.overwrite)
    if previous is not None and previous.status in ("solved", "unsolved"):
        console.print(f"{args.output}: already finished ({previous.status}); nothing to do")
        return previous
    args.output.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]{pinning.task}[/bold] · {args.method} · model {args.model} @ {endpoint.host} · "
                  f"budget {budget.rule} · output {args.output}", markup=True)
    if source.dirty:
        errors.print(f"warning: running from a checkout with uncommitted changes (--allow-dirty): "
                     f"{len(source.changes)} changed path(s), recorded in the summary")
    image = ensure_image(store, task.paths.environment_dir, task.config.environment, name=pinning.task,
                         log_path=args.output / "image-build.log", pull=args.pull)
    if image.warning:
        errors.print(f"warning: {image.warning}")
    prepared = pinning.prepared_image
    if prepared is not None and prepared.image_id != image.image.image_id:
        errors.print(f"warning: the task's image is {image.image.image_id}, not {prepared.image_id} as prepared "
                     "(rebuilt since); both are recorded")
    summary = EvaluationSummary(
        config=config, config_hash=config.digest(), pinning=pinning, source=source,
        image=ImageInfo(reference=image.reference, image_id=image.image.image_id, key=image.image.key,
                        prepared=prepared, source=image.source, warning=image.warning),
        host_trust=trust.host_trust().enabled,
        endpoint_host=endpoint.host, review_endpoint_host=review_endpoint.host if review_endpoint else None)
    if previous is not None:
        summary.started, summary.wall_s, summary.sessions = previous.started, previous.wall_s, previous.sessions + 1
    session_start = time.monotonic()
    base_wall = summary.wall_s

    def save() -> None:
        summary.attempts, summary.reviews = list(executor.attempts), list(executor.reviews)
        summary.refresh()
        summary.wall_s = round(base_wall + time.monotonic() - session_start, 3)
        write_summary(args.output, summary)

    if client is None:
        jobs = LocalJobs(store, task, image.image)
        _note_slots(args.parallel or max(args.branches))
    else:
        group_id = f"eval-{pinning.task}-{uuid.uuid4().hex[:8]}"
        jobs = RunStoreJobs(client, task_dir=args.task_dir, group_id=group_id,
                                  affinity_timeout_s=args.affinity_timeout, backend=args.backend)
        summary.runstore = client.url
        console.print(f"  running as Run Store jobs at {client.url} (group {jobs.group_id})", markup=False)
    reviewer = Reviewer(ReviewerConfig(model=config.review_model, retries=args.review_retries, seed=args.seed),
                        review_endpoint) if review_endpoint else None
    executor = TaskExecutor(
        store=store, jobs=jobs, task=task, image=image, reviewer=reviewer, out=args.output,
        agent=AgentConfig(model=args.model, endpoint=endpoint, model_class=args.model_class, wall_time_s=wall_time,
                          command_timeout_s=args.command_timeout),
        recorded_attempts=previous.attempts if previous else (), recorded_reviews=previous.reviews if previous else (),
        on_record=save, on_turn=None if args.quiet else _print_turn, log=lambda text: console.print(text, markup=False))
    save()
    method = MethodConfig(method=args.method, branches=args.branches, early_stop=args.early_stop,
                          step_limit=args.step_limit, token_limit=args.token_limit, budget=budget,
                          parallel=args.parallel)
    try:
        result = run_method(method, executor)
    except KeyboardInterrupt:
        summary.status = "interrupted"
        save()
        raise
    except SproutError as e:
        summary.status, summary.error = "error", str(e)
        save()
        raise
    summary.status = "solved" if result.solved_by else "unsolved"
    summary.finished = now()
    save()
    if not args.keep_checkpoints:
        release(store, [args.output / a.journal for a in summary.attempts if not a.cancelled])
    colour = "green" if result.solved_by else "yellow"
    console.print(f"[{colour}]{summary.status}[/{colour}]" + (f" by {summary.solved_by}" if summary.solved_by else "")
                  + f" · {summary.totals.attempts} attempts · {summary.totals.turns} turns · "
                  f"{summary.totals.tokens_in + summary.totals.tokens_out:,} agent tokens"
                  + (f" + {summary.totals.review_tokens:,} review" if summary.reviews else "")
                  + f" · {summary.wall_s:.1f}s", markup=True)
    console.print(f"  view: python -m ops.report task {args.output}", markup=False)
    return summary


def _wave(method: str, branches: list[int], parallel: int | None) -> int | None:
    """The restarts' wave size when it is not 1 (it decides their plans, so it is part of the run); None
    otherwise, so that sequential runs keep their configuration hash."""
    wave = wave_size(method, branches, parallel)
    return wave if wave and wave > 1 else None


def _note_slots(wanted: int) -> None:
    slots = host_slot_count()
    if wanted > slots:
        console.print(f"  note: {wanted} attempts at once asked; this host runs at most {slots} at once, shared "
                      f"with its other evaluations and gates (${SLOTS_ENV})", markup=False)


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


def _print_turn(attempt_id: str, event: TurnEvent) -> None:
    turn = event.turn
    command = (turn.commands[0] if turn.commands else "(no command)").replace("\n", " ")
    console.print(f"  {attempt_id:<6} turn {turn.turn:>3}  rc={'-' if turn.exit_code is None else turn.exit_code:<3} "
                  f"{command[:90]}", markup=False, style="dim")


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    summary = evaluate(args)
    return 1 if summary.status == "error" else 0


if __name__ == "__main__":
    run_cli(main)
