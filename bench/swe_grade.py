"""Grade time of a SWE-rebench V2 instance with Sprout against the same steps by hand with podman, in
one run.

    .venv/bin/python bench/swe_grade.py [--n 5] [--store PATH]

The instance is the tests' calc repository (tests/tasks/test_swe_rebench.py): an image of
python:3.11 holding a git repository with a failing pytest test, built here offline and removed at the
end; the diff is the fix, so every grade resolves. Each of --n rounds grades it both ways:

  Sprout   `grade_instance`: a fresh sandbox of the image (a btrfs snapshot of the imported image run by
           podman), the patches and scripts staged, `git reset` + both `git apply`, the test command,
           the log parsed by the parsers file, the sandbox destroyed. Its own phase timings are reported.
  by hand  what a script around `podman run` does for the same steps: `podman run -d` of the image
           (start), `podman cp` of the patches + the same setup script (apply), `podman exec` of the
           same test script with stdout and stderr kept (tests), the same parser (parse), `podman rm -f`
           (destroy).

Medians per phase, and the ratio Sprout / by hand. `image` (the image made present and imported into
the store; cached after the first grade, then a lookup) has no by-hand counterpart: podman run uses its
own image store. `parse` is the parser on the log, well under a millisecond here.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from sprout.console import console  # noqa: E402
from sprout.sandbox import Store  # noqa: E402
from sprout.sandbox.podman import command as podman_command  # noqa: E402
from sprout.sandbox.podman import ulimit_flags  # noqa: E402
from sprout.tasks.swe_rebench import Instance, grade_instance, load_parsers  # noqa: E402
from sprout.tasks.swe_rebench.grade import official_scripts  # noqa: E402
from tests.tasks.test_swe_rebench import (  # noqa: E402 - the repository's tests package, importable from REPO
    BUGGY,
    FIX,
    PARSERS,
    ROW,
    TEST_ADD,
    TEST_CMD,
    TEST_PATCH,
    build_repo_image,
    remove_image,
)

IMAGE = "localhost/sprout-test/swe-rebench-bench:1"
PHASES = ["start", "apply", "tests", "parse", "destroy"]


def podman(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*podman_command(), *args], capture_output=True, text=True, check=True)


def by_hand(instance: Instance, parser, work: Path) -> dict[str, float]:
    """The official steps around `podman run`, timed per phase."""
    times: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        times[phase], mark = now - mark, now

    scripts = official_scripts(instance, "/tmp/grade/patch.diff", "/tmp/grade/test_patch.diff")
    for name, text in {"patch.diff": FIX, "test_patch.diff": instance.test_patch, **scripts}.items():
        (work / name).write_text(text)
    name = podman("run", "-d", "--network", "none", *ulimit_flags(), "-w", "/calc", IMAGE, "sleep", "infinity")
    container = name.stdout.strip()
    lap("start")
    try:
        podman("cp", str(work), f"{container}:/tmp/grade")
        podman("exec", "-w", "/calc", container, "bash", "/tmp/grade/setup.sh")
        lap("apply")
        tests = subprocess.run([*podman_command(), "exec", "-w", "/calc", container, "bash", "/tmp/grade/tests.sh"],
                               capture_output=True, text=True)
        lap("tests")
        statuses = parser(tests.stdout + tests.stderr)
        lap("parse")
        assert statuses.get("tests/test_mul.py::test_mul") == "PASSED", statuses
    finally:
        podman("rm", "-f", "-t", "0", container)
        lap("destroy")
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--store", type=Path, help="btrfs store (default: $SPROUT_STORE or ~/sprout-btrfs)")
    args = p.parse_args()
    store = Store(args.store, runtime_bin=REPO / "runtime" / "sprout-runtime")
    with tempfile.TemporaryDirectory(prefix="sprout-bench-swe-") as tmp:
        work = Path(tmp)
        (work / "image").mkdir()
        (work / "hand").mkdir()
        base = build_repo_image(work / "image", IMAGE, {"calc/__init__.py": "", "calc/ops.py": BUGGY,
                                                        "tests/test_ops.py": TEST_ADD})
        (work / "log_parsers.py").write_text(PARSERS)
        parsers = load_parsers(work / "log_parsers.py")
        instance = Instance.model_validate({**ROW, "base_commit": base, "image_name": IMAGE, "test_patch": TEST_PATCH,
                                            "install_config": {"test_cmd": [TEST_CMD], "log_parser": "parse_log_pytest"}})
        sprout_runs, hand_runs, image_s = [], [], []
        try:
            for i in range(args.n):
                grade = grade_instance(store, instance, FIX, parsers, timeout_s=300, network=False)
                if not grade.resolved:
                    raise SystemExit(f"the fix did not resolve: {grade.error or grade.zero_reason}")
                image_s.append(grade.timings["image"])
                sprout_runs.append(grade.timings)
                hand_runs.append(by_hand(instance, parsers.get("parse_log_pytest"), work / "hand"))
                console.print(f"round {i + 1}/{args.n}: sprout {grade.duration_s:.2f} s, "
                              f"by hand {sum(hand_runs[-1].values()):.2f} s", markup=False)
        finally:
            remove_image(store, IMAGE)
    table = Table(title=f"SWE-rebench V2 grade time per instance, median of {args.n} (s)")
    for column in ("phase", "Sprout", "podman by hand", "Sprout / by hand"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase in ["image", *PHASES, "total"]:
        ours = statistics.median(sum(r.values()) if phase == "total" else r[phase] for r in sprout_runs)
        hand = statistics.median(sum(r.values()) if phase == "total" else r.get(phase, 0.0) for r in hand_runs)
        table.add_row(phase, f"{ours:.3f}", f"{hand:.3f}" if phase != "image" else "-",
                      f"{ours / hand:.2f}x" if hand > 0.0005 else "-")
    console.print(table)
    console.print(f"the first grade made the image present and imported it in {image_s[0]:.2f} s (then cached)",
                  markup=False)


if __name__ == "__main__":
    main()
