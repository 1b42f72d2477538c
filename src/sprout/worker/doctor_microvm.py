"""`doctor --backend microvm`: the accelerator, QEMU, the guest kernel, and a VM booted as a smoke test."""

import shutil
import subprocess

from ..errors import SproutError
from ..sandbox import Store
from ..sandbox.microvm.backend import accelerator
from ..sandbox.microvm.guest import guest_kernel
from ..sandbox.microvm.vm import QEMU
from .doctor import Check, round_trip


def _accelerator() -> Check:
    accel, why = accelerator()
    return Check("kvm", True, f"{accel}: {why}" + ("" if accel == "kvm" else
                                                      " (boots and commands run several times slower)"))


def _qemu() -> Check:
    if shutil.which(QEMU) is None:
        return Check("qemu", False, f"{QEMU} is not installed (ops/setup_podman.sh installs qemu-system-x86)")
    version = subprocess.run([QEMU, "--version"], capture_output=True, text=True).stdout.splitlines()
    return Check("qemu", True, version[0] if version else QEMU)


def _kernel() -> Check:
    try:
        kernel, modules = guest_kernel()
    except SproutError as e:
        return Check("guest kernel", False, str(e))
    return Check("guest kernel", True, f"{kernel} with modules {modules}")


def microvm_checks(store: Store | None, ready: bool) -> list[Check]:
    checks = [_accelerator(), _qemu(), _kernel()]
    if store is None or not ready or not all(c.ok for c in checks):
        return checks + [Check("microvm smoke", False, "skipped: fix the failures above first")]
    # boots a VM, checkpoints it with its memory and resumes a branch of it
    return checks + [round_trip("microvm smoke", store, accelerator()[0], first="boot", save_memory=True,
                                backend="microvm", memory="512m")]
