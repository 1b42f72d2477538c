"""A real container registry on 127.0.0.1 for tests and benchmarks: Debian's `docker-registry`
(distribution registry v2), one instance per test session, installed by ops/setup_podman.sh.

    with LocalRegistry() as registry:                      # serving on 127.0.0.1:<free port>
        ref = registry.push("docker.io/library/debian:bookworm", "sprout-test/debian:pushed")
        registry.remove_local(ref)                         # drops that name from podman, not the image
        subprocess.run(["podman", "pull", ref], env={**os.environ, **registry.env}, check=True)

The registry speaks plain HTTP, so podman is pointed at a registries.conf (v2) that marks it insecure:
`registry.env` is {"CONTAINERS_REGISTRIES_CONF": path}. Podman 4.3 reads that variable for pull, push,
build and every other command; the file replaces /etc/containers/registries.conf (or the file the
variable named before), whose settings are copied into it, while the drop-ins in
/etc/containers/registries.conf.d still apply.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

from sprout.sandbox.podman import command as podman_command
from tests.conftest import free_port

REGISTRY_BIN = Path("/usr/bin/docker-registry")
SYSTEM_REGISTRIES_CONF = Path("/etc/containers/registries.conf")
SETUP_HINT = "run ops/setup_podman.sh (it installs Debian's docker-registry package)"
START_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0
PODMAN_TIMEOUT_S = 600.0


class RegistryError(RuntimeError):
    """The registry could not be started, or podman could not talk to it."""


class LocalRegistry:
    """A `docker-registry serve` on 127.0.0.1:<free port> with its storage in a temporary directory and
    no auth. Start it with `start()` or `with`; `close()` stops it (SIGTERM, then SIGKILL) and deletes its
    storage. Images it holds are gone with it; local podman names made by `push` are the caller's to
    remove (`remove_local`)."""

    def __init__(self, *, binary: Path = REGISTRY_BIN, start_timeout_s: float = START_TIMEOUT_S):
        self.binary = Path(binary)
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.workdir: Path | None = None
        self.startup_s = 0.0  # from spawning the process to the first answer of GET /v2/
        self._process: subprocess.Popen | None = None

    # ------------------------------------------------------------------ addresses
    @property
    def host(self) -> str:
        """The registry part of the references it serves: 127.0.0.1:PORT."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @property
    def registries_conf(self) -> Path:
        assert self.workdir is not None, "the registry is not started"
        return self.workdir / "registries.conf"

    @property
    def env(self) -> dict[str, str]:
        """Environment for podman so that it talks plain HTTP to this registry."""
        return {"CONTAINERS_REGISTRIES_CONF": str(self.registries_conf)}

    def ref(self, name: str) -> str:
        """The reference of `name` ("repo/path:tag") in this registry: 127.0.0.1:PORT/repo/path:tag."""
        first = name.split("/", 1)[0]
        if "/" in name and ("." in first or ":" in first or first == "localhost"):
            raise ValueError(f"{name!r} names a registry; give a name inside this one (e.g. sprout-test/x:1)")
        return f"{self.host}/{name}"

    # ------------------------------------------------------------------ life cycle
    def start(self) -> Self:
        if self._process is not None:
            return self
        if not (self.binary.is_file() and os.access(self.binary, os.X_OK)):
            raise RegistryError(f"{self.binary} is missing: {SETUP_HINT}")
        self.workdir = Path(tempfile.mkdtemp(prefix="sprout-registry-"))
        (self.workdir / "storage").mkdir()
        try:
            for attempt in range(3):  # another process may take the free port before the registry binds it
                self.port = free_port()
                self._write_config()
                self._write_registries_conf()
                if self._spawn_and_wait(last_attempt=attempt == 2):
                    return self
        except BaseException:
            self.close()
            raise
        raise AssertionError("unreachable")

    def _write_config(self) -> None:
        assert self.workdir is not None
        (self.workdir / "config.yml").write_text(
            "version: 0.1\n"
            "log:\n"
            "  level: warn\n"
            "  accesslog:\n"
            "    disabled: true\n"
            "storage:\n"
            "  filesystem:\n"
            f"    rootdirectory: {self.workdir / 'storage'}\n"
            "  delete:\n"
            "    enabled: true\n"
            "  maintenance:\n"
            "    uploadpurging:\n"
            "      enabled: false\n"
            "http:\n"
            f"  addr: {self.host}\n"
            f"  secret: {secrets.token_hex(16)}\n"
        )

    def _write_registries_conf(self) -> None:
        """The registries.conf podman reads now ($CONTAINERS_REGISTRIES_CONF, else the host's), when it is in
        the v2 format, plus this registry as insecure."""
        base = ""
        try:
            text = Path(os.environ.get("CONTAINERS_REGISTRIES_CONF") or SYSTEM_REGISTRIES_CONF).read_text()
            if "[registries." not in text:  # the v1 format cannot be mixed with [[registry]] tables
                base = text.rstrip("\n") + "\n\n"
        except OSError:
            pass
        self.registries_conf.write_text(
            f"{base}# written by tests/registry.py: the test registry speaks plain HTTP\n"
            f'[[registry]]\nlocation = "{self.host}"\ninsecure = true\n')

    def _spawn_and_wait(self, *, last_attempt: bool) -> bool:
        assert self.workdir is not None
        log = self.workdir / "registry.log"
        started = time.monotonic()
        with log.open("ab") as out:
            self._process = subprocess.Popen([str(self.binary), "serve", str(self.workdir / "config.yml")],
                                             stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        deadline = started + self.start_timeout_s
        while True:
            if self._process.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                self._process = None
                if "address already in use" in "\n".join(tail) and not last_attempt:
                    return False
                raise RegistryError(f"docker-registry exited at start (log {log}): {' | '.join(tail)}")
            try:
                with urllib.request.urlopen(f"{self.url}/v2/", timeout=1) as answer:
                    if answer.status == 200:
                        self.startup_s = time.monotonic() - started
                        return True
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RegistryError(f"docker-registry did not answer GET {self.url}/v2/ within "
                                    f"{self.start_timeout_s:g}s (log {log})")
            time.sleep(0.02)

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # ------------------------------------------------------------------ podman
    def podman(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Runs podman (Sprout's runtime flags) with this registry's registries.conf."""
        proc = subprocess.run([*podman_command(), *args], env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=PODMAN_TIMEOUT_S, check=False)
        if check and proc.returncode != 0:
            raise RegistryError(f"podman {' '.join(args)} failed: {proc.stderr.strip().splitlines()[-1:]}")
        return proc

    def push(self, local_ref: str, name: str) -> str:
        """Tags podman's image `local_ref` as 127.0.0.1:PORT/`name` and pushes it here; returns that reference
        (the local tag stays: `remove_local` drops it)."""
        assert self.running, "the registry is not running"
        ref = self.ref(name)
        self.podman("tag", local_ref, ref)
        self.podman("push", ref)
        return ref

    def pull(self, ref: str) -> str:
        """`podman pull`s `ref` (through this registry's registries.conf); returns the image id."""
        self.podman("pull", "--quiet", ref)
        return self.podman("image", "inspect", "--format", "{{.Id}}", ref).stdout.strip()

    def remove_local(self, ref: str) -> None:
        """Removes the name `ref` from podman (`podman rmi` without force: an image with other names keeps
        them and stays; one known only by `ref` is deleted). Only names in this registry or under
        localhost/sprout-test/ are accepted; a name podman does not know is fine."""
        if not ref.startswith((f"{self.host}/", "localhost/sprout-test/")):
            raise ValueError(f"{ref!r} is not a test image (names in {self.host}/ or localhost/sprout-test/)")
        proc = self.podman("rmi", ref, check=False)
        if proc.returncode != 0 and "image not known" not in proc.stderr:
            raise RegistryError(f"podman rmi {ref} failed: {proc.stderr.strip()}")

    def tags(self, repository: str) -> list[str]:
        """The tags this registry holds for `repository` (e.g. "sprout-test/debian"), from its HTTP API."""
        try:
            with urllib.request.urlopen(f"{self.url}/v2/{repository}/tags/list", timeout=5) as answer:
                return json.load(answer).get("tags") or []
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return []
            raise
