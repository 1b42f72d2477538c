"""Measuring a fleet on one machine, for the bench scripts: CPU time by component (cgroup v1 `cpuacct`
groups, which account and do not schedule), the machine's CPU and memory, a second btrfs store (a loop
file) that stands in for another host's, and a fresh PostgreSQL schema for a Run Store."""

import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from sqlalchemy import create_engine, make_url, text

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
CONTAINERS = CPUACCT / "libpod_parent"  # podman's (cgroupfs): every container and its conmon


def machine_cpu_s() -> float:
    """CPU seconds the machine has spent busy since boot (all CPUs; idle and iowait left out)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def memory_used_bytes() -> int:
    """MemTotal - MemAvailable: what the machine could not hand out now."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024


class CpuGroups:
    """One `cpuacct` group per component under a group of the bench's own; a process put in one keeps its
    children there (the podman commands a worker runs, say). Containers stay where podman puts them
    (`libpod_parent`), read as the component "sandboxes". Processes still in a group when it is closed are
    moved back to the root group."""

    def __init__(self, name: str):
        self.root = CPUACCT / name
        self.root.mkdir()

    def add(self, component: str, *pids: int) -> None:
        group = self.root / component
        group.mkdir(exist_ok=True)
        for pid in pids:
            (group / "cgroup.procs").write_text(str(pid))

    def usage_s(self) -> dict[str, float]:
        """CPU seconds by component so far (a group's count includes its processes that have exited)."""
        usage = {g.name: int((g / "cpuacct.usage").read_text()) / 1e9 for g in self.root.iterdir() if g.is_dir()}
        if CONTAINERS.is_dir():
            usage["sandboxes (containers, conmon)"] = int((CONTAINERS / "cpuacct.usage").read_text()) / 1e9
        return usage

    def close(self) -> None:
        for group in [g for g in self.root.iterdir() if g.is_dir()] + [self.root]:
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    (CPUACCT / "cgroup.procs").write_text(pid)
                except ProcessLookupError:
                    pass
            if group != self.root:
                group.rmdir()
        self.root.rmdir()


@dataclass
class Peaks:
    """What a sampler saw: the highest memory in use and, per name, the highest count."""

    memory_bytes: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    total: int = 0  # the highest sum of the counts at one time


@contextmanager
def sample_peaks(counters: dict[str, Callable[[], int]], every_s: float = 0.5) -> Iterator[Peaks]:
    """Samples memory in use and each counter every `every_s` seconds while the block runs."""
    peaks, done = Peaks(), threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            counts = {name: count() for name, count in counters.items()}
            peaks.memory_bytes = max(peaks.memory_bytes, memory_used_bytes())
            peaks.counts = {name: max(peaks.counts.get(name, 0), n) for name, n in counts.items()}
            peaks.total = max(peaks.total, sum(counts.values()))

    thread = threading.Thread(target=sample, name="peaks", daemon=True)
    thread.start()
    try:
        yield peaks
    finally:
        done.set()
        thread.join()


@contextmanager
def loop_btrfs(image: Path, size: str = "16G") -> Iterator[Path]:
    """A btrfs filesystem in a sparse loop file, mounted beside it; unmounted and removed afterwards."""
    mount = image.with_suffix("")
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    subprocess.run(["mkfs.btrfs", "-q", str(image)], check=True, capture_output=True)
    mount.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    try:
        yield mount
    finally:
        for _ in range(10):  # a container of the store may take a moment to let go of it
            if subprocess.run(["umount", str(mount)], capture_output=True).returncode == 0:
                image.unlink(missing_ok=True)
                break
            time.sleep(1)
        else:
            print(f"could not unmount {mount}: unmount it and remove {image} by hand")


@contextmanager
def postgres_schema(url: str) -> Iterator[str]:
    """A fresh schema in the PostgreSQL at `url`, dropped afterwards; a URL whose connections use it."""
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(url)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield make_url(url).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
            hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
