"""What of the host's trust a container receives: the host's CA bundle and its proxy variables.

Hosts behind an intercepting TLS proxy reach package registries only with the host's CA bundle, so by
default sandboxes and image builds get it (and the host's proxy variables). `SPROUT_HOST_TRUST=0` (or
`false`, `off`) turns that off; `SPROUT_HOST_CA_BUNDLE` names the bundle when the host's is elsewhere.

A sandbox gets the bundle as a read-only bind mount at CONTAINER_BUNDLE, outside the files package
managers rewrite (`update-ca-certificates` renames over /etc/ssl/certs/ca-certificates.crt, which a bind
mount there would make fail; it folds CONTAINER_BUNDLE in instead), and variables that point common
tools at it. A btrfs snapshot does not see bind mounts, so checkpoints never contain the host's bundle.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..settings import settings
from .errors import SproutError

CONTAINER_BUNDLE = "/usr/local/share/ca-certificates/sprout-host-ca.crt"
BUILD_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # a build's RUN steps see the host's bundle in its place
BUNDLE_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE",
                    "NODE_EXTRA_CA_CERTS", "GIT_SSL_CAINFO")
PROXY_VARIABLES = tuple(name for upper in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")
                        for name in (upper, upper.lower()))
HOST_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")


class HostTrustError(SproutError):
    """The host-trust configuration names a CA bundle that cannot be used."""


@dataclass(frozen=True)
class HostTrust:
    enabled: bool
    ca_bundle: str | None  # the host file containers trust (None: trust off, or the host has none)
    proxy_env: dict[str, str] = field(default_factory=dict)


def enabled_by_config() -> bool:
    """SPROUT_HOST_TRUST: on unless it says 0, false or off."""
    return settings().host_trust


def host_trust(enabled: bool | None = None) -> HostTrust:
    """The host's trust as the configuration gives it now; `enabled` overrides SPROUT_HOST_TRUST."""
    if enabled is None:
        enabled = enabled_by_config()
    if not enabled:
        return HostTrust(False, None, {})
    proxy_env = {name: os.environ[name] for name in PROXY_VARIABLES if os.environ.get(name)}
    return HostTrust(True, find_bundle(), proxy_env)


def find_bundle() -> str | None:
    """SPROUT_HOST_CA_BUNDLE, else the host's SSL_CERT_FILE when it is a file, else the first usual path
    that exists (absolute). Raises HostTrustError for a SPROUT_HOST_CA_BUNDLE that is not a file."""
    configured = settings().host_ca_bundle
    if configured and not Path(configured).is_file():
        raise HostTrustError(f"SPROUT_HOST_CA_BUNDLE={configured} is not a file (point it at the host's CA "
                             "bundle, or set SPROUT_HOST_TRUST=0 to give containers none)")
    candidates = [str(configured)] if configured else [os.environ.get("SSL_CERT_FILE"), *HOST_BUNDLES]
    bundle = next((str(Path(path).absolute()) for path in candidates if path and Path(path).is_file()), None)
    if bundle and ":" in bundle:
        raise HostTrustError(f"podman cannot mount the CA bundle {bundle} (a ':' in its path); set "
                             "SPROUT_HOST_CA_BUNDLE to a copy elsewhere")
    return bundle


def container_env(trust: HostTrust) -> dict[str, str]:
    """Variables a sandbox gets for host trust (the image's own env is meant to win over these)."""
    env = dict(trust.proxy_env)
    if trust.ca_bundle:
        env |= {name: CONTAINER_BUNDLE for name in BUNDLE_VARIABLES}
    return env


def container_mounts(trust: HostTrust) -> list[tuple[str, str, str]]:
    """(host path, container path, options) of the bind mounts a sandbox gets for host trust."""
    return [(trust.ca_bundle, CONTAINER_BUNDLE, "ro")] if trust.ca_bundle else []


def build_flags(trust: HostTrust) -> list[str]:
    """`podman build` flags: RUN steps see the host's bundle in place of the image's, and get the host's
    proxy variables (podman's default) unless trust is off."""
    if not trust.enabled:
        return ["--http-proxy=false"]
    return ["-v", f"{trust.ca_bundle}:{BUILD_BUNDLE}:ro"] if trust.ca_bundle else []

