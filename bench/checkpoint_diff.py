"""Checkpoint diff benchmark: a ~300 MB rootfs, 10 files changed between two checkpoints (5 binary files
overwritten in place, 5 text files of ~256 KB edited); Sprout's diff (btrfs send, and the walk it falls back
to) against `diff -r` of the two trees, all measured in this run. Two kinds of text edit: 3 lines of each
file (an agent's edit), and every line (difflib's worst case, for the unified diffs).

    .venv/bin/python bench/checkpoint_diff.py [--mb 300] [--n 10]
"""

import argparse
import statistics
import subprocess
import time

from rich.console import Console
from rich.table import Table

from sprout.sandbox import Checkpoint, Store

IMAGE = "docker.io/library/python:3.11-slim"
FILL = """import os, sys
os.makedirs('/data', exist_ok=True)
total, i = int(sys.argv[1]), 0
while total > 0:
    size = min(total, 256 << 10)
    with open(f'/data/f{i:05d}.{"txt" if i % 2 else "bin"}', 'wb') as out:
        out.write(''.join(f'line {j} of file {i}\\n' for j in range(size // 24)).encode() if i % 2
                  else os.urandom(size))
    total, i = total - size, i + 1
"""
BINARY = ("for i in 00000 00002 00004 00006 00008; do head -c 1000 /dev/urandom | dd of=/data/f$i.bin conv=notrunc "
          "status=none; done")
TEXT_EDITS = {"3 lines each": "sed -i '100s/^line/LINE/;5000s/^line/LINE/;9000s/^line/LINE/'",
              "every line": "sed -i 's/^line/LINE/'"}


def rootfs_mb(path) -> float:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True).stdout.split()[0]) / 1e6


def timed_ms(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return times


def measure(store: Store, before: Checkpoint, after: Checkpoint, n: int) -> dict[str, list[float]]:
    return {
        "sprout, btrfs send, with unified diffs": timed_ms(lambda: store.diff(before.id, after.id), n),
        "sprout, btrfs send, summary (each turn's)": timed_ms(lambda: store.diff(before.id, after.id, content=False), n),
        "sprout, walk of both trees, with diffs": timed_ms(lambda: store.diff(before.id, after.id, walk=True), n),
        "diff -r of the two trees": timed_ms(lambda: subprocess.run(
            ["diff", "-r", str(before.path), str(after.path)], capture_output=True), max(3, n // 3)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=300, help="size of the rootfs to reach (default 300)")
    parser.add_argument("--n", type=int, default=10, help="repetitions of each measurement (default 10)")
    args = parser.parse_args()
    store = Store()
    sandbox = store.create_sandbox(IMAGE, network=False)
    made: list[Checkpoint] = []
    try:
        fill = max(0, args.mb - int(rootfs_mb(sandbox.path))) << 20
        assert sandbox.exec(["python3", "-c", FILL, str(fill)]).exit_code == 0
        before = sandbox.checkpoint()
        made.append(before)
        table = Table("text edit", "method", "p50 ms", "max ms", "vs diff -r", title=(
            f"checkpoint diff: {rootfs_mb(before.path):.0f} MB rootfs, 10 files changed (5 binary, 5 text)"))
        for edit, command in TEXT_EDITS.items():
            branch = before.branch()
            text = f"for i in 00001 00003 00005 00007 00009; do {command} /data/f$i.txt; done"
            assert branch.exec(f"{BINARY}; {text}").exit_code == 0
            after = branch.checkpoint()
            made.append(after)
            branch.destroy()
            found = store.diff(before.id, after.id)
            assert len(found.changes) == 10, [c.line() for c in found.changes]
            rows = measure(store, before, after, args.n)
            reference = statistics.median(rows["diff -r of the two trees"])
            for name, times in rows.items():
                median = statistics.median(times)
                table.add_row(edit, name, f"{median:.1f}", f"{max(times):.1f}", f"{reference / median:.1f}x")
        Console().print(table)
    finally:
        sandbox.destroy()
        for checkpoint in made:
            store.remove_checkpoint(checkpoint.id, force=True)


if __name__ == "__main__":
    main()
