"""Shared fixtures: a real btrfs store and real podman (set up by ops/setup_podman.sh)."""

import json
import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from pathlib import Path

import httpx
import pytest

from sprout import rootless
from sprout.sandbox import Store, btrfs
from sprout.sandbox.errors import InUseError
from sprout.sandbox.podman import command as podman_command
from sprout.sandbox.store import default_root

REPO = Path(__file__).resolve().parents[1]
RUNTIME_BIN = REPO / "runtime" / "sprout-runtime"
PYTHON_IMAGE = "docker.io/library/python:3.11-slim"
DEBIAN_IMAGE = "docker.io/library/debian:bookworm"
# A process whose main thread exits at once while another thread runs on: it reads as a zombie in /proc
MAIN_THREAD_EXITS = """\
import ctypes, threading, time
def run():
    while True:
        time.sleep(0.05)
threading.Thread(target=run).start()
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit ends the calling thread only
"""

# A process that vforks a child which stops itself before its exec: the parent waits for the child (state D)
# and cannot stop meanwhile. Only a test may let a vfork child run Python; the parent never resumes here.
VFORK_CHILD_STOPS = """\
import ctypes, signal
libc = ctypes.CDLL(None)
if libc.vfork() == 0:
    getattr(libc, "raise")(signal.SIGSTOP)
    libc._exit(0)
"""


def running_thread_names(sandbox) -> list[str]:
    """The names (comm) of the threads running in the sandbox, read inside it. A killed process lingers as a
    zombie until the sandbox's init reaps it, which takes longer on a busy host; it runs nothing, so it is
    left out, as its dead threads are."""
    names = []
    for line in sandbox.exec("cat /proc/[0-9]*/task/*/stat").output.splitlines():
        name, _, rest = line.partition(" (")[2].rpartition(") ")
        if rest[:1] not in ("Z", "X"):
            names.append(name)
    return names


def pytest_configure(config: pytest.Config) -> None:
    """A user without root runs the tests inside podman's user namespace, as the `sprout` command runs."""
    rootless.enter()


# The files that take longest (from CI's durations), run first: pytest-xdist hands whole files out in
# collection order (--dist loadfile), and a long file handed out last is the suite's tail.
LONGEST_FIRST = (
    "tests/method/test_evaluate.py", "tests/rl_driver/test_driver.py", "tests/sandbox/test_microvm.py",
    "tests/tasks/test_swe_rebench.py", "tests/agent/test_run.py", "tests/rl_driver/test_search.py",
    "tests/sandbox/test_sandbox.py", "tests/method/test_parallel.py", "tests/services/test_services.py",
    "tests/services/test_litellm_proxy.py", "tests/runstore/test_worker_lifecycle.py", "tests/method/test_view.py",
    "tests/method/test_worker_churn.py", "tests/sandbox/test_network_switch.py",
    "tests/rl_driver/test_swe_driver.py", "tests/tasks/test_gate.py", "tests/sandbox/test_host_trust.py",
    "tests/test_cli_errors.py", "tests/services/test_rl_driver_service.py", "tests/method/test_evaluate_runstore.py",
    "tests/tasks/test_grade.py", "tests/sandbox/test_hostile.py", "tests/sandbox/test_cli_doctor.py",
    "tests/test_cli.py", "tests/method/test_benchmark.py", "tests/rl_driver/test_host_lost.py",
    "tests/runstore/test_api.py", "tests/tasks/test_images.py", "tests/tasks/test_benchmark_like.py",
    "tests/rl_driver/test_prepare_hosts.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (LONGEST_FIRST); tests/rootless/ is what only a user without root runs
    (.ci/rootless): as root it is deselected, and so are the `second_user` tests where no first user is
    named (SPROUT_CI_FIRST_USER)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))  # stable: files stay whole

    def elsewhere(item: pytest.Item) -> bool:
        if not rootless.entered():
            return item.nodeid.startswith("tests/rootless/")
        return item.get_closest_marker("second_user") is not None and "SPROUT_CI_FIRST_USER" not in os.environ

    if deselected := [item for item in items if elsewhere(item)]:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not elsewhere(item)]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Under CI (`CI` set, as .ci/run does) a skipped test is a failure: a green run proves every test ran."""
    report = yield
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which counts as a failure: {reason}"
    return report


@pytest.fixture(scope="session")
def base_store() -> Store:
    return Store()


def _podman_image_ids() -> set[str]:
    listed = subprocess.run([*podman_command(), "images", "--all", "--quiet", "--no-trunc"], capture_output=True,
                            text=True, check=True)
    return set(listed.stdout.split())


def _has_store_and_podman() -> bool:
    return btrfs.is_btrfs(default_root()) and shutil.which("podman") is not None


_IMAGES_BEFORE = pytest.StashKey[tuple[set[str], set[str]]]()
_WORKER_STORE = pytest.StashKey[Path]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """With pytest-xdist (`-n N`, the default: pyproject's addopts) each worker gets a store of its own,
    `<store>/test-stores/xdist-<controller pid>-<worker>` (two sessions on one host never share one),
    through SPROUT_STORE, which the processes its tests start
    inherit: a test's "what did I make" (the sandboxes and checkpoints listed before and after) then
    sees only its own worker's, and reaping and gc act on one worker's store. The process that is not a
    worker (the controller, or a run with `-n 0`) notes the images there are before the session and
    removes the worker stores that sessions no longer running left behind."""
    if worker := os.environ.get("PYTEST_XDIST_WORKER"):
        if _has_store_and_podman():
            name = f"xdist-{os.getppid()}-{worker}"  # the workers are the controller's children
            session.config.stash[_WORKER_STORE] = default_root() / "test-stores" / name
            os.environ["SPROUT_STORE"] = str(session.config.stash[_WORKER_STORE])
        return
    if _has_store_and_podman():
        for stale in sorted((default_root() / "test-stores").glob("xdist-*")):
            if not _running(stale.name.split("-")[1]):
                drop_store(stale)
        session.config.stash[_IMAGES_BEFORE] = ({im.key for im in Store().images()}, _podman_image_ids())


def _running(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def pytest_sessionfinish(session: pytest.Session) -> None:
    """After the session, removes the images it made, in the store and in podman: task environments
    built from tests' Dockerfiles and images pulled from the session's registry are new in every run
    (~300 MB each), and a host that runs the suite daily would otherwise fill its store. The suite is
    taken to have the host to itself (as in CI), so while another session runs (its worker stores say so)
    nothing is removed: its images would be among the new ones. (The workers' stores go whole, with what is
    in them: see `worker_store`.)"""
    if os.environ.get("PYTEST_XDIST_WORKER") or _IMAGES_BEFORE not in session.config.stash:
        return
    others = {s.name.split("-")[1] for s in (default_root() / "test-stores").glob("xdist-*")} - {str(os.getpid())}
    if any(_running(pid) for pid in others):
        print("\nanother test session is running: the images made meanwhile are left in place")
        return
    images_before, podman_before = session.config.stash[_IMAGES_BEFORE]
    store = Store()
    for image in store.images():
        if image.key not in images_before:
            with suppress(InUseError):  # an image a leaked sandbox still uses stays
                store.remove_image(image.key)
    if made := _podman_image_ids() - podman_before:
        subprocess.run([*podman_command(), "rmi", "--force", "--ignore", *made], capture_output=True)


@pytest.fixture(scope="session", autouse=True)
def worker_store(pytestconfig: pytest.Config) -> Iterator[None]:
    """Under pytest-xdist, the worker's own store (see pytest_sessionstart): made with the main store's
    guest kernel, and removed whole after the session."""
    if (root := pytestconfig.stash.get(_WORKER_STORE, None)) is None:
        yield
        return
    drop_store(root)
    kernel = root.parents[1] / "microvm" / "kernel"
    if kernel.is_dir():
        shutil.copytree(kernel, root / "microvm" / "kernel", symlinks=True)
    yield
    drop_store(root)


def drop_store(root: Path) -> None:
    """Removes the store at `root` whole: its sandboxes (containers and VMs), checkpoints, images and
    every subvolume below it. For stores the tests made."""
    if not root.exists():
        return
    store = Store(root)
    for sandbox in store.sandboxes():
        sandbox.destroy()
    for checkpoint in sorted(store.checkpoints(), key=lambda c: c.created, reverse=True):  # branches first
        store.remove_checkpoint(checkpoint.id, force=True)
    store.meta.close()
    _delete_tree(root)


def _delete_tree(path: Path) -> None:
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            if btrfs.is_subvolume(child):
                btrfs.delete(child)
            else:
                _delete_tree(child)
    shutil.rmtree(path)


@contextmanager
def removing_what_is_made(store: Store) -> Iterator[Store]:
    """Yields `store`; afterwards destroys every sandbox and removes every checkpoint made meanwhile."""
    sandboxes, checkpoints = {s.id for s in store.sandboxes()}, {c.id for c in store.checkpoints()}
    try:
        yield store
    finally:
        for sandbox in store.sandboxes():
            if sandbox.id not in sandboxes:
                sandbox.destroy()
        for checkpoint in store.checkpoints():
            if checkpoint.id not in checkpoints:
                store.remove_checkpoint(checkpoint.id, force=True)


# For what every backend must do alike: the store fixture with containers and with microVMs.
every_backend = pytest.mark.parametrize("store", ["runtime", "podman-exec", "microvm"], indirect=True)


def _store_for(kind: str, base_store: Store) -> Store:
    assert RUNTIME_BIN.exists(), "run ops/setup_podman.sh first (it writes runtime/sprout-runtime)"
    if kind == "microvm":
        return Store(base_store.root, backend="microvm")
    return Store(base_store.root, runtime_bin=RUNTIME_BIN if kind == "runtime" else None)


@pytest.fixture(params=["runtime", "podman-exec"])
def store(request, base_store: Store):
    """The store, once with commands through sprout-runtime and once through `podman exec` (and, in
    tests marked `every_backend`, once more with microVMs); every sandbox and checkpoint a test makes
    is removed afterwards."""
    with removing_what_is_made(_store_for(request.param, base_store)) as st:
        yield st


@pytest.fixture
def other_store(tmp_path, base_store: Store):
    """A second btrfs filesystem (its own loop file), as another host's store would be; rootless, where
    nothing can be mounted, a second store inside the user's own (on its filesystem)."""
    if rootless.active():
        root = base_store.root / f"test-other-{uuid.uuid4().hex[:8]}"
        store = Store(root, runtime_bin=RUNTIME_BIN)
        yield store
        drop_store(root)
        return
    image, mount = tmp_path / "other.img", tmp_path / "other"
    subprocess.run(["truncate", "-s", "3G", str(image)], check=True)
    subprocess.run(["mkfs.btrfs", "-q", str(image)], check=True, capture_output=True)
    mount.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    store = Store(mount, runtime_bin=RUNTIME_BIN)
    yield store
    for sandbox in store.sandboxes():
        sandbox.destroy()
    store.meta.close()
    subprocess.run(["umount", str(mount)], check=True)


def bridge_gateway() -> str:
    """The host's address on the sandboxes' bridge (podman's network), which a connected sandbox reaches."""
    from sprout.sandbox.podman import network, podman

    return json.loads(podman("network", "inspect", network()))[0]["subnets"][0]["gateway"]


def free_port() -> int:
    """A port free now, for a server a test starts, taken below the kernel's ephemeral range: a port the
    kernel handed out (bind to port 0) may be given again meanwhile as the local port of any outgoing
    connection (another xdist worker's HTTP or PostgreSQL client), and the server then fails to bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 30) -> None:
    """Waits until the API process at `url` answers /health."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None and time.monotonic() < deadline, "the API did not start"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def turns_so_far(journal: Path) -> list:
    """The turns a running rollout has journaled (none while the journal is missing, empty or headless)."""
    from sprout.agent.journal import read_journal
    from sprout.sandbox.errors import SproutError

    try:
        return read_journal(journal).turns
    except SproutError:
        return []


@pytest.fixture(scope="session")
def local_registry():
    """A real registry (Debian's docker-registry) on 127.0.0.1:<free port> for the whole session, as
    tests.registry.LocalRegistry (`push`, `remove_local`, `ref`, `env`, ...). While it runs,
    $CONTAINERS_REGISTRIES_CONF points every podman (Sprout's own pulls included) at a registries.conf
    that lets it speak plain HTTP to it; the previous value is restored afterwards."""
    from tests.registry import LocalRegistry, RegistryError

    try:
        registry = LocalRegistry().start()
    except RegistryError as e:
        pytest.fail(f"local registry: {e}")
    previous = os.environ.get("CONTAINERS_REGISTRIES_CONF")
    os.environ.update(registry.env)
    try:
        yield registry
    finally:
        if previous is None:
            os.environ.pop("CONTAINERS_REGISTRIES_CONF", None)
        else:
            os.environ["CONTAINERS_REGISTRIES_CONF"] = previous
        registry.close()
