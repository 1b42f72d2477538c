"""The coin: tests/fixtures/flaky-tasks/coin, a task whose verifier passes or fails as a server the test
runs says, from a schedule fixed in advance (so a test of flakiness is not flaky itself)."""

import shutil
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.conftest import REPO, bridge_gateway
from tests.tls_index import IP_FREEBIND

FIXTURE = REPO / "tests" / "fixtures" / "flaky-tasks" / "coin"


class CoinServer(ThreadingHTTPServer):
    """On the sandboxes' bridge: each GET /oracle answers the next reward of `oracle` (the schedule), each
    GET /nop answers 0 (a grade of a sandbox without /app/solved)."""

    def __init__(self, oracle: list[int]):
        self.oracle, self.lock = list(oracle), threading.Lock()

        class Answer(BaseHTTPRequestHandler):
            def do_GET(handler):  # noqa: N805 - the handler's own self; the server is `self`
                with self.lock:
                    reward = self.oracle.pop(0) if handler.path == "/oracle" else 0
                handler.send_response(200)
                handler.end_headers()
                handler.wfile.write(f"{reward}\n".encode())

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__((bridge_gateway(), 0), Answer)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def server_bind(self) -> None:  # the gateway address even while podman's bridge is down (tests.tls_index)
        self.socket.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        socketserver.TCPServer.server_bind(self)

    @property
    def address(self) -> str:
        return f"{self.server_address[0]}:{self.server_address[1]}"

    def __enter__(self) -> "CoinServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


def coin_task(task_dir: Path, coin: CoinServer) -> Path:
    """A copy of the fixture at `task_dir` whose verifier asks `coin`."""
    shutil.copytree(FIXTURE, task_dir)
    test_sh = task_dir / "tests" / "test.sh"
    test_sh.write_text(test_sh.read_text().replace("@COIN@", coin.address))
    return task_dir
