"""The compiled runtime (runtime/sprout-runtime, from src/sprout/sandbox/runtime.c) run as its own program:
what it passes on (the image's environment, the user, the exit status) and how it fails (one line, 125).
The confinement itself is compared with `podman exec` in test_sandbox and attacked in test_hostile."""

import os
import shutil
import signal
import struct
import subprocess
import time

import pytest

from sprout.sandbox import Store, confinement, processes, seccomp
from sprout.worker import doctor
from tests.conftest import DEBIAN_IMAGE, RUNTIME_BIN, removing_what_is_made


@pytest.fixture(scope="module")
def sandbox(base_store: Store):
    with removing_what_is_made(Store(base_store.root, runtime_bin=RUNTIME_BIN)) as store:
        yield store.create_sandbox(DEBIAN_IMAGE, env={"ODD": "back\\slash\nnew line", "PLAIN": "1"})


def runtime(profile, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUNTIME_BIN), "exec", "--profile", str(profile), *args], capture_output=True,
                          text=True, env={"PATH": "/nowhere", "HOST_ONLY": "secret"}, timeout=60, **kwargs)


def test_a_command_gets_the_images_environment_not_the_callers(sandbox):
    done = runtime(sandbox.profile_path, "--env", "PLAIN=2", "--env", "EXTRA=x", "--cwd", "/tmp", "--",
                   "sh", "-c", 'printf "%s|" "$PATH" "$PLAIN" "$EXTRA" "$ODD" "${HOST_ONLY-unset}"; pwd')
    assert done.returncode == 0, done.stderr
    assert done.stdout == ("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin|2|x|"
                           "back\\slash\nnew line|unset|/tmp\n")


def test_the_profile_round_trips_every_value_it_holds(sandbox):
    profile = confinement.read(sandbox.profile_path)
    again = sandbox.profile_path.with_name("again.profile")
    confinement.write(profile, again)
    assert again.read_bytes() == sandbox.profile_path.read_bytes()
    assert profile["env"]["ODD"] == "back\\slash\nnew line" and profile["seccomp"] and profile["cgroup_procs"]
    again.unlink()


def test_the_filter_compiled_from_runcs_state_is_the_one_runc_loaded_after_its_enosys_stub(sandbox):
    """What a rootless runtime loads (sprout.sandbox.seccomp, compiled from runc's state) against what
    runc loaded, read off the container's init as root: the same program, byte for byte, behind runc's
    stub, whose every verdict is ENOSYS, the filter's default. A default of EPERM is not reproduced."""
    state = confinement.runc_state(confinement.read(sandbox.profile_path)["container_id"])
    assert state is not None
    (loaded,) = confinement.dump_seccomp(state["init_process_pid"])
    config = state["config"]["seccomp"]
    compiled = seccomp.reproduce(config)
    assert compiled is not None and len(compiled) > 8000 and loaded.endswith(compiled)
    stub = loaded[:len(loaded) - len(compiled)]
    verdicts = {k for code, _, _, k in struct.iter_unpack("<HBBI", stub) if code == 0x06}  # BPF_RET|BPF_K
    assert verdicts == {0x00050000 | 38}  # SECCOMP_RET_ERRNO | ENOSYS
    assert seccomp.reproduce({**config, "default_errno_ret": 1}) is None


@pytest.mark.parametrize("user, uid, cap_eff", [("1000:1000:1000,27", "1000", "0000000000000000"),
                                                ("0:0", "0", "00000000800405fb")])
def test_a_user_gets_the_capabilities_podman_exec_gives_it(sandbox, user, uid, cap_eff):
    done = runtime(sandbox.profile_path, "--user", user, "--", "sh", "-c", "id -u; grep CapEff /proc/self/status")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [uid, "CapEff:", cap_eff]


def test_the_exit_status_is_the_commands_with_signals_as_128_plus_n(sandbox):
    assert runtime(sandbox.profile_path, "--", "sh", "-c", "exit 7").returncode == 7
    assert runtime(sandbox.profile_path, "--", "sh", "-c", "kill -9 $$").returncode == 137
    missing = runtime(sandbox.profile_path, "--", "no-such-command")
    assert (missing.returncode, missing.stderr) == (
        127, "sprout-runtime: cannot execute 'no-such-command': No such file or directory\n")
    not_executable = runtime(sandbox.profile_path, "--", "/etc/passwd")
    assert (not_executable.returncode, not_executable.stderr) == (
        126, "sprout-runtime: cannot execute '/etc/passwd': Permission denied\n")


def test_a_bad_profile_or_directory_is_one_line_and_125(sandbox, tmp_path):
    cases = {
        tmp_path / "absent": "cannot read exec profile",
        tmp_path / "not-a-profile": "is not an exec profile this runtime reads",
        tmp_path / "stale": "sandbox is not running (its init process is gone)",
    }
    (tmp_path / "not-a-profile").write_bytes(b"\x00\x01marshal of an older Sprout")
    stale = confinement.read(sandbox.profile_path) | {"init_starttime": 1}
    confinement.write(stale, tmp_path / "stale")
    for profile, message in cases.items():
        done = runtime(profile, "--", "true")
        assert done.returncode == 125 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    wrong_cwd = runtime(sandbox.profile_path, "--cwd", "/no/such/dir", "--", "true")
    assert wrong_cwd.returncode == 125
    assert "cannot change directory to '/no/such/dir' inside the sandbox" in wrong_cwd.stderr
    usage = subprocess.run([str(RUNTIME_BIN), "exec", "--bogus", "x"], capture_output=True, text=True)
    assert usage.returncode == 125 and "unknown option --bogus" in usage.stderr
    assert "Runs COMMAND inside a running Sprout sandbox" in subprocess.run(
        [str(RUNTIME_BIN), "--help"], capture_output=True, text=True, check=True).stdout


def test_a_killed_runtime_takes_its_command_with_it(sandbox):
    """Killed at once, as soon as its child has joined the sandbox's cgroups (before the runtime set
    the child's parent-death signal, the command outlived it more than half the time), ten times over."""
    profile = confinement.read(sandbox.profile_path)
    before = processes.processes(profile)
    for _ in range(10):
        proc = subprocess.Popen([str(RUNTIME_BIN), "exec", "--profile", str(sandbox.profile_path), "--",
                                 "sleep", "1000"])
        deadline = time.monotonic() + 10
        while not processes.processes(profile) - before and time.monotonic() < deadline:
            pass
        assert processes.processes(profile) - before, "the command never started"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while processes.processes(profile) - before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not processes.processes(profile) - before


def test_the_set_up_script_compiles_it_from_this_source_and_doctor_says_when_not(tmp_path):
    assert shutil.which("gcc"), "gcc is one of the set-up script's packages"
    source = RUNTIME_BIN.parents[1] / "src" / "sprout" / "sandbox" / "runtime.c"
    stamp = subprocess.run(["sha256sum", str(source)], capture_output=True, text=True, check=True).stdout.split()[0]
    assert RUNTIME_BIN.with_name("sprout-runtime.source").read_text().strip() == stamp
    assert doctor._runtime_bin(RUNTIME_BIN).ok
    old = tmp_path / "sprout-runtime"
    shutil.copy(RUNTIME_BIN, old)
    old.with_name("sprout-runtime.source").write_text("the hash of an older runtime.c\n")
    check = doctor._runtime_bin(old)
    assert not check.ok and check.detail == (f"{old} was not compiled from this checkout's runtime.c "
                                             "(run ops/setup_podman.sh again)")
