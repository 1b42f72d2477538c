"""`doctor --backend microvm`: the accelerator, QEMU, the guest kernel, and a VM booted as a smoke test."""

import shutil
import subprocess
import time

from ..sandbox import Store
from ..sandbox.errors import SproutError
from ..sandbox.images import RECIPES
from ..sandbox.microvm.backend import accelerator
from ..sandbox.microvm.guest import guest_kernel
from ..sandbox.microvm.vm import QEMU
from .doctor import Check


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


def _smoke(store: Store) -> Check:
    """Boots a VM, runs a command, checkpoints it with its memory, resumes a branch; each step timed."""
    timings, sandboxes, checkpoint = {}, [], None

    def timed(name, fn):
        started = time.perf_counter()
        value = fn()
        timings[name] = (time.perf_counter() - started) * 1000
        return value

    try:
        image = store.image(RECIPES[-1].tags[0])
        vm = timed("boot", lambda: store.create_sandbox(image, backend="microvm", memory="512m", label="doctor"))
        sandboxes.append(vm)
        result = timed("exec", lambda: vm.exec("echo sprout > /tmp/doctor && cat /tmp/doctor"))
        if result.output.strip() != "sprout":
            return Check("microvm smoke", False, f"exec gave exit {result.exit_code}: {result.output[:200]}")
        checkpoint = timed("checkpoint", lambda: vm.checkpoint(label="doctor", memory=True))
        branch = timed("branch", checkpoint.branch)
        sandboxes.append(branch)
        seen = branch.exec("cat /tmp/doctor").output.strip()
        if seen != "sprout":
            return Check("microvm smoke", False, f"the branch does not see the checkpoint's file (got {seen!r})")
    except SproutError as e:
        return Check("microvm smoke", False, str(e))
    finally:
        for sandbox in sandboxes:
            sandbox.destroy()
        if checkpoint is not None:
            store.remove_checkpoint(checkpoint.id, force=True)
    accel = accelerator()[0]
    return Check("microvm smoke", True, f"{accel}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in timings.items()))


def microvm_checks(store: Store | None, ready: bool) -> list[Check]:
    checks = [_accelerator(), _qemu(), _kernel()]
    if store is None or not ready or not all(c.ok for c in checks):
        return checks + [Check("microvm smoke", False, "skipped: fix the failures above first")]
    return checks + [_smoke(store)]
