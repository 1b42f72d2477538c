"""Bearer tokens of the Run Store API.

Tokens are kept only as sha256 hashes, in a JSON file ``{"<sha256 hex>": "<scope>"}``.
Scopes: ``worker`` (claim, heartbeat, complete, fail, release), ``submitter`` (submit,
get, list, cancel, events) and ``admin`` (both).

    sprout runstore token TOKENS_FILE --scope worker   # prints a new token
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from enum import StrEnum
from pathlib import Path


class Scope(StrEnum):
    WORKER = "worker"
    SUBMITTER = "submitter"
    ADMIN = "admin"

    def allows(self, needed: Scope) -> bool:
        return self is Scope.ADMIN or self is needed


class TokensFileError(Exception):
    """The tokens file is missing or malformed."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "sprt_" + secrets.token_urlsafe(32)


class TokenTable:
    """Hashed tokens and their scopes; looks a presented token up in constant time per entry."""

    def __init__(self, hashed: dict[str, Scope | str]) -> None:
        self._entries = [(h.lower(), Scope(scope)) for h, scope in hashed.items()]

    def scope_of(self, token: str) -> Scope | None:
        digest = hash_token(token)
        found = None
        for stored, scope in self._entries:
            if hmac.compare_digest(stored, digest):
                found = scope
        return found


def load_tokens(path: str | Path) -> TokenTable:
    """Read a tokens file; a missing or malformed one raises ``TokensFileError``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TokensFileError(f"tokens file {path} not found") from None
    except (OSError, ValueError) as exc:
        raise TokensFileError(f"cannot read tokens file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise TokensFileError(f"tokens file {path} must hold a JSON object of sha256 hex -> scope")
    scopes = {s.value for s in Scope}
    for digest, scope in data.items():
        if len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest) or scope not in scopes:
            raise TokensFileError(
                f"tokens file {path}: each entry must map a sha256 hex digest to one of {', '.join(sorted(scopes))}"
            )
    return TokenTable(data)


def add_token(path: str | Path, scope: Scope) -> str:
    """Create a token of ``scope``, store its hash in the tokens file and return it."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {}
    token = new_token()
    data[hash_token(token)] = scope.value
    path.write_text(json.dumps(data, indent=2) + "\n")
    path.chmod(0o600)
    return token


if __name__ == "__main__":  # the seed's form of `sprout runstore token` (`add TOKENS_FILE --scope S`)
    from ..cli import alias

    alias("sprout.runstore.auth")
