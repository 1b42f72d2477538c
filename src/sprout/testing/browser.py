"""A real headless browser for tests and screenshots: Debian's chromium, driven over its DevTools protocol
(a websocket; nothing is downloaded at run time)."""

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

from ..errors import SproutError


class Browser:
    """One headless chromium with one page; `with Browser() as b: b.goto(url); b.evaluate("...")`."""

    def __init__(self, width: int = 1280, height: int = 900):
        binary = shutil.which("chromium")
        if binary is None:
            raise SproutError("chromium is not installed (ops/setup_podman.sh --dev installs it)")
        self._profile = tempfile.TemporaryDirectory(prefix="sprout-chromium-", ignore_cleanup_errors=True)
        self._process = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             "--remote-debugging-port=0", f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port = self._port(Path(self._profile.name) / "DevToolsActivePort")
        page = next(t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page")
        self._socket = connect(page["webSocketDebuggerUrl"], max_size=None)
        self._next_id = 0

    def _port(self, active: Path, timeout_s: float = 30) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if active.is_file() and (lines := active.read_text().splitlines()):
                return int(lines[0])
            if self._process.poll() is not None:
                raise SproutError(f"chromium exited with status {self._process.returncode}")
            time.sleep(0.1)
        raise SproutError("chromium did not open its DevTools port")

    def call(self, method: str, **params: Any) -> dict:
        self._next_id += 1
        self._socket.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv(timeout=60))
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise SproutError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise SproutError(f"{expression}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 20) -> Any:
        """Polls until `expression` is truthy (one that throws, e.g. while the page loads, is not yet); its value."""
        deadline, last = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            try:
                if value := self.evaluate(expression):
                    return value
            except SproutError as e:
                last = f" (last: {e})"
            time.sleep(0.1)
        raise SproutError(f"timed out waiting for {expression}{last}")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def screenshot(self, path: Path) -> None:
        height = self.evaluate("Math.min(document.documentElement.scrollHeight, 4000)")
        self.call("Emulation.setDeviceMetricsOverride", width=1280, height=int(height), deviceScaleFactor=1,
                  mobile=False)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        self.call("Emulation.clearDeviceMetricsOverride")

    def close(self) -> None:
        self._socket.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)  # its zygote and renderers too
        self._process.wait()
        self._profile.cleanup()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
