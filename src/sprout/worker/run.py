"""`python -m sprout.worker run`: one agent rollout with a checkpoint and a journal line per turn."""

import os
from pathlib import Path

from rich.markup import escape

from ..agent import defaults
from ..console import console
from ..sandbox import Store, backends


def add_parser(sub) -> None:
    s = sub.add_parser("run", help="run the agent on a task in a sandbox, checkpointing every turn",
                       description=(
        "Runs mini-swe-agent (unmodified) on TASK inside a fresh sandbox of --sandbox-image, checkpoints "
        "the sandbox after every turn and journals each turn to --journal (JSONL). With --from/--turn it "
        "branches: a new sandbox from that turn's checkpoint, the agent resumed with the messages up to "
        "that turn (plus --note). The model is any OpenAI-compatible endpoint: OPENAI_BASE_URL and "
        "OPENAI_API_KEY, or --model-endpoint and --model-key-env."))
    s.add_argument("task", nargs="?", help="the task text (taken from the parent journal with --from)")
    s.add_argument("--model", required=True, help="model name as the endpoint serves it")
    s.add_argument("--model-endpoint", help="base URL of the Chat Completions API (default: $OPENAI_BASE_URL)")
    s.add_argument("--model-key-env", help="name of the variable holding the API key (default OPENAI_API_KEY)")
    s.add_argument("--model-class", choices=["tools", "text"], default="tools",
                   help="tools: tool calls with mini.yaml (default); text: ```mswea_bash_command blocks, "
                        "for endpoints without tool support")
    s.add_argument("--runtime-bin", type=Path, help="run commands through this sprout-runtime "
                   "(default: $SPROUT_RUNTIME_BIN, else podman exec)")
    s.add_argument("--sandbox-image", default=defaults.IMAGE, help=f"image of the sandbox (default {defaults.IMAGE})")
    s.add_argument("--backend", choices=backends.names(), default=backends.DEFAULT, help=backends.help_text())
    s.add_argument("--cwd", default="/tmp", help="directory the agent's commands start in (default /tmp)")
    s.add_argument("--journal", type=Path, required=True, help="journal to write (JSONL; must not exist)")
    s.add_argument("--store", type=Path, help="btrfs store (default: $SPROUT_STORE or ~/sprout-btrfs)")
    s.add_argument("--step-limit", type=int, default=defaults.STEP_LIMIT,
                   help=f"max model calls (default {defaults.STEP_LIMIT})")
    s.add_argument("--token-limit", type=int, default=defaults.TOKEN_LIMIT,
                   help=f"max prompt+completion tokens (default {defaults.TOKEN_LIMIT:,}; 0 = none)")
    s.add_argument("--wall-time-limit", type=int, default=defaults.WALL_TIME_S,
                   help=f"seconds (default {defaults.WALL_TIME_S})")
    s.add_argument("--command-timeout", type=int, default=defaults.COMMAND_TIMEOUT_S,
                   help=f"seconds per command; on timeout its process tree is killed (default {defaults.COMMAND_TIMEOUT_S})")
    s.add_argument("--model-retries", type=int, default=4,
                   help="attempts per model call, with exponential backoff on 429/5xx/timeouts (default 4)")
    s.add_argument("--keep-sandbox", action="store_true", help="leave the sandbox running at the end")
    s.add_argument("--from", dest="from_journal", type=Path, help="branch from this journal ...")
    s.add_argument("--turn", type=int, help="... at this turn's checkpoint")
    s.add_argument("--note", help="a user message added before the agent continues (with --from)")
    s.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    from ..errors import SproutError

    os.environ["MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT"] = str(max(1, args.model_retries))
    try:
        from ..agent.journal import read_journal
        from ..agent.models import Endpoint
        from ..agent.runner import RolloutSpec, run_rollout
    except ImportError as e:  # doctor works without the agent's packages; run does not
        raise SproutError(f"`run` needs mini-swe-agent: pip install -e '.[mini]' ({e})") from None

    if (args.from_journal is None) != (args.turn is None):
        raise SproutError("--from and --turn go together")
    if args.from_journal is None and not args.task:
        raise SproutError("give the TASK text (or --from JOURNAL --turn K to branch)")
    if args.note and args.from_journal is None:
        raise SproutError("--note needs --from and --turn")
    if args.from_journal is not None:
        read_journal(args.from_journal)  # a directory or a binary file: one error line before any sandbox work
    endpoint = Endpoint.resolve(args.model_endpoint, args.model_key_env)
    store = Store(args.store, runtime_bin=args.runtime_bin, backend=args.backend)
    spec = RolloutSpec(task=args.task or "", model=args.model, endpoint=endpoint, journal=args.journal,
                       image=args.sandbox_image, cwd=args.cwd, model_class=args.model_class,
                       step_limit=args.step_limit, token_limit=args.token_limit, wall_time_s=args.wall_time_limit,
                       command_timeout_s=args.command_timeout, keep_sandbox=args.keep_sandbox,
                       from_journal=args.from_journal, from_turn=args.turn, note=args.note)
    where = f"branch of {args.from_journal} at turn {args.turn}" if args.from_journal else spec.image
    console.print("[bold]sprout run[/bold]  " + escape(f"model {spec.model} @ {endpoint.host}  sandbox {where}  "
                                                      f"journal {spec.journal}"), markup=True)

    def on_event(event) -> None:
        turn = event.turn
        command = (turn.commands[0] if turn.commands else "(no command)").replace("\n", " ")
        console.print(f"  turn {turn.turn:>3}  rc={turn.exit_code if turn.exit_code is not None else '-':<3} "
                      f"model {turn.model_latency_s:5.2f}s  cmd {turn.command_s:5.2f}s  ckpt {turn.checkpoint_ms:5.1f}ms  "
                      f"{turn.checkpoint}  {command[:70]}", markup=False)

    result = run_rollout(spec, store, on_event=on_event)
    outcome = result.outcome
    colour = {"submitted": "green", "limits_exceeded": "yellow", "error": "red"}[outcome.status]
    console.print(f"[{colour}]{outcome.status}[/{colour}] ({outcome.exit_status}) after {outcome.turns} turns, "
                  f"{outcome.tokens_in + outcome.tokens_out:,} tokens ({outcome.tokens_in:,} in / "
                  f"{outcome.tokens_out:,} out), {outcome.wall_s:.1f}s", markup=True)
    if outcome.message:
        console.print(f"  {outcome.message}", markup=False)
    if outcome.final_checkpoint:
        console.print(f"  final checkpoint {outcome.final_checkpoint}")
    console.print(f"  inspect: python -m ops.report snapshots {spec.journal}\n"
                  f"  branch:  python -m sprout.worker run --model {spec.model} --from {spec.journal} --turn K "
                  f"--journal BRANCH.jsonl", markup=False)
    return 1 if outcome.status == "error" else 0


