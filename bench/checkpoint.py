"""Checkpoint benchmark: everything measured in one run on this host, reported with ratios.

    .venv/bin/python bench/checkpoint.py [--big-gb 3] [--n 20]
    .venv/bin/python bench/checkpoint.py --backend microvm [--n 10]

Rows: checkpoint p50/p95 (idle and after a 1 MB write) at ~300 MB and ~3 GB, each including the freeze
of the sandbox's processes that makes it point-in-time; the freeze + thaw alone, idle and under a
process writing without pause; a checkpoint under that writer; a checkpoint right after a 256 MB and a
1 GB write (total and frozen window, the writeback inside the freeze as before and ahead of it as now);
the same state saved with `tar` of the rootfs and with `podman commit` of an equivalent image-based
(overlay) container; branch to first command, its start, the destroy after it and the machine's CPU for
the three; command round trip (back to back, and after a 0.3 s pause as an agent's commands come) and
CPU per command via sprout-runtime vs `podman exec`; disk held by 100 checkpoints each after a 1 MiB
edit, as a fraction of the base size.

With `--modes`: root and rootless side by side, each a fresh python:3.11-slim sandbox: `true` round trip,
checkpoint (after a 1 MiB write) and branch -> first command, p50, through sprout-runtime and `podman exec`,
as root and as the user `--rootless-user` names (its own set-up checkout, by default ~USER/sprout, runs the
same measurement; run as a user, the bench measures that user's two modes).

With `--backend microvm`: the container backend and microVMs side by side (create or boot to first
command, checkpoint disk only and disk + memory, branch to first command from a disk or a memory
checkpoint, command round trip), against the published figures of Firecracker, Morph and E2B.
"""

import argparse
import json
import pwd
import resource
import shlex
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from measure import machine_cpu_s
from rich.console import Console
from rich.table import Table

from sprout import rootless
from sprout.sandbox import Store, btrfs, podman, processes
from sprout.sandbox.backends.container import profile_of
from sprout.worker.doctor import cgroup2_favordynmods

REPO = Path(__file__).resolve().parents[1]
IMAGE = "docker.io/library/python:3.11-slim"


def p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def exec_costs(sandbox, n: int = 100) -> tuple[list[float], float]:
    """Round trips of `true` (ms) and the CPU each took in this process and its children (ms per exec)."""
    sandbox.exec("true")

    def cpu_s() -> float:
        return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                       resource.getrusage(resource.RUSAGE_CHILDREN)))

    before = cpu_s()
    times = [timed(lambda: sandbox.exec("true")) for _ in range(n)]
    return times, (cpu_s() - before) * 1000 / n


@contextmanager
def call_times(module, name: str) -> Iterator[list[float]]:
    """Milliseconds of every call of `module.name` meanwhile (the bench looks inside a branch's start)."""
    original, times = getattr(module, name), []

    def timed_call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times.append((time.perf_counter() - started) * 1000)

    setattr(module, name, timed_call)
    try:
        yield times
    finally:
        setattr(module, name, original)


def branch_rows(base, n: int) -> list[tuple[str, str, str]]:
    """Branch -> first command, the branch's start and `podman run` inside it, the destroy and `podman rm`
    inside it (wall p50), and the machine's CPU per branch, first command and destroy (idle and iowait
    left out: podman's conmon and its cleanup run detached)."""
    starts, firsts, destroys = [], [], []
    cpu_before = machine_cpu_s()
    with call_times(podman, "run_container") as runs, call_times(podman, "remove_container") as removes:
        for _ in range(n):
            started = time.perf_counter()
            branch = base.branch()
            branched = time.perf_counter()
            try:
                branch.exec("true")
                firsts.append((time.perf_counter() - started) * 1000)
                starts.append((branched - started) * 1000)
            finally:
                destroys.append(timed(branch.destroy))
    cpu_ms = (machine_cpu_s() - cpu_before) * 1000 / n
    first, run = p(firsts, .5), p(runs, .5)
    return [("branch -> first command (runtime)", f"p50 {first:.0f} ms", "target <= 120 ms"),
            ("  the branch's start: snapshot, `podman run`, exec profile", f"p50 {p(starts, .5):.0f} ms",
             f"{p(starts, .5) / first:.0%} of the branch -> first command"),
            ("  `podman run` inside it (stock podman's start)", f"p50 {run:.0f} ms",
             f"{run / first:.0%}; Sprout's part: {first - run:.0f} ms"),
            ("destroy of a branch: `podman rm`, subvolume delete", f"p50 {p(destroys, .5):.0f} ms",
             f"`podman rm` p50 {p(removes, .5):.0f} ms"),
            ("machine CPU per branch + first command + destroy", f"{cpu_ms:.0f} ms", "every process, the kernel too")]


def paused_round_trips(sandbox, n: int = 20, pause_s: float = 0.3) -> list[float]:
    """Round trips of `true` (ms), each after a pause, as an agent's commands come after its model calls."""
    times = []
    for _ in range(n):
        time.sleep(pause_s)
        times.append(timed(lambda: sandbox.exec("true")))
    return times


def rootfs_bytes(path: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True).stdout.split()[0])


def checkpoint_times(sandbox, n: int) -> tuple[list[float], list[float]]:
    idle = [sandbox.checkpoint().duration_ms for _ in range(n)]
    dirty = []
    for i in range(n):
        sandbox.exec(f"head -c 1048576 /dev/urandom > /root/edit-{i}")
        dirty.append(sandbox.checkpoint().duration_ms)
    return idle, dirty


def mode_figures(store: Store, n: int) -> dict[str, float]:
    """p50 of a `true` round trip, a checkpoint after a 1 MiB write and branch -> first command (ms)."""
    sandbox = store.create_sandbox(IMAGE)
    try:
        round_trips, _ = exec_costs(sandbox, 3 * n)
        _, checkpoints = checkpoint_times(sandbox, n)
        base = sandbox.checkpoint()
        branches = []
        for _ in range(max(5, n // 2)):
            started = time.perf_counter()
            branch = base.branch()
            branch.exec("true")
            branches.append((time.perf_counter() - started) * 1000)
            branch.destroy()
    finally:
        for checkpoint in store.checkpoints(sandbox.id):
            store.remove_checkpoint(checkpoint.id, force=True)
        sandbox.destroy()
    return {"true": p(round_trips, .5), "checkpoint": p(checkpoints, .5), "branch": p(branches, .5)}


def rootless_columns(user: str, checkout: str | None, n: int) -> dict[str, dict[str, float]]:
    """The same figures measured by `user` (rootless) in its own checkout, as JSON on its stdout."""
    where = checkout or f"{pwd.getpwnam(user).pw_dir}/sprout"
    command = f"cd {shlex.quote(where)} && .venv/bin/python bench/checkpoint.py --modes --n {n} --figures-json"
    measured = subprocess.run(["su", "-", user, "-c", command], capture_output=True, text=True)
    if measured.returncode != 0:
        raise SystemExit(f"the rootless measurement as {user} failed: {measured.stderr.strip()[-2000:]}")
    return {f"{mode} ({user})": figures for mode, figures in json.loads(measured.stdout.strip().splitlines()[-1]).items()}


def modes_table(args: argparse.Namespace, console: Console) -> None:
    """Root and rootless side by side, each through sprout-runtime and `podman exec` (run as a user: that
    user's two modes)."""
    mode = "rootless" if rootless.active() else "root"
    console.print(f"{mode}: sprout-runtime, then podman exec ...")
    columns = {f"{mode}, sprout-runtime": mode_figures(Store(runtime_bin=REPO / "runtime" / "sprout-runtime"), args.n),
               f"{mode}, podman exec": mode_figures(Store(runtime_bin=None), args.n)}
    if args.figures_json:
        print(json.dumps(columns))
        return
    if args.rootless_user and mode == "root":
        console.print(f"rootless, as {args.rootless_user} ...")
        columns |= rootless_columns(args.rootless_user, args.rootless_checkout, args.n)
    table = Table("measurement (p50)", *columns, title="Root and rootless side by side (one run)")
    for key, label in (("true", "`true` round trip"), ("checkpoint", "checkpoint after a 1 MiB write"),
                       ("branch", "branch -> first command")):
        table.add_row(label, *(f"{figures[key]:.1f} ms" for figures in columns.values()))
    console.print(table)
    console.print(f"over {3 * args.n} commands, {args.n} checkpoints and {max(5, args.n // 2)} branches each; "
                  "rootless, sprout-runtime loads the seccomp filter compiled from runc's state")


WRITER = "while :; do head -c 65536 /dev/zero >> /root/busy; [ $(stat -c %s /root/busy) -gt 67108864 ] && : > /root/busy; done"


def freeze_times(sandbox, n: int) -> list[float]:
    profile = profile_of(sandbox)

    def freeze_and_thaw() -> None:
        with processes.frozen(profile):
            pass

    return [timed(freeze_and_thaw) for _ in range(n)]


def freeze_rows(sandbox, n: int) -> list[tuple[str, str, str]]:
    """The freeze's own cost, idle and under a writer, and a whole checkpoint under that writer."""
    idle = freeze_times(sandbox, n)
    sandbox.exec(f"nohup bash -c '{WRITER}' >/dev/null 2>&1 & echo $! > /root/writer.pid")
    busy = freeze_times(sandbox, n)
    under_write = [sandbox.checkpoint().duration_ms for _ in range(n)]
    sandbox.exec("kill $(cat /root/writer.pid); rm -f /root/busy /root/writer.pid")
    return [(name, f"p50 {p(v, .5):.2f} ms", f"p95 {p(v, .95):.2f} ms") for name, v in (
        ("freeze + thaw alone, idle", idle), ("freeze + thaw alone, under a writer", busy),
        ("checkpoint under a writer (64 KB appends)", under_write))]


class TimedFreeze(processes.frozen):
    """processes.frozen, timed from the freeze's start to the thaw's end: the window the sandbox stood still."""

    windows: list[float] = []

    def __enter__(self) -> bool:
        self.started = time.perf_counter()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        TimedFreeze.windows.append((time.perf_counter() - self.started) * 1000)


def flushed_inside_the_freeze(sandbox, dest: Path) -> None:
    """The checkpoint as it was before the writeback moved ahead of the freeze, for the comparison."""
    with TimedFreeze(profile_of(sandbox)):
        btrfs.flush(sandbox.path)
        btrfs.snapshot(sandbox.path, dest, readonly=True)


def big_write_rows(store: Store, n: int) -> list[tuple[str, str, str]]:
    """A checkpoint right after the agent wrote 256 MB or 1 GB: total time and the frozen window, with
    the writeback inside the freeze (before) and ahead of it (now)."""
    sandbox = store.create_sandbox(IMAGE)
    rows = []
    original, processes.frozen = processes.frozen, TimedFreeze
    try:
        for mb in (256, 1024):
            for mode in ("before: writeback inside the freeze", "now: writeback ahead of the freeze"):
                TimedFreeze.windows, totals = [], []
                for i in range(n):
                    sandbox.exec(f"head -c {mb}M /dev/urandom > /root/big", timeout=300)
                    if mode.startswith("before"):
                        dest = store.root / "checkpoints" / f"bench-{sandbox.id}-{i}"
                        totals.append(timed(lambda: flushed_inside_the_freeze(sandbox, dest)))
                        btrfs.delete(dest)
                    else:
                        checkpoint = sandbox.checkpoint()
                        totals.append(checkpoint.duration_ms)
                        store.remove_checkpoint(checkpoint.id, force=True)
                frozen = TimedFreeze.windows
                rows.append((f"checkpoint after a {mb} MB write, {mode}", f"total p50 {p(totals, .5):,.0f} ms",
                             f"frozen p50 {p(frozen, .5):.1f} / p95 {p(frozen, .95):.1f} ms"))
    finally:
        processes.frozen = original
        sandbox.destroy()
    rows.append(("", "", "target: frozen window <= 50 ms p95"))
    return rows


def tar_ms(path: Path) -> float:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        return timed(lambda: subprocess.run(["tar", "-cf", f"{tmp}/rootfs.tar", "-C", str(path), "."],
                                            check=True, capture_output=True))


def commit_ms(fill_mb: int) -> float:
    """`podman commit` of an overlay container of the same image holding the same extra data."""
    name = f"sprout-bench-twin-{time.time_ns()}"
    subprocess.run([*podman.command(), "run", "-d", "--name", name, IMAGE, "sleep", "infinity"], check=True,
                   capture_output=True)
    try:
        subprocess.run([*podman.command(), "exec", name, "bash", "-c",
                        f"head -c {fill_mb}M /dev/urandom > /root/fill && head -c 1M /dev/urandom > /root/edit"],
                       check=True, capture_output=True)
        ms = timed(lambda: subprocess.run([*podman.command(), "commit", "-q", name, f"localhost/{name}"], check=True,
                                          capture_output=True))
        subprocess.run([*podman.command(), "rmi", "-f", f"localhost/{name}"], capture_output=True)
        return ms
    finally:
        subprocess.run([*podman.command(), "rm", "-f", "-t", "0", name], capture_output=True)


def microvm_rows(store: Store, n: int, console: Console) -> list[tuple[str, str, str, str]]:
    """The same steps on a container sandbox and on a microVM (512 MB) of the same image, in one run."""
    image = store.resolve_image(IMAGE)
    ms = lambda values: f"p50 {p(values, .5):,.0f} ms"  # noqa: E731

    def up(backend: str, network: bool = True) -> float:
        started = time.perf_counter()
        made.append(store.create_sandbox(image, backend=backend, memory="512m", network=network))
        made[-1].exec("true")
        return (time.perf_counter() - started) * 1000

    def offline_up(backend: str) -> float:
        elapsed = up(backend, network=False)
        made.pop().destroy()
        return elapsed

    def branch_ms(checkpoint) -> float:
        started = time.perf_counter()
        branch = checkpoint.branch()
        branch.exec("true")
        elapsed = (time.perf_counter() - started) * 1000
        branch.destroy()
        return elapsed

    made = []
    try:
        console.print("create / boot to first command ...")
        container_up, vm_up = [up("container") for _ in range(3)], [up("microvm") for _ in range(3)]
        container_offline = [offline_up("container") for _ in range(3)]
        vm_offline = [offline_up("microvm") for _ in range(3)]
        for extra in made[1:3] + made[4:]:  # an idle emulated VM still takes CPU: keep one of each
            extra.destroy()
        sandbox, vm = made[0], made[3]
        made[:] = [sandbox, vm]
        console.print("checkpoints ...")
        container_ck, disk_ck, memory_ck = [], [], []
        for i in range(n):  # apart from the VM's: they share the btrfs filesystem and its commits
            sandbox.exec(f"head -c 1048576 /dev/urandom > /root/edit-{i}")
            container_ck.append(sandbox.checkpoint().duration_ms)
        for i in range(n):
            vm.exec(f"head -c 1048576 /dev/urandom > /root/edit-{i}")
            disk_ck.append(vm.checkpoint().duration_ms)
            memory_ck.append(vm.checkpoint(memory=True).duration_ms)
        console.print("branch to first command ...")
        memory_base = store.checkpoints(vm.id)[-1]
        container_branch = [branch_ms(sandbox.checkpoint()) for _ in range(n)]
        memory_branch = [branch_ms(memory_base) for _ in range(n)]
        disk_branch = [branch_ms(vm.checkpoint()) for _ in range(3)]
        container_rt = [timed(lambda: sandbox.exec("true")) for _ in range(30)]
        vm_rt = [timed(lambda: vm.exec("true")) for _ in range(30)]
    finally:
        for made_sandbox in made:
            for checkpoint in store.checkpoints(made_sandbox.id):
                store.remove_checkpoint(checkpoint.id, force=True)
            made_sandbox.destroy()
    return [
        ("create / boot -> first command, with network", ms(container_up), ms(vm_up) + " (+ holder container)",
         "Firecracker boot ~125 ms (KVM)"),
        ("create / boot -> first command, no network", ms(container_offline), ms(vm_offline), ""),
        ("checkpoint after 1 MB write, disk only", ms(container_ck), ms(disk_ck), "AgentENV disk-only snapshots"),
        ("checkpoint, disk + memory (512 MB guest)", "no memory state",
         f"{ms(memory_ck)} ({p(memory_ck, .5) / 1000 / 0.5:.2f} s/GB of guest RAM)", "E2B pause ~4 s/GB"),
        ("branch -> first command, disk checkpoint", ms(container_branch), ms(disk_branch) + " (boots)",
         "Morph < 250 ms"),
        ("branch -> first command, memory checkpoint", "n/a", ms(memory_branch) + " (resumes)",
         "Firecracker resume < 8 ms target"),
        ("`true` round trip", f"p50 {p(container_rt, .5):.1f} ms (sprout-runtime)",
         f"p50 {p(vm_rt, .5):.1f} ms (agent)", ""),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-gb", type=float, default=3.0, help="extra data in the big sandbox (GB)")
    parser.add_argument("--n", type=int, default=20, help="checkpoints per measurement")
    parser.add_argument("--big-write-n", type=int, default=5,
                        help="checkpoints after each big write (256 MB, 1 GB) and mode")
    parser.add_argument("--backend", choices=["container", "microvm"], default="container",
                        help="microvm: containers and microVMs side by side")
    parser.add_argument("--modes", action="store_true", help="only root and rootless side by side")
    parser.add_argument("--rootless-user", metavar="USER",
                        help="with --modes, as root: also measure as USER, a user set up without root")
    parser.add_argument("--rootless-checkout", metavar="PATH",
                        help="USER's set-up checkout of Sprout (default: ~USER/sprout)")
    parser.add_argument("--figures-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    console = Console(stderr=args.figures_json)
    if args.modes:
        rootless.enter()
        return modes_table(args, console)
    if args.backend == "microvm":
        from sprout.sandbox.backends.microvm import accelerator
        accel, why = accelerator()
        rows = microvm_rows(Store(runtime_bin=REPO / "runtime" / "sprout-runtime"), args.n, console)
        table = Table("measurement", "container", f"microVM ({accel})", "anchor",
                      title="Sprout backends side by side (one run)")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        console.print(f"accelerator: {why}; percentiles over {args.n} checkpoints and branches "
                      "(3 boots and disk branches)")
        return
    fast = Store(runtime_bin=REPO / "runtime" / "sprout-runtime")
    slow = Store(fast.root, runtime_bin=None)
    rows: list[tuple[str, str, str]] = []
    made = []
    try:
        console.print("small sandbox ...")
        small = fast.create_sandbox(IMAGE)
        made.append(small)
        small_size = rootfs_bytes(small.path)
        s_idle, s_dirty = checkpoint_times(small, args.n)
        freezing = freeze_rows(small, args.n)
        console.print(f"big sandbox (+{args.big_gb:g} GB) ...")
        big = fast.create_sandbox(IMAGE)
        made.append(big)
        big.exec(f"head -c {int(args.big_gb * 1024)}M /dev/urandom > /root/fill", timeout=900)
        big_size = rootfs_bytes(big.path)
        b_idle, b_dirty = checkpoint_times(big, args.n)
        for label, size, idle, dirty in (("small", small_size, s_idle, s_dirty), ("big", big_size, b_idle, b_dirty)):
            rows.append((f"checkpoint idle, {size / 1e6:,.0f} MB rootfs", f"p50 {p(idle, .5):.1f} ms",
                         f"p95 {p(idle, .95):.1f} ms"))
            rows.append((f"checkpoint after 1 MB write, {size / 1e6:,.0f} MB", f"p50 {p(dirty, .5):.1f} ms",
                         f"p95 {p(dirty, .95):.1f} ms"))
        flat = p(b_dirty, .5) / p(s_dirty, .5)
        rows.append(("flat in size: big / small checkpoint p50", f"{flat:.2f}x", "target ~1x"))
        rows += freezing
        console.print("checkpoints after big writes ...")
        rows += big_write_rows(fast, args.big_write_n)

        console.print("tar and podman commit ...")
        for label, sandbox, size, fill_mb, dirty in (("small", small, small_size, 0, s_dirty),
                                                      ("big", big, big_size, int(args.big_gb * 1024), b_dirty)):
            tar = tar_ms(sandbox.path)
            commit = commit_ms(fill_mb)
            ck = p(dirty, .5)
            rows.append((f"tar of rootfs, {size / 1e6:,.0f} MB", f"{tar:,.0f} ms", f"{tar / ck:,.0f}x checkpoint"))
            rows.append((f"podman commit of overlay twin, {size / 1e6:,.0f} MB", f"{commit:,.0f} ms",
                         f"{commit / ck:,.0f}x checkpoint"))

        console.print("branch to first command ...")
        rows += branch_rows(small.checkpoint(), max(5, args.n // 2))

        console.print("command round trip ...")
        slow_small = slow.sandbox(small.id)
        (via_runtime, runtime_cpu), (via_podman, podman_cpu) = exec_costs(small), exec_costs(slow_small)
        ratio = p(via_podman, .5) / p(via_runtime, .5)
        rows.append(("`true` via sprout-runtime (confined)", f"p50 {p(via_runtime, .5):.1f} ms",
                     f"{ratio:.1f}x faster; target <= 5 ms"))
        paused = paused_round_trips(small)
        dynmods = {True: "on", False: "off", None: "no cgroup2 mount"}[cgroup2_favordynmods()]
        rows.append(("`true` via sprout-runtime after a 0.3 s pause (a command after a model call)",
                     f"p50 {p(paused, .5):.1f} ms", f"{p(paused, .5) / p(via_runtime, .5):.1f}x back to back; "
                     f"cgroup2 favordynmods {dynmods}"))
        rows.append(("`true` via podman exec", f"p50 {p(via_podman, .5):.1f} ms", "baseline"))
        rows.append(("CPU per `true`: sprout-runtime / podman exec", f"{runtime_cpu:.1f} / {podman_cpu:.1f} ms",
                     f"{podman_cpu / runtime_cpu:.1f}x less (caller + runtime + command)"))

        console.print("100 checkpoints after 1 MiB edits ...")
        chain = fast.create_sandbox(IMAGE)
        made.append(chain)
        base_size = rootfs_bytes(chain.path)
        cps = []
        for _ in range(100):
            chain.exec("head -c 1048576 /dev/urandom > /root/edit")
            cps.append(chain.checkpoint())
        held = btrfs.disk_usage([c.path for c in cps])
        rows.append(("100 checkpoints, 1 MiB edit each: exclusive bytes", f"{held / 1e6:,.1f} MB",
                     f"{held / base_size:.2f}x base ({base_size / 1e6:,.0f} MB)"))
    finally:
        for sandbox in made:
            for checkpoint in fast.checkpoints(sandbox.id):
                fast.remove_checkpoint(checkpoint.id, force=True)
            sandbox.destroy()
    table = Table("measurement", "value", "ratio / note", title="Sprout checkpoint benchmark (one run)")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(f"percentiles over {args.n} checkpoints per row")


if __name__ == "__main__":
    main()
