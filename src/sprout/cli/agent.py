"""`sprout run` (one agent rollout with a checkpoint and a journal line per turn), `sprout demo` (the same,
driven by a scripted model) and `sprout scripted-model` (that model server, for tests and dry runs)."""

import argparse
import os
from pathlib import Path

from rich.markup import escape

from ..agent import defaults
from ..checkout import RUNTIME_LAUNCHER
from ..console import console
from ..errors import SproutError, UsageError
from . import flags

DEMO_SCRIPT = Path(__file__).resolve().parent.parent / "demo_data" / "fizzbuzz.json"
DEMO_TASK = "write fizzbuzz.py, run it, and check that 15 prints FizzBuzz"


def cmd_run(args: argparse.Namespace) -> int:
    try:
        from ..agent.journal import read_journal
        from ..agent.models import Endpoint
        from ..agent.runner import RolloutSpec, run_rollout
    except ImportError as e:  # doctor works without the agent's packages; run does not
        raise SproutError(f"`run` needs mini-swe-agent: pip install -e '.[mini]' ({e})") from None
    from ..sandbox import Store

    if (args.from_journal is None) != (args.turn is None):
        raise UsageError("--from and --turn go together")
    if args.from_journal is None and not args.task:
        raise UsageError("give the TASK text (or --from JOURNAL --turn K to branch)")
    if args.note and args.from_journal is None:
        raise UsageError("--note needs --from and --turn")
    if args.from_journal is not None:
        read_journal(args.from_journal)  # a directory or a binary file: one error line before any sandbox work
    os.environ["MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT"] = str(max(1, args.model_retries))  # mini-swe-agent's knob
    endpoint = Endpoint.resolve(args.model_endpoint, args.model_key_env)
    store = Store(args.store, runtime_bin=args.runtime_bin, backend=args.backend)
    spec = RolloutSpec(task=args.task or "", model=args.model, endpoint=endpoint, journal=args.journal,
                       image=args.sandbox_image, cwd=args.cwd, model_class=args.model_class,
                       step_limit=args.step_limit, token_limit=args.token_limit,
                       wall_time_s=args.wall_time_limit or defaults.WALL_TIME_S,
                       command_timeout_s=args.command_timeout, keep_sandbox=args.keep_sandbox,
                       from_journal=args.from_journal, from_turn=args.turn, note=args.note)
    where = f"branch of {args.from_journal} at turn {args.turn}" if args.from_journal else spec.image
    console.print("[bold]sprout run[/bold]  " + escape(f"model {spec.model} @ {endpoint.host}  sandbox {where}  "
                                                      f"journal {spec.journal}"), markup=True)
    outcome = run_rollout(spec, store, on_event=_print_turn).outcome
    colour = {"submitted": "green", "limits_exceeded": "yellow", "error": "red"}[outcome.status]
    console.print(f"[{colour}]{outcome.status}[/{colour}] ({outcome.exit_status}) after {outcome.turns} turns, "
                  f"{outcome.tokens_in + outcome.tokens_out:,} tokens ({outcome.tokens_in:,} in / "
                  f"{outcome.tokens_out:,} out), {outcome.wall_s:.1f}s", markup=True)
    if outcome.message:
        console.print(f"  {outcome.message}", markup=False)
    if outcome.final_checkpoint:
        console.print(f"  final checkpoint {outcome.final_checkpoint}")
    console.print(f"  inspect: sprout report snapshots {spec.journal}\n"
                  f"  branch:  sprout run --model {spec.model} --from {spec.journal} --turn K --journal BRANCH.jsonl",
                  markup=False)
    return 1 if outcome.status == "error" else 0


def _print_turn(event) -> None:
    turn = event.turn
    command = (turn.commands[0] if turn.commands else "(no command)").replace("\n", " ")
    console.print(f"  turn {turn.turn:>3}  rc={turn.exit_code if turn.exit_code is not None else '-':<3} "
                  f"model {turn.model_latency_s:5.2f}s  cmd {turn.command_s:5.2f}s  ckpt {turn.checkpoint_ms:5.1f}ms  "
                  f"{turn.checkpoint}  {command[:70]}", markup=False)


def cmd_demo(args: argparse.Namespace) -> int:
    from ..agent.journal import read_journal
    from ..agent.models import Endpoint
    from ..agent.runner import RolloutSpec, run_rollout
    from ..jobs.journals import discard
    from ..report.journal import snapshots_table
    from ..sandbox import Store
    from ..testing.scripted_model import ScriptedModelServer

    store = Store(runtime_bin=args.runtime_bin)
    if args.journal.exists():  # an earlier demo's: its checkpoints go with it
        discard(store, args.journal)
    os.environ.setdefault("SPROUT_DEMO_KEY", "demo")
    with ScriptedModelServer(DEMO_SCRIPT, api_key="demo") as server:
        console.print(f"scripted model server on {server.base_url} ({len(server.remaining)} steps)")
        spec = RolloutSpec(task=DEMO_TASK, model="scripted", endpoint=Endpoint(server.base_url, "SPROUT_DEMO_KEY"),
                           journal=args.journal)
        result = run_rollout(spec, store, on_event=lambda e: console.print(
            f"  turn {e.turn.turn}: {e.turn.commands[:1]} -> checkpoint {e.turn.checkpoint}"))
    console.print(f"{result.outcome.status} after {result.outcome.turns} turns; journal {args.journal}\n")
    console.print(snapshots_table(read_journal(args.journal), str(args.journal)))
    console.print(f"\nnext: sprout report export {args.journal}   |   sprout run --from {args.journal} --turn 1 ...",
                  markup=False)
    return 0 if result.outcome.status == "submitted" else 1


def cmd_scripted_model(args: argparse.Namespace) -> int:
    from ..testing.scripted_model import serve

    return serve(args.script, host=args.host, port=args.port, api_key=args.api_key, record=args.record,
                 delay_s=args.delay)


def add(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("run", help="run the agent on a task in a sandbox, checkpointing every turn", description=(
        "Runs mini-swe-agent (unmodified) on TASK inside a fresh sandbox of --sandbox-image, checkpoints the "
        "sandbox after every turn and journals each turn to --journal (JSONL). With --from/--turn it branches: a "
        "new sandbox from that turn's checkpoint, the agent resumed with the messages up to that turn (plus "
        "--note). The model is any OpenAI-compatible endpoint: OPENAI_BASE_URL and OPENAI_API_KEY, or "
        "--model-endpoint and --model-key-env."))
    s.add_argument("task", nargs="?", help="the task text (taken from the parent journal with --from)")
    flags.add(s, "model", "model_endpoint", "model_key_env", "model_class")
    s.add_argument("--sandbox-image", default=defaults.IMAGE, metavar="IMAGE",
                   help=f"the sandbox's image (default {defaults.IMAGE})")
    s.add_argument("--cwd", default="/tmp", help="the directory the agent's commands start in (default /tmp)")
    s.add_argument("--journal", type=Path, required=True, help="the journal to write (JSONL; must not exist)")
    flags.add(s, "step_limit", "token_limit", "wall_time_limit", "command_timeout", "model_retries")
    s.add_argument("--keep-sandbox", action="store_true", help="leave the sandbox running at the end")
    s.add_argument("--from", dest="from_journal", type=Path, metavar="JOURNAL", help="branch from this journal ...")
    s.add_argument("--turn", type=int, help="... at this turn's checkpoint")
    s.add_argument("--note", help="a user message added before the agent continues (with --from)")
    flags.add(s, "store", "runtime_bin", "backend")
    s.set_defaults(func=cmd_run)


def add_tools(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("demo", help="a dry run: a scripted model drives the fizzbuzz task end to end", description=(
        "Starts the scripted model server (a real OpenAI-compatible HTTP server replaying a fixed script), runs "
        "the fizzbuzz task end to end in a real sandbox with a checkpoint per turn, then prints the journal's "
        "snapshots table: what Sprout does, before you have an endpoint."))
    s.add_argument("--journal", type=Path, default=Path("runs/demo.jsonl"),
                   help="the journal to write (replaced, with its checkpoints, if it exists; default runs/demo.jsonl)")
    flags.add(s, "runtime_bin", default=RUNTIME_LAUNCHER if RUNTIME_LAUNCHER.exists() else None)
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("scripted-model", help="serve a scripted OpenAI-compatible model (tests, dry runs)",
                       description="Serves a script file of answers as a Chat Completions API until interrupted.")
    s.add_argument("--script", type=Path, required=True, help="the JSON script file (sprout.testing.scripted_model)")
    s.add_argument("--port", type=int, default=0, help="port to listen on; 0 (default) picks a free one")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--record", type=Path, help="also append every request it receives to this JSONL file")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (401 otherwise)")
    s.add_argument("--delay", type=float, default=0.0, metavar="SECONDS", help="every answer waits this long")
    s.set_defaults(func=cmd_scripted_model)
