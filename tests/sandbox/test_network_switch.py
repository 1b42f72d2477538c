"""Switching a running sandbox's network, as phases do (an agent without network, a verifier with it),
with containers and microVMs alike."""

import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from sprout.sandbox import SandboxStateError
from tests.conftest import DEBIAN_IMAGE, bridge_gateway, every_backend

# the interfaces besides loopback that carry a link: a container's eth0 while connected; a microVM's
# eth0 stays, with its link down while disconnected
LINKS_UP = ("for i in /sys/class/net/*; do [ ${i##*/} != lo ] && [ \"$(cat $i/carrier 2>/dev/null)\" = 1 ] "
            "&& echo up:${i##*/}; done; true")


class _Greeting(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(b"hello from the host\n")


@contextmanager
def greeter(address: str) -> Iterator[int]:
    """A TCP listener on the host at `address` that greets each connection; yields its port."""
    server = socketserver.ThreadingTCPServer((address, 0), _Greeting)
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
