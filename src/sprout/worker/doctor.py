"""Host checks for `sprout doctor`: one line per check, each saying what to do when it fails."""

import hashlib
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from .. import rootless
from ..checkout import RUNTIME_LAUNCHER, RUNTIME_SOURCE
from ..errors import SproutError
from ..sandbox import Store, backends, btrfs, podman, shell, trust
from ..sandbox.backends import Check
from ..sandbox.images import RECIPES, stand_ins_in_podman
from ..settings import settings

MIN_FREE_BYTES = 5 << 30
DEFAULT_RUNTIME = RUNTIME_LAUNCHER


def _python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    ok = sys.version_info >= (3, 12)
    return Check("python", ok, version if ok else f"{version}: Sprout needs 3.12+ (run ops/setup_podman.sh)")


def _kernel_btrfs() -> Check:
    if "btrfs" in Path("/proc/filesystems").read_text():
        return Check("kernel btrfs", True, "btrfs in /proc/filesystems")
    shell.run(["modprobe", "btrfs"], check=False)
    ok = "btrfs" in Path("/proc/filesystems").read_text()
    return Check("kernel btrfs", ok, "btrfs module loaded" if ok else "the kernel has no btrfs (modprobe btrfs failed)")


def _store(root: Path | None) -> tuple[Check, Store | None]:
    try:
        store = Store(root)
        probe = store.root / "state" / ".doctor-write-test"
        probe.write_text("ok")
        probe.unlink()
    except (SproutError, OSError) as e:
        return Check("store", False, str(e)), None
    return Check("store", True, f"{store.root} mounted (btrfs) and writable"), store


def _rootless(store: Store | None) -> list[Check]:
    """As a user without root: the user namespace, the store's mount, and each guarantee that differs."""
    if not rootless.active():
        return []
    if not rootless.entered():
        user = f"uid {os.geteuid()}"
        why = ("podman is not installed (run ops/setup_podman.sh)" if shutil.which("podman") is None else
               f"{user} has no subordinate ids in /etc/subuid (ops/setup_podman.sh adds them with sudo)"
               if rootless.subordinate_ids() is None else f"{user} runs outside podman's user namespace "
               "(`podman unshare` failed?)")
        return [Check("rootless", False, why)]
    checks = [Check("rootless", True, f"uid {rootless.user_id()}, in podman's user namespace (subordinate ids "
                                      f"{rootless.subordinate_ids() or '?'}); the store's files keep their owners")]
    if store is not None:
        options = btrfs.mount_options(store.root)
        ok = "user_subvol_rm_allowed" in options
        checks.append(Check("store mount", ok, "user_subvol_rm_allowed: the store's owner deletes subvolumes" if ok
                            else f"{store.root} is mounted without user_subvol_rm_allowed, so sandboxes and "
                                 "checkpoints cannot be deleted (ops/setup_podman.sh mounts it so)"))
    if not rootless.limits_apply():
        checks.append(Check("rootless limits", True, "none: rootless podman on cgroup v1 sets no memory, pids or "
                            "CPU limit, so a sandbox can use what the user can"))
    checks.append(Check("rootless freeze", True, "a checkpoint stops the sandbox's processes with SIGSTOP (there "
                        "is no cgroup freezer of its own) and continues them after; a sandbox's processes are "
                        "those of its PID namespace"))
    checks.append(Check("rootless exec", True, "sprout-runtime loads a sandbox's seccomp filter as compiled "
                        "from runc's state (reading it off the sandbox needs CAP_SYS_ADMIN); a filter it cannot "
                        "reproduce exactly sends that sandbox's commands through `podman exec`"))
    checks.append(Check("rootless diff", True, "checkpoint diffs walk both trees (btrfs send needs root)"))
    return checks


def _free_space(store: Store) -> Check:
    free = shutil.disk_usage(store.root).free
    text = f"{free / 2**30:.1f} GiB free in {store.root}"
    if free >= MIN_FREE_BYTES:
        return Check("free space", True, text)
    hint = ("`sprout sandbox gc --older-than 86400` removes old unused checkpoints and images; "
            "ops/setup_podman.sh grows a loop file")
    return Check("free space", False, f"{text}, under {MIN_FREE_BYTES >> 30} GiB: {hint}")


def _podman() -> Check:
    if shutil.which("podman") is None:
        return Check("podman", False, "podman is not installed (run ops/setup_podman.sh)")
    proc = shell.run([*podman.command(), "info", "--format", "{{.Host.OCIRuntime.Name}} {{.Version.Version}}"],
                     check=False)
    if proc.returncode != 0:
        last = (proc.stderr.decode().strip().splitlines() or ["?"])[-1]
        return Check("podman", False, f"`{' '.join(podman.command()[:3])}` does not run: {last}")
    runtime, version = proc.stdout.decode().split()
    return Check("podman", True, f"podman {version} with runtime {runtime}, cgroup manager "
                                 f"{settings().cgroup_manager}")


def _cgroups() -> Check:
    kind = shell.output(["stat", "-f", "-c", "%T", "/sys/fs/cgroup"])
    if kind == "cgroup2fs":
        mode = "v2 (unified)"
    elif Path("/sys/fs/cgroup/unified").is_dir():
        mode = "v1 hybrid"
    else:
        mode = "v1 legacy"
    config = settings()
    ok = config.oci_runtime != "crun" or kind == "cgroup2fs"
    detail = f"{mode}; Sprout uses {config.oci_runtime} + {config.cgroup_manager}{_favordynmods()}"
    return Check("cgroups", ok, detail if ok else f"{detail}: crun fails on cgroup v1, set SPROUT_OCI_RUNTIME=runc")


def cgroup2_favordynmods() -> bool | None:
    """Whether the cgroup2 mount has favordynmods (None: no cgroup2 mount). With it a command joins its
    sandbox's cgroups without waiting for an RCU grace period; ops/setup_podman.sh turns it on."""
    for point in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (point / "cgroup.controllers").exists():  # the root of the cgroup2 hierarchy
            return "favordynmods" in btrfs.mount_options(point)
    return None


def _favordynmods() -> str:
    """What doctor's cgroups line says of it; nothing rootless, where commands join no cgroups."""
    on = None if rootless.active() else cgroup2_favordynmods()
    if on is None:
        return ""
    if on:
        return "; favordynmods on: commands join their sandbox's cgroups without waiting"
    return ("; favordynmods off: each command waits ~10 ms for an RCU grace period to join its sandbox's "
            "cgroups (ops/setup_podman.sh turns it on until the next boot)")


def _rlimits() -> Check:
    limits = []
    for name, res, flag_value in (("nofile", resource.RLIMIT_NOFILE, podman.NOFILE_WANTED),
                                  ("nproc", resource.RLIMIT_NPROC, podman.NPROC_WANTED)):
        hard = resource.getrlimit(res)[1]
        limits.append(f"{name} hard={'unlimited' if hard == resource.RLIM_INFINITY else hard}")
    flags = " ".join(podman.ulimit_flags()).replace("--ulimit ", "")
    dropin = Path("/etc/containers/containers.conf.d/50-sprout.conf")
    note = "" if dropin.exists() else "; plain `podman run` may still fail with setrlimit (run ops/setup_podman.sh)"
    return Check("rlimits", True, f"{', '.join(limits)}; sandboxes get {flags} (podman's defaults exceed "
                                  f"these hosts' hard limits){note}")


def _host_trust() -> Check:
    """What sandboxes and builds receive of the host's trust; proxy variables by name only (their values
    may hold credentials)."""
    try:
        host = trust.host_trust()
    except trust.HostTrustError as e:
        return Check("host trust", False, str(e))
    if not host.enabled:
        return Check("host trust", True, "off (SPROUT_HOST_TRUST): containers get neither the host's CA "
                                         "bundle nor its proxy variables")
    proxies = (f"proxy variables passed: {', '.join(host.proxy_env)}" if host.proxy_env
               else "no proxy variables set")
    if host.ca_bundle is None:
        looked = ", ".join(["$SSL_CERT_FILE", *trust.HOST_BUNDLES])
        fix = "set SPROUT_HOST_CA_BUNDLE=/path/to/bundle.crt (or SPROUT_HOST_TRUST=0)"
        return Check("host trust", False, f"on, but no CA bundle found ({looked}): {fix}; {proxies}")
    return Check("host trust", True, f"on: CA bundle {host.ca_bundle} (sandboxes: {trust.CONTAINER_BUNDLE}); "
                                     f"{proxies}")


def _base_images(store: Store) -> Check:
    """Each base image is in the store, or in podman (the store imports it when a sandbox first needs it)."""
    missing = []
    for recipe in RECIPES:
        try:
            store.image(recipe.tags[0])
        except SproutError:
            try:
                podman.inspect_image(recipe.tags[0])
            except SproutError:
                missing.append(recipe.tags[0])
    if missing:
        return Check("base images", False, f"missing {', '.join(missing)}: run sprout sandbox images bootstrap")
    names = ", ".join(r.tags[0].removeprefix("docker.io/library/") for r in RECIPES)
    if stand_ins := stand_ins_in_podman():
        shown = ", ".join(name.removeprefix("docker.io/library/") for name in stand_ins)
        return Check("base images", True, f"{names}; offline stand-ins (Debian, not the registry's images) for "
                                          f"{shown}: `sprout sandbox images bootstrap` where a registry is "
                                          "reachable replaces them")
    return Check("base images", True, names)


def _runtime_bin(runtime_bin: Path) -> Check:
    if not runtime_bin.exists():
        return Check("runtime", False, f"{runtime_bin} is missing (ops/setup_podman.sh writes it)")
    if not os.access(runtime_bin, os.X_OK):
        return Check("runtime", False, f"{runtime_bin} is not executable (chmod +x it)")
    compiled_from = runtime_bin.with_name(runtime_bin.name + ".source")  # the set-up script's stamp
    if RUNTIME_SOURCE.exists() and (runtime_bin == RUNTIME_LAUNCHER or compiled_from.exists()):
        source = hashlib.sha256(RUNTIME_SOURCE.read_bytes()).hexdigest()
        if not compiled_from.exists() or compiled_from.read_text().strip() != source:
            return Check("runtime", False, f"{runtime_bin} was not compiled from this checkout's runtime.c "
                                           "(run ops/setup_podman.sh again)")
    return Check("runtime", True, str(runtime_bin))


def _smoke(store: Store, runtime_bin: Path | None) -> Check:
    via = "sprout-runtime" if runtime_bin else "podman exec"
    return round_trip("smoke test", Store(store.root, runtime_bin=runtime_bin), f"exec via {via}")


def round_trip(name: str, store: Store, detail: str, smoke: backends.Smoke = backends.Smoke()) -> Check:
    """Creates a sandbox as `smoke` says, runs a command, checkpoints it (with its memory when asked),
    branches, destroys; reports each step's time."""
    timings: dict[str, float] = {}
    sandboxes, checkpoint = [], None

    def timed(step: str, fn: Callable):
        started = time.perf_counter()
        value = fn()
        timings[step] = (time.perf_counter() - started) * 1000
        return value

    try:
        image = store.resolve_image(RECIPES[-1].tags[0])  # a new store imports it from podman
        sandbox = timed(smoke.first, lambda: store.create_sandbox(image, label="doctor", **smoke.create))
        sandboxes.append(sandbox)
        result = timed("exec", lambda: sandbox.exec("echo sprout > /tmp/doctor && cat /tmp/doctor"))
        if result.exit_code != 0 or result.output.strip() != "sprout":
            return Check(name, False, f"exec gave exit {result.exit_code}: {result.output.strip()[:200]}")
        checkpoint = timed("checkpoint", lambda: sandbox.checkpoint(label="doctor", memory=smoke.save_memory))
        branch = timed("branch", checkpoint.branch)
        sandboxes.append(branch)
        seen = branch.exec("cat /tmp/doctor").output.strip()
        if seen != "sprout":
            return Check(name, False, f"the branch does not see the checkpoint's file (got {seen!r})")
        timed("destroy", lambda: [s.destroy() for s in sandboxes])
        sandboxes.clear()
    except SproutError as e:
        return Check(name, False, str(e))
    finally:
        for s in sandboxes:
            s.destroy()
        if checkpoint is not None:
            store.remove_checkpoint(checkpoint.id, force=True)
    return Check(name, True, f"{detail}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in timings.items()))


def _backend_checks(store: Store | None, backend: backends.SandboxBackend, ready: bool) -> list[Check]:
    """The backend's own checks, then (when everything before passed) a round trip of one of its sandboxes."""
    checks = backend.checks(store)
    smoke = f"{backend.name} smoke"
    if store is None or not ready or not all(c.ok for c in checks):
        return checks + [Check(smoke, False, "skipped: fix the failures above first")]
    return checks + [round_trip(smoke, store, backend.smoke.detail, backend.smoke)]


def run_checks(store_root: Path | None = None, runtime_bin: Path | None = None,
               backend: str = backends.DEFAULT) -> list[Check]:
    """Every check of this host, for containers and, when `backend` names another, that backend too."""
    runtime_bin = runtime_bin or DEFAULT_RUNTIME
    checks = [_python(), _kernel_btrfs()]
    store_check, store = _store(store_root)
    checks.append(store_check)
    checks += [*_rootless(store), _podman(), _cgroups(), _rlimits(), _host_trust(), _runtime_bin(runtime_bin)]
    if store is None:
        checks += [Check(name, False, "skipped: no store") for name in ("free space", "base images", "smoke test")]
    else:
        checks += [_free_space(store), _base_images(store)]
        if all(c.ok for c in checks):
            checks.append(_smoke(store, runtime_bin if os.access(runtime_bin, os.X_OK) else None))
        else:
            checks.append(Check("smoke test", False, "skipped: fix the failures above first"))
    if backend != backends.DEFAULT:
        checks += _backend_checks(store, backends.get(backend), ready=all(c.ok for c in checks))
    return checks


def as_json(checks: list[Check]) -> dict:
    return {"ok": all(c.ok for c in checks), "checks": [asdict(c) for c in checks]}
