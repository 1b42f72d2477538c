"""`sprout rl-driver`: serve Miles rollout groups; write Miles' prompt file for a task directory.

`serve` answers POST/GET/DELETE /rollout-groups (the contract of Miles' `miles/rollout/sprout` rollout
function). Each sample runs as a Run Store job when SPROUT_RUNSTORE_URL and SPROUT_RUNSTORE_TOKEN are
set (start workers next to it: `sprout services up`), else in --local-slots slots here.
Callers must send `Authorization: Bearer $SPROUT_RL_DRIVER_TOKEN` when that variable is set.
`prepare` builds every task's image (as `sprout prepare` does) and writes one Miles prompt line per
runnable task: {"prompt": [{"role": "user", "content": <instruction>}], "metadata": {"task_id", "image"}};
with --hosts it also imports the images on the Run Store's worker hosts (one prepare job per host).
"""

import argparse
import json
import logging
from pathlib import Path

from ..console import console, errors
from ..errors import SproutError
from . import flags

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def cmd_serve(args) -> int:
    import uvicorn

    from ..rl_driver.app import create_app
    from ..rl_driver.config import load_config

    config = load_config(args.config)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("tasks_dir", args.tasks_dir),
                                   ("runtime_bin", args.runtime_bin), ("backend", args.backend),
                                   ("local_slots", args.local_slots), ("abandon_after_s", args.abandon_after),
                                   ("data_dir", args.data_dir), ("ledger", args.ledger)) if v is not None}
    config = config.model_validate(config.model_dump() | overrides)
    if config.tasks_dir is not None and not config.tasks_dir.is_dir():
        raise SproutError(f"--tasks-dir {config.tasks_dir} is not a directory")
    if config.tasks_dir is None and not config.miles.tasks:
        raise SproutError("no tasks to serve: pass --tasks-dir DIR, or list tasks in --config")
    if not config.driver_token() and config.host not in LOOPBACK:
        raise SproutError(f"refusing to serve on {config.host} without a token: anyone who reaches it could run "
                          f"samples (and be sent the policy key); set ${config.driver_token_env or 'SPROUT_RL_DRIVER_TOKEN'} "
                          "(with driver_token_env naming it in --config) or listen on 127.0.0.1")
    runstore = config.runstore()
    where = f"Run Store {runstore[0]}" if runstore else f"{config.local_slots} local slots"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    console.print(f"RL driver on http://{config.host}:{config.port}: samples on {where}; "
                  f"ledger {config.ledger_url.split('@')[-1]}; auth "
                  f"{'bearer $' + str(config.driver_token_env) if config.driver_token() else 'off'}")
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="warning")
    return 0


def cmd_prepare(args) -> int:
    from ..eval.gate import describe_exclusion, flaky_exclusion
    from ..eval.prepare import prepare
    from ..sandbox import Store
    from ..tasks import load_task

    manifest_path = args.manifest or args.output.with_suffix(".prep.json")
    exclusion = flaky_exclusion(args.exclude_flaky) if args.exclude_flaky else None
    manifest = prepare(args.tasks_dir, manifest_path, store=Store(args.store), pull=args.pull, exclude_flaky=exclusion)
    if exclusion:
        console.print(describe_exclusion(exclusion), markup=False)
    lines = []
    for task in manifest.tasks:
        if task.problem or task.image is None:
            errors.print(f"skipped: {task.problem}")
            continue
        instruction = load_task(Path(args.tasks_dir) / task.name).instruction
        lines.append(json.dumps({"prompt": [{"role": "user", "content": instruction}],
                                 "metadata": {"task_id": task.name, "image": task.image.reference}}))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(line + "\n" for line in lines))
    console.print(f"wrote {len(lines)} of {len(manifest.tasks)} tasks to {args.output} "
                  f"(preparation manifest {manifest_path})")
    runnable = [Path(args.tasks_dir) / t.name for t in manifest.tasks if not t.problem and t.image is not None]
    if args.hosts is not None and runnable:
        return 0 if _prepare_hosts(runnable, args.hosts, args.pull) and lines else 1
    return 0 if lines else 1


def _prepare_hosts(tasks: list[Path], hosts: list[str], pull) -> bool:
    """Sends the tasks' images to `hosts` (every live worker host when empty); whether all are ready."""
    import time

    from ..jobs.hosts import prepare_hosts
    from ..jobs.remote import configured_client

    client = configured_client()
    if client is None:
        raise SproutError("--hosts prepares the workers of a Run Store: set SPROUT_RUNSTORE_URL and "
                          "SPROUT_RUNSTORE_TOKEN (`eval $(sprout services env)`)")
    started = time.monotonic()
    console.print(f"preparing {len(tasks)} task image(s) on {', '.join(hosts) or 'every live worker host'}")

    def report(result) -> None:
        console.print(f"  {result.host}: {len(result.ready)} ready, {len(result.failed)} failed "
                      f"({time.monotonic() - started:.1f}s)", markup=False)
        for task, problem in result.failed.items():
            errors.print(f"    {Path(task).name}: {problem}")

    with client:
        results = prepare_hosts(client, tasks, hosts=hosts, pull=pull, on_host=report)
    return all(not r.failed for r in results)


def add(sub: argparse._SubParsersAction) -> None:
    from ..rl_driver.config import DEFAULT_PORT

    group = sub.add_parser("rl-driver", help="serve Miles' rollout groups; write Miles' prompt file",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = group.add_subparsers(dest="rl_command", required=True, metavar="COMMAND")
    s = commands.add_parser("serve", help="serve /rollout-groups")
    s.add_argument("--config", type=Path, help="driver config (JSON; sprout.rl_driver.config)")
    s.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, help=f"port (default {DEFAULT_PORT})")
    s.add_argument("--tasks-dir", type=Path, help="Harbor task directories; a task_id is a directory name")
    flags.add(s, "runtime_bin")
    flags.add(s, "backend", default=None)
    s.add_argument("--local-slots", type=int, help="samples run at once here, without a Run Store (default 4)")
    s.add_argument("--data-dir", type=Path, help="journals and verifier files (default ~/.local/share/sprout/rl-driver)")
    s.add_argument("--ledger", help="the ledger: a SQLite file or a database URL (default DATA_DIR/driver.sqlite3)")
    s.add_argument("--abandon-after", type=float, metavar="SECONDS",
                   help="cancel a running group no client has polled (POST or GET) for this long, stopping its "
                        "samples and releasing their checkpoints (default 120; Miles polls every 2 s)")
    s.set_defaults(func=cmd_serve)
    s = commands.add_parser("prepare", help="build task images and write Miles' prompt file (JSONL)")
    flags.add(s, "tasks_dir")
    flags.output(s, "the prompt file to write (miles.jsonl)")
    s.add_argument("--manifest", type=Path, help="the preparation manifest (default OUTPUT with .prep.json)")
    flags.add(s, "exclude_flaky", "pull", "store")
    s.add_argument("--hosts", nargs="*", metavar="HOST", help=(
        "also import the images on these worker hosts of the Run Store (no names: every live host), one "
        "prepare job each, so no sample pays a pull or import; exit 1 if any host failed"))
    s.set_defaults(func=cmd_prepare)
