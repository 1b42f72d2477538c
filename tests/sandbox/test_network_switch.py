"""Switching a running sandbox's network, as phases do (an agent without network, a verifier with it),
with containers and microVMs alike."""

import socketserver
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from sprout.sandbox import SandboxStateError, Store, confinement
from sprout.sandbox.podman import bridge_name
from tests.conftest import DEBIAN_IMAGE, RUNTIME_BIN, bridge_gateway, every_backend, removing_what_is_made

# the interfaces besides loopback that carry a link: a container's eth0 while connected; a microVM's
# eth0 stays, with its link down while disconnected
LINKS_UP = ("for i in /sys/class/net/*; do [ ${i##*/} != lo ] && [ \"$(cat $i/carrier 2>/dev/null)\" = 1 ] "
            "&& echo up:${i##*/}; done; true")


class _Greeter(socketserver.ThreadingTCPServer):
    over: threading.Event | None


class _Greeting(socketserver.BaseRequestHandler):
    server: _Greeter

    def handle(self) -> None:
        over = self.server.over is not None and self.server.over.is_set()
        self.request.sendall(b"done.\n" if over else b"hello from the host\n")


@contextmanager
def greeter(address: str, over: threading.Event | None = None) -> Iterator[int]:
    """A TCP listener on the host at `address` that greets each connection (says "done." once `over` is
    set); yields its port."""
    server = _Greeter((address, 0), _Greeting)
    server.over = over
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@every_backend
def test_network_goes_off_and_on_again(store):
    sandbox = store.create_sandbox(DEBIAN_IMAGE, network=True)  # the bridge exists while a sandbox is on it
    gateway = bridge_gateway()
    with greeter(gateway) as port:
        probe = f"{LINKS_UP}; timeout 5 bash -c 'exec 3<>/dev/tcp/{gateway}/{port} && cat <&3'"

        def seen() -> tuple[bool, bool, bool]:
            output = sandbox.exec(probe).output
            return sandbox.network_enabled, "up:eth0" in output, "hello from the host" in output

        assert seen() == (True, True, True)
        sandbox.set_network(False)
        sandbox.set_network(False)  # already off: nothing to do
        assert seen() == (False, False, False)
        sandbox.set_network(True)
        sandbox.set_network(True)
        assert seen() == (True, True, True)


@every_backend
def test_a_sandbox_created_without_network_cannot_be_connected(store):
    sandbox = store.create_sandbox(DEBIAN_IMAGE, network=False)
    sandbox.set_network(False)
    with pytest.raises(SandboxStateError, match="created without network"):
        sandbox.set_network(True)
    assert not sandbox.network_enabled and "eth0" not in sandbox.exec("cat /proc/net/dev").output


@every_backend
def test_branches_and_restarts_keep_the_network_as_it_was_last_switched(store):
    sandbox = store.create_sandbox(DEBIAN_IMAGE, network=True)
    sandbox.set_network(False)  # an agent phase without network
    checkpoint = sandbox.checkpoint()
    branch = checkpoint.branch()
    assert not branch.network_enabled and "up:" not in branch.exec(LINKS_UP).output
    branch.set_network(True)  # a verifier phase with network: the branch can still be connected
    assert branch.network_enabled
    sandbox.stop()
    sandbox.start()
    assert not sandbox.network_enabled
    assert checkpoint.branch(network=True).network_enabled  # asked for explicitly


@pytest.mark.parametrize("store", ["runtime", "microvm"], indirect=True)
def test_a_sandbox_keeps_reaching_the_host_while_others_join_and_leave_the_network(store):
    # A bridge whose address was never set takes its lowest port's address: it used to change as other
    # sandboxes joined and left, and this sandbox's ARP entry for its gateway then led nowhere for seconds.
    sandbox = store.create_sandbox(DEBIAN_IMAGE, network=True)
    gateway, address = bridge_gateway(), Path("/sys/class/net", bridge_name(), "address")
    others = Store(store.root, runtime_bin=RUNTIME_BIN)
    churn_over = threading.Event()
    with greeter(gateway, churn_over) as port, ThreadPoolExecutor(1) as pool:
        # one probe every ~0.1 s (1 reached, 0 not) until the host says the churn is over
        probes = pool.submit(sandbox.exec, (
            "r=; for i in $(seq 3000); do got=$(timeout 1 bash -c 'exec 3<>/dev/tcp/%s/%d && head -c 5 <&3' "
            "2>/dev/null) && r=${r}1 || r=${r}0; [ \"$got\" = done. ] && break; sleep 0.1; done; echo $r $got"
        ) % (gateway, port))
        seen = {address.read_text()}
        for _ in range(3):
            other = others.create_sandbox(DEBIAN_IMAGE, network=True)
            seen.add(address.read_text())
            for enabled in (False, True):
                other.set_network(enabled)
                seen.add(address.read_text())
            other.destroy()
            seen.add(address.read_text())
        churn_over.set()
        reached, *last = probes.result().output.split()
        assert last == ["done."], "the probes ended before the churn did"
        # a lost gateway costs seconds of probes in a row (52 of 60 failed before the fix); a stray
        # timeout on a busy host is not that
        assert "000" not in reached, reached
    assert len(seen) == 1, f"the bridge's address changed: {seen}"


@pytest.fixture
def rt_store(base_store: Store) -> Iterator[Store]:
    with removing_what_is_made(Store(base_store.root, runtime_bin=RUNTIME_BIN)) as st:
        yield st


def _interfaces(sandbox) -> set[str]:
    """The network interfaces the sandbox sees."""
    lines = sandbox.exec("cat /proc/net/dev").output.splitlines()[2:]
    return {line.split(":")[0].strip() for line in lines if ":" in line}


@pytest.mark.rootless
def test_a_sandbox_whose_interface_was_lost_is_connected_again(rt_store):
    """Podman can record a container as connected while its network namespace has lost the interface
    (rootless podman does so now and then at a start): switching the network on makes it again."""
    sandbox = rt_store.create_sandbox(DEBIAN_IMAGE, network=True)
    netns = f"/proc/{confinement.read(sandbox.profile_path)['init_pid']}/ns/net"
    subprocess.run(["nsenter", f"--net={netns}", "ip", "link", "delete", "eth0"], check=True)
    assert not sandbox.network_enabled and _interfaces(sandbox) == {"lo"}
    sandbox.set_network(True)
    assert sandbox.network_enabled and "eth0" in _interfaces(sandbox)


@pytest.mark.rootless
def test_sandboxes_started_at_once_all_have_their_network(rt_store):
    """Rootless podman lost a starting container's interface in 2.5% of starts, 4 at a time (its record
    still said connected): each start looks, and connects it again."""
    def has_its_interface(_: int) -> bool:
        sandbox = rt_store.create_sandbox(DEBIAN_IMAGE, network=True)
        try:
            return "eth0" in _interfaces(sandbox)
        finally:
            sandbox.destroy()

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(has_its_interface, range(48)))
