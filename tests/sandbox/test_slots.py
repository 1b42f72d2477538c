"""The host's slots across processes: never more holders than slots, a killed holder frees its slot, a
stopped waiter gives up."""

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from sprout.sandbox.errors import SproutError
from sprout.sandbox.slots import HostSlots, SlotWaitStopped, host_slot_count

pytestmark = pytest.mark.python_only


def hold_for(root: str, count: int, seconds: float, log: str) -> None:
    with HostSlots(Path(root), count).hold() as number:
        with open(log, "a") as f:
            f.write(f"start {time.monotonic()} {number}\n")
        time.sleep(seconds)
        with open(log, "a") as f:
            f.write(f"end {time.monotonic()} {number}\n")


def most_at_once(log: Path) -> int:
    events = sorted((float(t), 1 if kind == "start" else -1) for kind, t, _ in
                    (line.split() for line in log.read_text().splitlines()))
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    return most


def test_five_processes_share_two_slots(tmp_path):
    log = tmp_path / "log"
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=hold_for, args=(str(tmp_path), 2, 0.5, str(log))) for _ in range(5)]
    started = time.monotonic()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert most_at_once(log) == 2
    assert time.monotonic() - started >= 1.5  # three waves of 0.5 s
    assert {line.split()[2] for line in log.read_text().splitlines()} == {"0", "1"}


def test_a_killed_holder_frees_its_slot_and_a_stopped_waiter_gives_up(tmp_path):
    context = multiprocessing.get_context("spawn")
    holder = context.Process(target=hold_for, args=(str(tmp_path), 1, 60, str(tmp_path / "log")))
    holder.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "log").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    slots = HostSlots(tmp_path, 1)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    waits = []
    with pytest.raises(SlotWaitStopped):
        with slots.hold(stop, on_wait=lambda: waits.append(1)):
            pass
    assert waits == [1]
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    with slots.hold(threading.Event()) as number:  # the kernel dropped the dead holder's lock
        assert number == 0


def test_the_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPROUT_HOST_SLOTS", "3")
    assert host_slot_count() == 3
    monkeypatch.setenv("SPROUT_HOST_SLOTS", "none")
    with pytest.raises(SproutError, match="SPROUT_HOST_SLOTS='none' cannot be used: Input should be a valid integer"):
        host_slot_count()
    monkeypatch.delenv("SPROUT_HOST_SLOTS")
    assert host_slot_count() == max(4, 2 * (os.cpu_count() or 1))
