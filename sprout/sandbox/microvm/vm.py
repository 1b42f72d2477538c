"""One microVM: a QEMU `microvm` machine booted from a guest kit and a disk file, driven over QMP
(pause, memory snapshots) and over a virtio-serial port to its agent (commands, freeze, identity).

Files of a running VM live in its run directory: qmp.sock, agent.sock, console.log, qemu.pid.
"""

import os
import secrets
import shlex
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from qemu.qmp.legacy import QEMUMonitorProtocol

from ..errors import SproutError
from ..execution import DEFAULT_MAX_OUTPUT, TIMEOUT_EXIT_CODE, CappedReader, ExecResult
from .guest import GuestKit, clone_file

QEMU = "qemu-system-x86_64"
DISK_FILE, MEMORY_FILE = "disk.img", "memory.bin"
BOOT_TIMEOUT_S = {"kvm": 30.0, "tcg": 120.0}
ANSWER_GRACE_S = 15.0  # how long past a command's own timeout the agent may take to report it
NO_TIMEOUT_ANSWER_S = 24 * 3600.0
CONSOLE_TAIL_BYTES = 2000


class VMError(SproutError):
    """A VM failed to boot, restore or answer; the message carries the end of its console."""


@dataclass(frozen=True)
class VMLimits:
    vcpus: int = 1
    memory_mb: int = 512


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
        return "kvm", "/dev/kvm with hardware virtualization"
    if os.path.isdir("/sys/module/kvm_pvm"):
        return "tcg", "/dev/kvm is PVM (kvm_pvm), which does not boot Debian's kernel: emulating with TCG"
    return "tcg", "/dev/kvm without kvm_intel or kvm_amd: emulating with TCG"


class MicroVM:
    """A running VM. `boot` starts a fresh one; `restore` resumes a saved memory image."""

    def __init__(self, run_dir: Path, process: subprocess.Popen, accel: str):
        self.run_dir, self.process, self.accel = run_dir, process, accel
        self.qmp: QEMUMonitorProtocol | None = None
        self.agent: socket.socket | None = None

    @property
    def disk(self) -> Path:
        return self.run_dir / DISK_FILE

    @classmethod
    def boot(cls, kit: GuestKit, run_dir: Path, *, limits: VMLimits = VMLimits(), accel: str = "auto",
             incoming: Path | None = None) -> "MicroVM":
        """Starts QEMU on `run_dir/disk.img` (put there by the caller) and waits for the agent.
        With `incoming`, the VM resumes that memory image instead of booting its kernel."""
        chosen, _ = choose_accel(accel)
        for name in ("qmp.sock", "agent.sock", "console.log"):
            (run_dir / name).unlink(missing_ok=True)
        argv = _qemu_argv(kit, run_dir, limits, chosen, incoming)
        with open(run_dir / "qemu.log", "wb") as log:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                       start_new_session=True)
        vm = cls(run_dir, process, chosen)
        try:
            vm._connect(BOOT_TIMEOUT_S[chosen], expect_hello=incoming is None)
        except BaseException:
            vm.kill()
            raise
        return vm

    def _connect(self, timeout_s: float, *, expect_hello: bool) -> None:
        deadline = time.monotonic() + timeout_s
        self.qmp = QEMUMonitorProtocol(str(self._wait_for(self.run_dir / "qmp.sock", deadline)))
        self.qmp.connect()
        self.agent = socket.socket(socket.AF_UNIX)
        self.agent.connect(str(self._wait_for(self.run_dir / "agent.sock", deadline)))
        if expect_hello:
            kind, _ = self._receive(deadline, "boot")
        else:  # a restored agent is waiting for its next request
            self._resume_incoming(deadline)
            self._send("P")
            kind, _ = self._receive(deadline, "restore")
        if kind not in ("h", "k"):
            raise self._failure(f"the guest agent greeted with {kind!r}")

    def _resume_incoming(self, deadline: float) -> None:
        """Waits for the memory image to load; a VM saved while paused (as `save` does) loads paused."""
        while (status := self.qmp.cmd("query-status")["status"]) == "inmigrate":
            if time.monotonic() > deadline:
                raise self._failure("loading the memory image did not finish in time")
            time.sleep(0.01)
        if status != "running":
            self.qmp.cmd("cont")

    def _wait_for(self, path: Path, deadline: float) -> Path:
        while not path.exists():
            if self.process.poll() is not None:
                raise self._failure(f"QEMU exited with {self.process.returncode}")
            if time.monotonic() > deadline:
                raise self._failure(f"QEMU did not open {path.name}")
            time.sleep(0.02)
        return path

    # ---------------------------------------------------------------- the agent's channel

    def _send(self, kind: str, payload: bytes = b"") -> None:
        self.agent.sendall(len(payload).to_bytes(4, "big") + kind.encode() + payload)

    def _receive(self, deadline: float, doing: str) -> tuple[str, bytes]:
        head = self._read_exactly(5, deadline, doing)
        return chr(head[4]), self._read_exactly(int.from_bytes(head[:4], "big"), deadline, doing)

    def _read_exactly(self, size: int, deadline: float, doing: str) -> bytes:
        data = bytearray()
        while len(data) < size:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise self._failure(f"the VM did not answer in time ({doing}); it was killed")
            self.agent.settimeout(min(left, 1.0))
            try:
                chunk = self.agent.recv(size - len(data))
            except TimeoutError:
                if self.process.poll() is not None:
                    raise self._failure(f"QEMU exited with {self.process.returncode} ({doing})") from None
                continue
            if not chunk:
                raise self._failure(f"the agent's channel closed ({doing})")
            data += chunk
        return bytes(data)

    def _request(self, kind: str, payload: bytes = b"", timeout_s: float = 60.0) -> bytes:
        self._send(kind, payload)
        answer, body = self._receive(time.monotonic() + timeout_s, f"request {kind}")
        if answer != "k":
            raise VMError(f"the guest agent refused: {body.decode(errors='replace')}")
        return body

    def exec(self, argv: list[str], *, cwd: str = "/", env: dict[str, str] | None = None, user: str = "root",
             timeout: float | None = None, max_output: int = DEFAULT_MAX_OUTPUT) -> ExecResult:
        """Runs argv in the guest; stdout and stderr merged and capped as the container backend does."""
        env = env or {}
        fields = [cwd, user, str(int(timeout * 1000) if timeout else 0), str(len(env)),
                  *(f"{k}={v}" for k, v in env.items()), *argv]
        if any("\0" in field for field in fields):
            raise VMError("a command, its cwd, user or environment contains a NUL byte")
        started = time.monotonic()
        self._send("R", b"\0".join(f.encode() for f in fields) + b"\0")
        deadline = started + (timeout + ANSWER_GRACE_S if timeout else NO_TIMEOUT_ANSWER_S)
        reader = CappedReader(max_output)
        while True:
            kind, body = self._receive(deadline, "running a command")
            if kind == "o":
                reader.feed(body)
            elif kind == "x":
                code, timed_out = (int(n) for n in body.split())
                break
            else:
                raise VMError(f"the guest agent refused the command: {body.decode(errors='replace')}")
        output, truncated = reader.text()
        return ExecResult(output=output, exit_code=TIMEOUT_EXIT_CODE if timed_out else code,
                          duration=time.monotonic() - started, timed_out=bool(timed_out), truncated=truncated)

    def set_identity(self, hostname: str, machine_id: str | None = None) -> None:
        """A new hostname, machine id and 32 bytes of entropy: what a branch of a memory image needs
        so that it does not repeat its siblings."""
        machine_id = machine_id or uuid.uuid4().hex
        self._request("I", hostname.encode() + b"\0" + machine_id.encode() + b"\0" + secrets.token_bytes(32))

    # ---------------------------------------------------------------- snapshots

    def save(self, dest: Path, *, memory: bool) -> None:
        """Writes dest/disk.img (a reflink) and, with `memory`, dest/memory.bin (QEMU's migration
        stream: RAM and device state). Without memory the guest's filesystems are frozen for the copy;
        with it the VM is paused, which drains and flushes its disk, so the two files agree."""
        if not memory:
            self._request("F")
            try:
                clone_file(self.disk, dest / DISK_FILE)
            finally:
                self._request("T")
            return
        self.qmp.cmd("stop")
        try:
            clone_file(self.disk, dest / DISK_FILE)
            self.qmp.cmd("migrate-set-parameters", **{"max-bandwidth": 1 << 40})
            self.qmp.cmd("migrate", uri=f"exec:cat > {shlex.quote(str(dest / MEMORY_FILE))}")
            self._wait_migration()
        finally:
            self.qmp.cmd("cont")

    def _wait_migration(self) -> None:
        while True:
            status = self.qmp.cmd("query-migrate")
            state = status.get("status")
            if state == "completed":
                return
            if state in ("failed", "cancelled"):
                raise VMError(f"saving the VM's memory failed: {status.get('error-desc', state)}")
            time.sleep(0.01)

    # ---------------------------------------------------------------- the end

    def kill(self) -> None:
        """Stops the VM at once (its disk stays as it is)."""
        for channel in (self.agent, self.qmp):
            if channel is not None:
                try:
                    channel.close()
                except OSError:
                    pass
        self.agent = self.qmp = None
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def _failure(self, what: str) -> VMError:
        console = self.run_dir / "console.log"
        tail = console.read_bytes()[-CONSOLE_TAIL_BYTES:].decode(errors="replace") if console.exists() else ""
        log = (self.run_dir / "qemu.log")
        qemu = log.read_text(errors="replace").strip() if log.exists() else ""
        return VMError(f"{what} (accelerator {self.accel}; {self.run_dir})"
                       + (f"\nQEMU: {qemu}" if qemu else "") + (f"\nconsole:\n{tail}" if tail else ""))


def _qemu_argv(kit: GuestKit, run_dir: Path, limits: VMLimits, accel: str, incoming: Path | None) -> list[str]:
    argv = [
        QEMU, "-M", "microvm,acpi=on,pit=on,pic=on,rtc=on", "-accel", accel,
        "-cpu", "host" if accel == "kvm" else "max", "-smp", str(limits.vcpus), "-m", str(limits.memory_mb),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-serial", f"file:{run_dir / 'console.log'}",
        "-kernel", str(kit.kernel), "-initrd", str(kit.initrd),
        "-append", _kernel_command_line(accel),
        "-drive", f"id=disk,file={run_dir / DISK_FILE},format=raw,if=none,cache=writeback,discard=unmap",
        "-device", "virtio-blk-device,drive=disk",
        "-device", "virtio-serial-device",
        "-chardev", f"socket,id=agent,path={run_dir / 'agent.sock'},server=on,wait=off",
        "-device", "virtserialport,chardev=agent,name=sprout.agent",
        "-qmp", f"unix:{run_dir / 'qmp.sock'},server=on,wait=off",
        "-pidfile", str(run_dir / "qemu.pid"),
    ]
    if incoming is not None:
        argv += ["-incoming", f"exec:cat {shlex.quote(str(incoming))}"]
    return argv



def _kernel_command_line(accel: str) -> str:
    line = "console=ttyS0 quiet panic=-1 reboot=t"
    if accel == "tcg":
        # Under emulation the guest's calibration of its TSC against the PIT races the emulator and
        # sometimes fails, and the boot then hangs. The emulated TSC runs at the host's rate: say it.
        line += f" tsc_early_khz={_host_tsc_khz()} tsc=reliable"
    return line


def _host_tsc_khz() -> int:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    raise VMError("cannot read this host's clock rate from /proc/cpuinfo (needed to emulate a VM)")
