"""Token hashing, the tokens file and its command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sprout.cli import run
from sprout.runstore.auth import Scope, TokensFileError, add_token, hash_token, load_tokens, new_token

pytestmark = pytest.mark.python_only  # needs no podman (pytest -m python_only)


def test_tokens_are_stored_hashed(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    worker = add_token(path, Scope.WORKER)
    admin = add_token(path, Scope.ADMIN)
    stored = json.loads(path.read_text())
    assert worker not in path.read_text() and stored[hash_token(worker)] == "worker"
    assert path.stat().st_mode & 0o077 == 0
    table = load_tokens(path)
    assert table.scope_of(worker) == Scope.WORKER and table.scope_of(admin) == Scope.ADMIN
    assert table.scope_of(new_token()) is None and table.scope_of("") is None
    assert Scope.ADMIN.allows(Scope.WORKER) and not Scope.WORKER.allows(Scope.SUBMITTER)
    assert new_token() != new_token() and len(hash_token("x")) == 64


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "not found"),
        ("{not json", "cannot read tokens file"),
        ("[]", "must hold a JSON object"),
        ('{"abc": "worker"}', "sha256 hex digest"),
        (json.dumps({hash_token("t"): "root"}), "one of admin, submitter, worker"),
    ],
)
def test_bad_tokens_files(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "tokens.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TokensFileError, match=message):
        load_tokens(path)


def test_the_token_command_prints_the_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tokens.json"
    assert run(["runstore", "token", str(path), "--scope", "submitter"]) == 0
    token = capsys.readouterr().out.strip()
    assert load_tokens(path).scope_of(token) == Scope.SUBMITTER
