"""The sandbox CLI and `worker doctor`, run as a user runs them."""

import json
import os
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

from sprout.sandbox import Store
from sprout.sandbox.backends import Check
from sprout.sandbox.images import RECIPES, stand_in
from sprout.worker import doctor
from tests.conftest import DEBIAN_IMAGE, REPO, RUNTIME_BIN, drop_store


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_sandbox_cli_round_trip():
    sandbox = cli("sprout.sandbox", "create", DEBIAN_IMAGE, "--label", "cli-test").stdout.strip()
    assert sandbox.startswith("sb-")
    try:
        rt = ("--runtime-bin", str(RUNTIME_BIN))
        assert cli("sprout.sandbox", *rt, "exec", sandbox, "echo hi > /root/a && cat /root/a").stdout == "hi\n"
        failed = cli("sprout.sandbox", "exec", sandbox, "exit 7")
        assert failed.returncode == 7
        checkpoint = cli("sprout.sandbox", "checkpoint", sandbox).stdout.split()[0]
        assert checkpoint.startswith("ck-")
        branch = cli("sprout.sandbox", "branch", checkpoint).stdout.strip()
        assert cli("sprout.sandbox", *rt, "exec", branch, "cat /root/a").stdout == "hi\n"
        listing = cli("sprout.sandbox", "ls").stdout
        assert sandbox in listing and checkpoint in listing and branch in listing
        refused = cli("sprout.sandbox", "rm", checkpoint)
        assert refused.returncode == 1 and "live branch" in refused.stderr and "Traceback" not in refused.stderr
        refused = cli("sprout.sandbox", "rm", sandbox)
        assert refused.returncode == 1 and "running" in refused.stderr
        assert cli("sprout.sandbox", "rm", "--force", branch, sandbox, checkpoint).returncode == 0
        assert sandbox not in cli("sprout.sandbox", "ls").stdout
    finally:
        cli("sprout.sandbox", "rm", "--force", sandbox)


def test_unknown_ids_and_images_give_one_clear_line():
    result = cli("sprout.sandbox", "exec", "sb-nope", "true")
    assert result.returncode == 1 and "no sandbox 'sb-nope'" in result.stderr and "Traceback" not in result.stderr
    result = cli("sprout.sandbox", "create", "localhost/no/such:image")
    assert result.returncode == 1 and "no image" in result.stderr and "Traceback" not in result.stderr


def test_doctor_passes_on_this_host():
    result = cli("sprout.worker", "doctor", "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 0, result.stdout
    names = [c["name"] for c in report["checks"]]
    assert names[:3] == ["python", "kernel btrfs", "store"] and "smoke test" in names
    smoke = next(c for c in report["checks"] if c["name"] == "smoke test")
    assert "checkpoint" in smoke["detail"] and "branch" in smoke["detail"]
    bases = next(c for c in report["checks"] if c["name"] == "base images")["detail"]
    assert ("offline stand-ins" in bases) == stand_in(DEBIAN_IMAGE)  # this host's are, where no registry answers
    if stand_in(DEBIAN_IMAGE):
        assert "debian:bookworm" in bases.split("stand-ins", 1)[1]


def test_set_up_hosts_join_cgroups_without_waiting_and_doctor_says_so():
    """ops/setup_podman.sh mounts cgroup2 with favordynmods where the kernel takes it (Linux 6.0+), so a
    command's join of its sandbox's cgroups does not wait for an RCU grace period; doctor reports the state."""
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    cgroup2 = next(m for m in mounts if m[2] == "cgroup2" and m[1] in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"))
    on = "favordynmods" in cgroup2[3].split(",")
    kernel = tuple(int(part) for part in os.uname().release.split(".")[:2])
    if kernel >= (6, 0) and os.environ.get("SPROUT_CGROUP_FAVORDYNMODS") != "0":
        assert on, f"{cgroup2[1]} is mounted without favordynmods: {cgroup2[3]}"
    detail = doctor._cgroups().detail
    assert ("favordynmods on" in detail) == on and ("favordynmods off" in detail) == (not on)


def test_doctor_fails_clearly_when_the_store_is_missing(tmp_path):
    result = cli("sprout.worker", "doctor", env={"SPROUT_STORE": str(tmp_path / "nowhere")})
    assert result.returncode == 1
    store_line = next(line for line in result.stdout.splitlines() if "store " in line)
    assert store_line.startswith("FAIL") and "no btrfs store" in store_line and "setup_podman.sh" in store_line
    assert "Traceback" not in result.stdout + result.stderr


def test_doctor_boots_a_microvm_when_asked_for_that_backend():
    result = cli("sprout.worker", "doctor", "--backend", "microvm", "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 0, result.stdout
    checks = {c["name"]: c["detail"] for c in report["checks"]}
    assert {"kvm", "qemu", "guest kernel", "microvm smoke"} <= checks.keys()
    accel = checks["kvm"].split(":")[0]
    assert accel in ("kvm", "tcg") and checks["microvm smoke"].startswith(f"{accel}: boot ")
    assert "checkpoint" in checks["microvm smoke"] and "branch" in checks["microvm smoke"]


def test_a_new_store_without_imported_images_passes_the_base_image_check(base_store):
    """The store imports a base image when a sandbox first needs it: podman holding it is enough."""
    root = base_store.root / "test-stores" / f"doctor-{uuid.uuid4().hex[:8]}"
    try:
        store = Store(root)
        assert not store.images()
        check = doctor._base_images(store)
        assert check.ok and "python:3.11-slim" in check.detail, check
        missing = replace(RECIPES[0], tags=("localhost/sprout-test/never-made:1",))
        with patch.object(doctor, "RECIPES", (missing,)):
            assert doctor._base_images(store) == Check(
                "base images", False, "missing localhost/sprout-test/never-made:1: run sprout sandbox images bootstrap")
    finally:
        drop_store(root)
