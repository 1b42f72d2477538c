"""Host trust: sandboxes trust the host's CA bundle and get its proxy variables, unless configured off.

Real TLS without the internet: a throwaway CA signs a certificate for the host's address on the sandboxes'
bridge, where an HTTPS server (and a one-package simple index for pip) listens; the test CA is the bundle."""

from pathlib import Path

import pytest

from sprout.sandbox import trust
from sprout.worker.doctor import _host_trust
from tests.conftest import PYTHON_IMAGE, every_backend
from tests.tls_index import WHEEL, TlsIndex

STORE = "/etc/ssl/certs/ca-certificates.crt"  # the image's CA store
URLOPEN = "python3 -c \"import urllib.request; print(urllib.request.urlopen('{url}/').status)\""


@pytest.fixture(scope="module")
def https_server(tmp_path_factory) -> tuple[str, Path]:
    """(URL of an HTTPS server with a simple index on the bridge gateway, the test CA that makes it trusted)."""
    index = TlsIndex(tmp_path_factory.mktemp("tls"))
    yield index.base_url, index.ca_cert
    index.close()


@every_backend
def test_sandboxes_trust_the_hosts_bundle(store, https_server, monkeypatch):
    url, ca = https_server
    monkeypatch.setenv("SPROUT_HOST_CA_BUNDLE", str(ca))
    sandbox = store.create_sandbox(PYTHON_IMAGE, network=True)
    assert sandbox.limits["host_trust"] is True
    assert sandbox.exec(URLOPEN.format(url=url)).output.strip() == "200"
    pip = sandbox.exec(f"pip download -q --no-deps --disable-pip-version-check -d /tmp/dl "
                       f"--index-url {url}/simple/ sprout-probe && ls /tmp/dl", timeout=120)
    assert pip.exit_code == 0 and pip.output.strip().endswith(WHEEL), pip.output
    checkpoint = sandbox.checkpoint()
    if sandbox.backend != "microvm":  # (a microVM's files are inside its disk.img: see its branch below)
        held = checkpoint.path / trust.CONTAINER_BUNDLE.lstrip("/")  # a snapshot does not see bind mounts
        assert not held.exists() or held.stat().st_size == 0
    # the image's own CA store stays writable: update-ca-certificates folds the host's bundle into it
    # (it takes a minute in an emulated VM: there, what it does to the store, a file renamed over it)
    fold = "update-ca-certificates >/dev/null 2>&1" if sandbox.backend != "microvm" else (
        f"cat {STORE} {trust.CONTAINER_BUNDLE} > {STORE}.new && mv {STORE}.new {STORE}")
    without_variable = f"env -u SSL_CERT_FILE {URLOPEN.format(url=url)}"
    folded = sandbox.exec(f"{fold} && {without_variable}")
    assert folded.output.strip() == "200", folded.output
    branch = checkpoint.branch()
    assert branch.limits["host_trust"] is True and branch.exec(without_variable).exit_code != 0
    assert branch.exec(URLOPEN.format(url=url)).output.strip() == "200"
    if branch.backend == "microvm":  # root in a VM can look under the mount: the disk holds an empty file
        beneath = branch.exec(f"umount {trust.CONTAINER_BUNDLE} && wc -c < {trust.CONTAINER_BUNDLE}", user="0")
        assert beneath.output.strip() == "0", beneath.output

def test_trust_off_by_config_is_kept_by_branches_unless_overridden(store, https_server, monkeypatch):
    url, ca = https_server
    monkeypatch.setenv("SPROUT_HOST_CA_BUNDLE", str(ca))
    monkeypatch.setenv("SPROUT_HOST_TRUST", "off")
    sandbox = store.create_sandbox(PYTHON_IMAGE)
    refused = sandbox.exec(URLOPEN.format(url=url))
    assert refused.exit_code != 0 and "CERTIFICATE_VERIFY_FAILED" in refused.output
    assert sandbox.limits["host_trust"] is False
    assert "SSL_CERT_FILE" not in sandbox.exec("env").output
    checkpoint = sandbox.checkpoint()
    monkeypatch.delenv("SPROUT_HOST_TRUST")
    assert checkpoint.branch().exec(URLOPEN.format(url=url)).exit_code != 0  # as its sandbox was made
    assert checkpoint.branch(host_trust=True).exec(URLOPEN.format(url=url)).output.strip() == "200"


@every_backend
def test_host_proxy_variables_reach_sandboxes_only_with_trust(store, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:3128")
    monkeypatch.setenv("no_proxy", "localhost")
    with_trust = store.create_sandbox(PYTHON_IMAGE).exec("env").output
    wanted = {"HTTPS_PROXY=http://127.0.0.1:3128", "no_proxy=localhost"}
    assert wanted <= set(with_trust.splitlines()), with_trust
    without = store.create_sandbox(PYTHON_IMAGE, host_trust=False).exec("env").output  # nor from podman
    assert "PROXY" not in without.upper(), without


def test_config_build_flags_and_doctor(tmp_path, monkeypatch):
    bundle = tmp_path / "bundle.crt"
    bundle.write_text("")
    monkeypatch.setenv("SPROUT_HOST_CA_BUNDLE", str(bundle))
    monkeypatch.setenv("HTTPS_PROXY", "http://user:secret@proxy.example:3128")
    on = trust.host_trust()
    assert on == trust.HostTrust(True, str(bundle), {"HTTPS_PROXY": "http://user:secret@proxy.example:3128"})
    assert trust.build_flags(on) == ["-v", f"{bundle}:/etc/ssl/certs/ca-certificates.crt:ro"]
    line = _host_trust().detail
    assert _host_trust().ok and str(bundle) in line and "HTTPS_PROXY" in line and "secret" not in line
    monkeypatch.setenv("SPROUT_HOST_TRUST", "False")
    assert trust.host_trust() == trust.HostTrust(False, None, {})
    assert trust.build_flags(trust.host_trust()) == ["--http-proxy=false"]
    assert _host_trust().ok and _host_trust().detail.startswith("off")
    monkeypatch.delenv("SPROUT_HOST_TRUST")
    monkeypatch.setenv("SPROUT_HOST_CA_BUNDLE", str(tmp_path / "missing.crt"))
    with pytest.raises(trust.HostTrustError, match="SPROUT_HOST_CA_BUNDLE"):
        trust.host_trust()
    assert not _host_trust().ok and "SPROUT_HOST_CA_BUNDLE" in _host_trust().detail
