"""`sprout worker serve`: claim and run Run Store jobs on this host."""

import argparse
import logging
import socket
import sys
from pathlib import Path

from ..errors import UsageError
from ..settings import settings
from . import flags


def cmd_serve(args: argparse.Namespace) -> int:
    from ..worker.serve import WorkerConfig, serve

    url = args.runstore_url or settings().runstore_url
    token = args.token_file.read_text().strip() if args.token_file else settings().runstore_token
    if not url or not token:
        raise UsageError('no Run Store: pass --url and --token-file, or eval "$(sprout services env)"')
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    serve(flags.build(WorkerConfig, url=url, token=token, host_id=args.host_id, slots=args.slots, kinds=flags.flatten(args.kinds),
                       lease_s=args.lease, drain_timeout_s=args.drain_timeout, alive_file=args.alive_file,
                       ship_listen=args.ship_listen, ship_advertise=args.ship_advertise))
    return 0


SERVE_HELP = """Claims Run Store jobs for this host and its capacity, runs them, heartbeats, reports.

On start it reaps what a killed worker left on this host (sandboxes and checkpoints whose owner process
is gone). On SIGTERM it drains: claims nothing more, lets running jobs finish for up to --drain-timeout
seconds, then stops the ones still running (a rollout stops between turns, its sandbox and half journal
discarded) and only then releases their leases, so other workers take them at once and never run a job
while it still runs here. A job that is cancelled or whose lease is lost (seen by the next heartbeat:
every lease/6 seconds, at most 2 s apart) is stopped the same way. Connection errors (an API restart) are
retried: claims by the loop, heartbeats and results by the client. With --ship-listen it serves this
host's checkpoints to other workers; a job claimed here whose checkpoint is on another host (claimed past
its affinity timeout) has that checkpoint shipped here first (sprout.worker.shipping).
"""


def add(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("worker", help="a Run Store worker on this host")
    commands = group.add_subparsers(dest="worker_command", required=True, metavar="COMMAND")
    s = commands.add_parser("serve", help="claim and run Run Store jobs (rollout, grade, swe-grade, review, gate)",
                            description=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add(s, "runstore_url", "token_file")
    s.add_argument("--host-id", default=socket.gethostname(), metavar="NAME",
                   help="this host's name, for job affinity (default: the hostname)")
    s.add_argument("--slots", type=int, default=1, help="jobs run at once (default 1)")
    s.add_argument("--kinds", type=flags.names_list, nargs="+", metavar="KIND",
                   help="the job kinds to take (default: every kind this worker runs)")
    s.add_argument("--lease", type=float, default=120.0, metavar="SECONDS",
                   help="lease seconds, renewed by heartbeats (default 120)")
    s.add_argument("--drain-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="on SIGTERM, how long running jobs may finish before they are stopped and released (default 600)")
    s.add_argument("--alive-file", type=Path, metavar="PATH", help="touched on every claim loop (`services status`)")
    s.add_argument("--ship-listen", metavar="ADDR:PORT", help=(
        "serve this host's checkpoints to other hosts' workers there (e.g. 0.0.0.0:8471; port 0: any free port); "
        "without it, jobs whose checkpoint is here cannot move elsewhere"))
    s.add_argument("--ship-advertise", metavar="URL",
                   help="the URL other hosts reach that server at (default http://ADDR:PORT, or this host's name)")
    s.set_defaults(func=cmd_serve)
