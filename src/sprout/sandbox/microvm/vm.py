"""One microVM: a QEMU `microvm` machine booted from a guest kit and a disk file, driven over QMP
(pause, memory snapshots) and over a virtio-serial port to its agent (commands, freeze, identity).

QEMU daemonizes, so a VM outlives the process that started it (as a container outlives podman) and
any process can drive it. Its run directory holds qmp.sock, agent.sock, vm.json (pid, start time,
accelerator, the commands' base environment), qemu.log and console.log. Each operation connects,
holds the run directory's lock for that channel (the agent serves one request at a time) and
disconnects.
"""

import fcntl
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qemu.qmp import QMPError
from qemu.qmp.legacy import QEMUMonitorProtocol

from ..errors import SproutError
from ..execution import DEFAULT_MAX_OUTPUT, TIMEOUT_EXIT_CODE, CappedReader, ExecResult, on_cancel
from .channel import Channel, ChannelError, ChannelTimeout, frame
from .files import GuestFiles
from .guest import GuestKit

QEMU = "qemu-system-x86_64"
BOOT_TIMEOUT_S = {"kvm": 30.0, "tcg": 120.0}
ANSWER_GRACE_S = 15.0  # how long past a command's own timeout the agent may take to report it
REQUEST_TIMEOUT_S = 60.0
NO_DEADLINE_S = 365 * 86400.0
QMP_TIMEOUT_S = 60.0
MIGRATE_TIMEOUT_S = 600.0
KILL_WAIT_S = 10.0
MAX_FIELDS = 4000  # the agent reads at most 4095 NUL-separated fields per command
LOG_TAIL_BYTES = 2000
NET_DEVICE = "net0"


class VMError(SproutError):
    """A VM failed to boot, restore or answer; the message carries the end of its logs."""


@dataclass(frozen=True)
class VMLimits:
    vcpus: int = 1
    memory_mb: int = 512
    network: bool = False  # a virtio-net device on QEMU's user-mode network (else only loopback)


def choose_accel(requested: str = "auto") -> tuple[str, str]:
    """(accelerator, why). `auto` takes KVM only where it runs stock guest kernels: with kvm_intel or
    kvm_amd loaded. PVM's /dev/kvm (kvm_pvm, a host that is itself a VM) runs only PVM-built guest
    kernels, and Debian's hangs at boot there, so such hosts emulate (TCG)."""
    if requested in ("kvm", "tcg"):
        return requested, f"asked for {requested}"
    if requested != "auto":
        raise VMError(f"unknown accelerator {requested!r}: use kvm, tcg or auto")
    if not os.path.exists("/dev/kvm"):
        return "tcg", "no /dev/kvm: emulating with TCG"
    if any(os.path.isdir(f"/sys/module/{m}") for m in ("kvm_intel", "kvm_amd")):
        if not os.access("/dev/kvm", os.R_OK | os.W_OK):  # a user outside the kvm group
            return "tcg", "/dev/kvm is not open to this user (add it to the kvm group): emulating with TCG"
        return "kvm", "/dev/kvm with hardware virtualization"
    if os.path.isdir("/sys/module/kvm_pvm"):
        return "tcg", "/dev/kvm is PVM (kvm_pvm), which does not boot Debian's kernel: emulating with TCG"
    return "tcg", "/dev/kvm without kvm_intel or kvm_amd: emulating with TCG"


class MicroVM:
    """A handle on a running VM. `boot` starts one; `attach` finds one another process started."""

    def __init__(self, run_dir: Path, pid: int, accel: str, env: dict[str, str] | None = None):
        self.run_dir, self.pid, self.accel = run_dir, pid, accel
        self.env = env or {}  # what every command gets beneath its own (the host's trust settings)

    @classmethod
    def boot(cls, kit: GuestKit, disk: Path, run_dir: Path, *, limits: VMLimits = VMLimits(),
             accel: str = "auto", incoming: Path | None = None, netns: str | None = None,
             env: dict[str, str] | None = None, keep_disk: bool = False) -> "MicroVM":
        """Starts QEMU on `disk` and waits until its agent answers. With `incoming`, the VM resumes
        that memory image (saved with the same disk) instead of booting its kernel. QEMU runs in the
        network namespace `netns` when given: its user-mode network reaches out from there. Every
        command gets `env` beneath its own (kept in vm.json, for any process that attaches).
        `keep_disk`: the guest's writes go to a temporary file of QEMU's, never to `disk`."""
        chosen, _ = choose_accel(accel)
        run_dir.mkdir(parents=True, exist_ok=True)
        with _locked(run_dir, "boot"):
            if MicroVM.attach(run_dir) is not None:
                raise VMError(f"a VM already runs in {run_dir}")
            for name in ("qmp.sock", "agent.sock", "console.log", "qemu.pid", "vm.json"):
                (run_dir / name).unlink(missing_ok=True)
            enter = ["nsenter", f"--net={netns}"] if netns else []
            started = subprocess.run(enter + _qemu_argv(kit, disk, run_dir, limits, chosen, incoming, keep_disk),
                                     stdin=subprocess.DEVNULL, capture_output=True, text=True)
            if started.returncode != 0:
                raise VMError(f"QEMU did not start: {started.stderr.strip()}")
            vm = cls(run_dir, int((run_dir / "qemu.pid").read_text()), chosen, env)
            try:
                vm._started(incoming is not None, BOOT_TIMEOUT_S[chosen])
            except BaseException:
                vm.kill()
                raise
        return vm

    def _started(self, incoming: bool, timeout_s: float) -> None:
        start = _process_start(self.pid)
        if start is None:
            raise self._failure("QEMU exited as it started")
        state = {"pid": self.pid, "start": start, "accel": self.accel, "env": self.env}
        (self.run_dir / "vm.json").write_text(json.dumps(state))
        deadline = time.monotonic() + timeout_s
        if incoming:
            self._resume_incoming(deadline)
        with self._agent(deadline - time.monotonic()):
            pass
        self._silence_console()

    @classmethod
    def attach(cls, run_dir: Path) -> "MicroVM | None":
        """The VM running in `run_dir`, or None when it is not running."""
        try:
            state = json.loads((run_dir / "vm.json").read_text())
            if state["start"] is not None and _process_start(state["pid"]) == state["start"]:
                return cls(run_dir, state["pid"], state["accel"], state.get("env"))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    @property
    def alive(self) -> bool:
        return MicroVM.attach(self.run_dir) is not None

    # ---------------------------------------------------------------- QMP

    @contextmanager
    def _qmp(self) -> Iterator[QEMUMonitorProtocol]:
        """QEMU's monitor, one client at a time; its errors become VMErrors with the VM's logs."""
        with _locked(self.run_dir, "qmp"):
            monitor = QEMUMonitorProtocol(str(self.run_dir / "qmp.sock"))
            try:
                monitor.connect()
                monitor.settimeout(QMP_TIMEOUT_S)
                yield monitor
            except (QMPError, OSError, EOFError) as e:
                raise self._failure(f"QEMU's monitor failed: {type(e).__name__}: {e}") from None
            finally:
                monitor.close()

    def _resume_incoming(self, deadline: float) -> None:
        """Waits for the memory image to load; a VM saved while paused (as `save_memory` does) loads
        paused, and is resumed here."""
        self._wait_for(self.run_dir / "qmp.sock", deadline)
        with self._qmp() as qmp:
            while (status := _query(qmp, "query-status")["status"]) == "inmigrate":
                if time.monotonic() > deadline or not self.alive:
                    raise self._failure("loading the memory image did not finish")
                time.sleep(0.01)
            if status != "running":
                qmp.cmd("cont")

    def flush(self) -> None:
        """The guest writes back its filesystems' dirty data to its disk (`sync`); nothing is frozen."""
        self._request("S")

    def save_memory(self, dest: Path, while_paused: Callable[[], None]) -> None:
        """Has the guest flush its filesystems (so the disk alone is recent too: a restart without
        the memory loses little), pauses the VM (which drains its disk), runs `while_paused` (the
        caller snapshots the disk there), writes RAM and device state to `dest` with QEMU's migration
        stream, and resumes it. The disk snapshot and `dest` describe the same instant."""
        self.flush()
        with _locked(self.run_dir, "snapshot"), self._qmp() as qmp:
            qmp.cmd("stop")
            try:
                while_paused()
                qmp.cmd("migrate-set-parameters", **{"max-bandwidth": 1 << 40})
                qmp.cmd("migrate", uri=f"exec:cat > {shlex.quote(str(dest))}")
                deadline = time.monotonic() + MIGRATE_TIMEOUT_S
                while (status := _query(qmp, "query-migrate")).get("status") != "completed":
                    if status.get("status") in ("failed", "cancelled") or time.monotonic() > deadline:
                        raise VMError(f"saving the VM's memory failed: {status.get('error-desc', status)}")
                    time.sleep(0.01)
            except BaseException:
                with suppress(QMPError, OSError, EOFError):
                    qmp.cmd("cont")
                raise
            qmp.cmd("cont")

    def _silence_console(self) -> None:
        """Once the agent answers, the serial console (the boot's log) stops being written: root in the
        guest could otherwise fill the host's disk through it."""
        with self._qmp() as qmp:
            qmp.cmd("chardev-change", id="serial0", backend={"type": "null", "data": {}})

    def set_link(self, up: bool) -> None:
        """The guest's network link up or down (its carrier, as a cable plugged in or pulled)."""
        with self._qmp() as qmp:
            qmp.cmd("set_link", name=NET_DEVICE, up=up)

    def pause(self) -> None:
        """Stops the guest's CPUs (a test's stand-in for a wedged guest)."""
        with self._qmp() as qmp:
            qmp.cmd("stop")

    # ---------------------------------------------------------------- the agent

    @contextmanager
    def _agent(self, within_s: float) -> Iterator[Channel]:
        """A connection to the agent, one client at a time, checked with a ping whose token it echoes
        within `within_s` of getting the connection: what a previous client left unread is skipped.
        A guest that does not answer in time is killed."""
        with _locked(self.run_dir, "agent"):
            deadline = time.monotonic() + within_s
            self._wait_for(self.run_dir / "agent.sock", deadline)
            sock = socket.socket(socket.AF_UNIX)
            try:
                try:
                    sock.connect(str(self.run_dir / "agent.sock"))
                except OSError as e:
                    raise self._failure(f"cannot connect to the agent: {e}") from None
                channel = Channel(sock, lambda: self.alive)
                token = secrets.token_hex(8).encode()
                try:  # only the channel's errors are the VM's: the caller's own (host files) pass through
                    channel.send("P", token, deadline)
                    channel.skip_to(frame("k", token), deadline, "waiting for the agent")
                    yield channel
                except ChannelTimeout as e:
                    self.kill()
                    raise self._failure(f"{e}; it was killed") from None
                except ChannelError as e:
                    raise self._failure(str(e)) from None
            finally:
                sock.close()

    def _ask(self, channel: Channel, kind: str, payload: bytes = b"") -> None:
        channel.send(kind, payload)
        answer, body = channel.receive(time.monotonic() + REQUEST_TIMEOUT_S, f"request {kind}")
        if answer != "k":
            raise VMError(f"the guest agent refused: {body.decode(errors='replace')[:500]}")

    def _request(self, kind: str, payload: bytes = b"") -> None:
        with self._agent(REQUEST_TIMEOUT_S) as channel:
            self._ask(channel, kind, payload)

    def exec(self, argv: list[str], *, cwd: str = "/", env: dict[str, str] | None = None, user: str = "0",
             timeout: float | None = None, max_output: int = DEFAULT_MAX_OUTPUT,
             cancel: threading.Event | None = None) -> ExecResult:
        """Runs argv in the guest; stdout and stderr merged and capped as the container backend does.
        Setting `cancel` kills what the command started, as its timeout would (it then reports timed out)."""
        env = self.env | (env or {})
        timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000))
        fields = [cwd, user, str(timeout_ms), str(len(env)), *(f"{k}={v}" for k, v in env.items()), *argv]
        if any("\0" in field for field in fields):
            raise VMError("a command, its cwd, user or environment contains a NUL byte")
        if len(fields) > MAX_FIELDS:
            raise VMError(f"{len(fields)} arguments and environment variables: the agent takes {MAX_FIELDS}")
        reader = CappedReader(max_output)
        allowed = timeout + ANSWER_GRACE_S if timeout is not None else NO_DEADLINE_S
        with self._agent(min(allowed, REQUEST_TIMEOUT_S)) as channel:
            if cancel is not None and cancel.is_set():  # cancelled while it waited for the agent
                return ExecResult.cancelled_before_start()
            started = time.monotonic()
            deadline = started + allowed
            channel.send("R", b"\0".join(f.encode() for f in fields) + b"\0")
            with on_cancel(cancel, lambda: channel.interrupt("C"), "vm-cancel"):
                while (received := channel.receive(deadline, "running a command"))[0] == "o":
                    reader.feed(received[1])
        kind, body = received
        if kind != "x":
            raise VMError(f"the guest agent refused the command: {body.decode(errors='replace')[:500]}")
        try:
            code, timed_out = (int(n) for n in body.split())
        except ValueError:
            raise VMError(f"the guest agent answered {body[:100]!r} to a command") from None
        output, truncated = reader.text()
        return ExecResult(output=output, exit_code=TIMEOUT_EXIT_CODE if timed_out else code,
                          duration=time.monotonic() - started, timed_out=bool(timed_out), truncated=truncated)

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """The guest's root filesystem flushed and frozen (FIFREEZE) while the body runs. The agent's
        connection is held throughout: no command starts (and blocks on the frozen filesystem)
        between the freeze and the thaw."""
        with _locked(self.run_dir, "snapshot"), self._agent(REQUEST_TIMEOUT_S) as channel:
            self._ask(channel, "F")
            try:
                yield
            finally:
                self._ask(channel, "T")

    @contextmanager
    def files(self) -> Iterator[GuestFiles]:
        """The guest's files for one transfer (the agent serves nothing else meanwhile)."""
        with self._agent(REQUEST_TIMEOUT_S) as channel:
            yield GuestFiles(channel)

    def set_identity(self, hostname: str, machine_id: str | None = None) -> None:
        """A new hostname, machine id and 32 bytes of entropy, credited and reseeded at once: what a
        branch of a memory image needs so that it does not repeat its siblings."""
        machine_id = machine_id or uuid.uuid4().hex
        self._request("I", hostname.encode() + b"\0" + machine_id.encode() + b"\0" + secrets.token_bytes(32))

    # ---------------------------------------------------------------- the end

    def kill(self) -> None:
        """Stops the VM at once (its disk stays as it is)."""
        if _process_start(self.pid) is not None:
            with suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            deadline = time.monotonic() + KILL_WAIT_S
            while _process_start(self.pid) is not None and time.monotonic() < deadline:
                time.sleep(0.01)
        for name in ("qmp.sock", "agent.sock", "vm.json"):
            (self.run_dir / name).unlink(missing_ok=True)

    # ---------------------------------------------------------------- helpers

    def _wait_for(self, path: Path, deadline: float) -> None:
        while not path.exists():
            if _process_start(self.pid) is None:
                raise self._failure("QEMU exited")
            if time.monotonic() > deadline:
                raise self._failure(f"QEMU did not open {path.name}")
            time.sleep(0.02)

    def _failure(self, what: str) -> VMError:
        qemu, console = _tail(self.run_dir / "qemu.log").strip(), _tail(self.run_dir / "console.log")
        return VMError(f"{what} (accelerator {self.accel}; {self.run_dir})"
                       + (f"\nQEMU: {qemu}" if qemu else "") + (f"\nconsole:\n{console}" if console else ""))


def _query(qmp: QEMUMonitorProtocol, command: str) -> dict[str, Any]:
    """A QMP query whose answer is an object."""
    answer = qmp.cmd(command)
    if not isinstance(answer, dict):
        raise QMPError(f"{command} answered {answer!r}, not an object")
    return answer


@contextmanager
def _locked(run_dir: Path, name: str) -> Iterator[None]:
    with open(run_dir / f"{name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def _process_start(pid: int) -> int | None:
    """The process's start time (which tells it from a later process given the same pid), or None
    when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return None if fields[0] == b"Z" else int(fields[19])


def _qemu_argv(kit: GuestKit, disk: Path, run_dir: Path, limits: VMLimits, accel: str,
               incoming: Path | None, keep_disk: bool = False) -> list[str]:
    argv = [
        QEMU, "-M", "microvm,acpi=on,pit=on,pic=on,rtc=on", "-accel", accel,
        "-cpu", "host" if accel == "kvm" else "max", "-smp", str(limits.vcpus), "-m", str(limits.memory_mb),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-daemonize",
        "-pidfile", str(run_dir / "qemu.pid"), "-D", str(run_dir / "qemu.log"),
        "-serial", f"file:{run_dir / 'console.log'}",
        "-kernel", str(kit.kernel), "-initrd", str(kit.initrd), "-append", _kernel_command_line(accel),
        "-drive", f"id=disk,file={disk},format=raw,if=none,cache=writeback,discard=unmap"
                  + (",snapshot=on" if keep_disk else ""),
        "-device", "virtio-blk-device,drive=disk",
        "-device", "virtio-serial-device",
        "-chardev", f"socket,id=agent,path={run_dir / 'agent.sock'},server=on,wait=off",
        "-device", "virtserialport,chardev=agent,name=sprout.agent",
        "-qmp", f"unix:{run_dir / 'qmp.sock'},server=on,wait=off",
    ]
    if limits.network:
        argv += ["-netdev", f"user,id={NET_DEVICE}", "-device", f"virtio-net-device,netdev={NET_DEVICE}"]
    if incoming is not None:
        argv += ["-incoming", f"exec:cat {shlex.quote(str(incoming))}"]
    return argv


def _kernel_command_line(accel: str) -> str:
    line = "console=ttyS0 quiet panic=-1 reboot=t"
    if accel == "tcg":
        # Under emulation the guest's calibration of its TSC against the PIT races the emulator and
        # sometimes fails, and the boot then hangs. The emulated TSC runs at the host's rate: say it.
        line += f" tsc_early_khz={_host_tsc_khz()} tsc=reliable"
        # The kernel's crypto self-tests cost ~1 s of CPU per boot under emulation (a fifth of it); they
        # check the kernel's own algorithms, which guard nothing of the host's.
        line += " cryptomgr.notests"
    return line


def _host_tsc_khz() -> int:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    raise VMError("cannot read this host's clock rate from /proc/cpuinfo (needed to emulate a VM)")

