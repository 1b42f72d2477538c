"""Stock podman, configured for these hosts: runc, cgroupfs, rlimits within the host's hard limits."""

import functools
import json
import resource
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import rootless
from ..settings import settings
from . import shell
from .errors import CommandError, ImageNotFound

NOFILE_WANTED = 1 << 20
NPROC_WANTED = 32768  # podman caps its own (hence conmon and runc) nproc limit here
ADDRESS_SET = "3"  # /sys/class/net/IF/addr_assign_type of an address set by hand (NET_ADDR_SET)
NETWORK_KEEPER = "sprout-network-keeper"


def ulimit_flags() -> list[str]:
    """`--ulimit` values at or below the hard limits (podman's defaults exceed them here and fail)."""
    flags = []
    for name, res, wanted in (("nofile", resource.RLIMIT_NOFILE, NOFILE_WANTED),
                              ("nproc", resource.RLIMIT_NPROC, NPROC_WANTED)):
        hard = resource.getrlimit(res)[1]
        value = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
        flags += ["--ulimit", f"{name}={value}:{value}"]
    return flags


def command() -> list[str]:
    """`podman` with the OCI runtime and cgroup manager Sprout runs sandboxes with ($SPROUT_OCI_RUNTIME,
    $SPROUT_CGROUP_MANAGER)."""
    config = settings()
    return ["podman", "--runtime", config.oci_runtime, "--cgroup-manager", config.cgroup_manager,
            "--events-backend", "file"]


def network() -> str:
    """The podman network sandboxes with network are on ($SPROUT_PODMAN_NETWORK)."""
    return settings().podman_network


def podman(*args: str, **kwargs) -> str:
    return shell.output([*command(), *args], **kwargs)


@dataclass
class ImageConfig:
    """What `podman image inspect` says a container of the image should run with."""

    image_id: str
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


def _asked_once[T](question: Callable[[], T]) -> Callable[[], T]:
    """`functools.cache` for a question to podman whose answer stays for the process's life, asked once
    even when threads ask at once (32 samples starting together would each run `podman info`: 0.28 CPU-s
    with the dpkg queries it makes)."""
    answer = functools.cache(question)
    lock = threading.Lock()

    @functools.wraps(question)
    def ask() -> T:
        with lock:
            return answer()

    return ask


@_asked_once
def _images_file() -> Path | None:
    """The file podman rewrites whenever an image is added, removed or tagged (None: not found)."""
    proc = shell.run([*command(), "info", "--format", "{{.Store.GraphRoot}} {{.Store.GraphDriverName}}"], check=False)
    root, _, driver = proc.stdout.decode().strip().partition(" ")
    path = Path(root) / f"{driver}-images" / "images.json"
    return path if proc.returncode == 0 and path.is_file() else None


_inspected: dict[str, tuple[tuple[int, int], dict | None]] = {}  # name -> (images file version, what podman said)
_inspecting: dict[str, threading.Lock] = {}  # name -> held while podman is asked about it


def image_info(name: str) -> dict | None:
    """`podman image inspect NAME`, or None when podman has no such image. A sample asks this of its task
    image four times (at ~50 ms of CPU each), so answers are kept until podman's images change, and
    threads asking about one image at once ask podman once."""
    with _inspecting.setdefault(name, threading.Lock()):
        version = _images_version()
        if version is not None and (known := _inspected.get(name)) and known[0] == version:
            return known[1]
        proc = shell.run([*command(), "image", "inspect", name], check=False)
        info = json.loads(proc.stdout)[0] if proc.returncode == 0 else None
        if version is not None:
            _inspected[name] = (version, info)
        return info


def _images_version() -> tuple[int, int] | None:
    """The images file's (mtime, size), None when it cannot be read (nothing is kept then)."""
    images_file = _images_file()
    if images_file is None:
        return None
    try:
        stat = images_file.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def inspect_image(name: str) -> ImageConfig:
    info = image_info(name)
    if info is None:
        raise ImageNotFound(f"podman has no image {name!r} (build it, `podman import` it, or run "
                            "`sprout sandbox images bootstrap` for the base images)")
    config = info.get("Config") or {}
    env = dict(item.partition("=")[::2] for item in config.get("Env") or [])
    return ImageConfig(image_id=info["Id"], env=env, workdir=config.get("WorkingDir") or "/",
                       user=config.get("User") or "", entrypoint=config.get("Entrypoint") or [],
                       cmd=config.get("Cmd") or [], names=info.get("RepoTags") or [])


def pull(reference: str) -> str | None:
    """Runs `podman pull` (bounded by SPROUT_PULL_TIMEOUT); None on success, else the registry's answer
    (podman's last error line)."""
    timeout = settings().pull_timeout
    try:
        proc = subprocess.run([*command(), "pull", "--quiet", reference], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"the pull took longer than {timeout:g}s (SPROUT_PULL_TIMEOUT)"
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    last = next((line for line in reversed(lines) if line.startswith("Error")), lines[-1] if lines else "")
    return " ".join(last.removeprefix("Error: ").split()) or f"podman pull exited with {proc.returncode}"


def image_layers(image_id: str) -> list[str]:
    """The digests of an image's layers' contents, bottom first ([] when podman no longer has it)."""
    info = image_info(image_id)
    return ((info.get("RootFS") or {}).get("Layers") or []) if info else []


@dataclass
class ContainerSpec:
    name: str
    rootfs: str
    env: dict[str, str]
    workdir: str
    user: str
    memory: str | None = None
    pids: int | None = None
    cpus: float | None = None
    network: bool = True
    labels: dict[str, str] = field(default_factory=dict)
    hostname: str = "sandbox"
    mounts: list[tuple[str, str, str]] = field(default_factory=list)  # (host path, container path, "ro")


def run_container(spec: ContainerSpec) -> str:
    """Starts a long-lived container on a rootfs directory; returns its id. Its main process is
    `sleep infinity` under podman's init, so it logs nothing: no log driver saves ~20 ms a start.
    Its environment is exactly `spec.env` (podman does not add the host's proxy variables)."""
    args = ["run", "-d", "--init", "--log-driver", "none", "--name", spec.name, "--hostname", spec.hostname,
            "--security-opt", "no-new-privileges", "--workdir", spec.workdir or "/", "--http-proxy=false",
            *ulimit_flags()]
    if spec.user:
        args += ["--user", spec.user]
    for key, value in spec.env.items():
        args += ["--env", f"{key}={value}"]
    for key, value in spec.labels.items():
        args += ["--label", f"{key}={value}"]
    if rootless.limits_apply():
        args += ["--memory", spec.memory] if spec.memory else []
        args += ["--pids-limit", str(spec.pids)] if spec.pids else []
        args += ["--cpus", str(spec.cpus)] if spec.cpus else []
    for source, target, options in spec.mounts:
        args += ["--volume", f"{source}:{target}:{options}"]
    args += ["--network", network() if spec.network else "none"]
    args += ["--rootfs", spec.rootfs, "sleep", "infinity"]
    if spec.network:
        keep_rootless_network()
    try:
        container_id = podman(*args, what="podman run", timeout=settings().start_timeout)
    except CommandError:
        remove_container(spec.name)
        raise
    if spec.network:
        pin_bridge_address()
    return container_id


def set_network(container: str, enabled: bool) -> None:
    """Connects the running container to the sandboxes' network, or disconnects it (it keeps only loopback)."""
    if enabled:
        keep_rootless_network()
    podman("network", "connect" if enabled else "disconnect", network(), container,
           what=f"podman network {'connect' if enabled else 'disconnect'}")
    if enabled:
        pin_bridge_address()


def pin_bridge_address() -> None:
    """Fixes the MAC address of the sandboxes' network's bridge at its present value. A Linux bridge whose address was
    never set takes the lowest of its ports' addresses, so it changes whenever a container joins or leaves
    (netavark makes the bridge with none set): the other containers' ARP entries for their gateway then
    point nowhere, and their traffic to the host and beyond is lost for seconds."""
    try:  # best effort: without it, sandboxes work as before; the bridge may even go meanwhile
        bridge = Path("/sys/class/net") / (bridge_name() or "-")
        if (bridge / "addr_assign_type").read_text().strip() != ADDRESS_SET:
            address = (bridge / "address").read_text().strip()
            shell.run(["ip", "link", "set", "dev", bridge.name, "address", address], check=False)
    except (CommandError, OSError, ValueError, LookupError):
        pass  # no bridge on the host (rootless networking, another driver), or no `ip`


@_asked_once
def keep_rootless_network() -> None:
    """Rootless: a container that stays on the sandboxes' network (catatonit pausing, on an empty rootfs).
    Rootless podman tears its network namespace down whenever it counts no running container on the
    network, and a container starting at that moment loses its interface (2.5% of starts, 4 at a time, lost
    it so); with one always there it never does. Asked once per process; best effort."""
    if not rootless.entered():
        return
    running = shell.run([*command(), "container", "inspect", "-f", "{{.State.Running}}", NETWORK_KEEPER], check=False)
    if running.returncode == 0 and running.stdout.decode().strip() == "true":
        return
    remove_container(NETWORK_KEEPER)
    root = rootless.runtime_dir() / "sprout-network-keeper"
    root.mkdir(parents=True, exist_ok=True)
    shell.run([*command(), "run", "-d", "--init", "--name", NETWORK_KEEPER, "--network", network(), "--log-driver",
               "none", *ulimit_flags(), "--rootfs", str(root), "/run/podman-init", "-P"], check=False)


def reconnect(container: str) -> None:
    """Connects again a container that podman records as connected while its network namespace has no
    interface but loopback: rootless podman loses one now and then when containers start at once (2.5% of
    starts, 4 at a time). The disconnect drops podman's record though its teardown fails on the missing
    interface; the connect makes a new one."""
    shell.run([*command(), "network", "disconnect", network(), container], check=False)
    set_network(container, True)


@_asked_once
def bridge_name() -> str | None:
    """The host interface of the sandboxes' network (e.g. podman0), None when it is not a bridge."""
    name = network()
    found = json.loads(podman("network", "inspect", name, what=f"podman network inspect {name}"))[0]
    return found.get("network_interface") if found.get("driver") == "bridge" else None


def connected(pid: int) -> bool:
    """Whether the network namespace of process `pid` has an interface besides loopback (what
    `set_network` adds and removes); False when the process is gone."""
    try:  # /proc/PID/net is the network namespace of PID
        interfaces = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    except OSError:
        return False
    return any(line.split(":")[0].strip() != "lo" for line in interfaces)


def remove_container(name: str) -> None:
    shell.run([*command(), "rm", "-f", "-t", "0", name], check=False)


def container_names(label: str) -> dict[str, str]:
    """name -> state of every container carrying the label (`key` or `key=value`)."""
    out = podman("ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}} {{.State}}")
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
