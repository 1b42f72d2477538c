"""`sprout doctor`: one line per check of this host (and of the services it is configured to run), each
saying what to do when it fails; exit 1 when any fails."""

import argparse
import json

from ..console import console
from ..sandbox import backends
from . import flags


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..services.supervisor import proxy_check
    from ..worker import doctor

    checks = doctor.run_checks(args.store, args.runtime_bin, args.backend)
    if (proxy := proxy_check()) is not None:
        checks.append(proxy)
    if args.json:
        print(json.dumps(doctor.as_json(checks), indent=2))
    else:
        for check in checks:
            mark = "[green]PASS[/green]" if check.ok else "[red]FAIL[/red]"
            console.print(f"{mark}  {check.name:<12} {check.detail}", markup=True, soft_wrap=True)
    return 0 if all(c.ok for c in checks) else 1


def add(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("doctor", help="check this host: btrfs store, podman, rlimits, images, runtime, a smoke test",
                       description=__doc__)
    flags.add(s, "store", "runtime_bin")
    flags.add(s, "backend", help=f"check this backend too ({', '.join(backends.names())}); microvm adds the "
                                 "accelerator (KVM, else TCG), QEMU, the guest kernel and a VM smoke test")
    flags.add(s, "json")
    s.set_defaults(func=cmd_doctor)
