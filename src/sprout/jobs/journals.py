"""Removing what rollouts left: a journal's sandbox and checkpoints (and the journal itself)."""

from collections.abc import Iterable
from pathlib import Path

from ..agent.journal import read_journal
from ..errors import SproutError
from ..sandbox import Store
from ..sandbox.errors import SandboxNotFound


def discard(store: Store, journal: Path) -> None:
    """Removes a journal with its sandbox and checkpoints."""
    release(store, [journal])
    journal.unlink(missing_ok=True)


def release(store: Store, journals: Iterable[Path]) -> None:
    """Removes these journals' checkpoints (and a sandbox a killed run left running)."""
    for path in journals:
        try:
            journal = read_journal(path)
        except SproutError:
            continue
        try:
            store.remove_sandbox(journal.header.sandbox, force=True)
        except SandboxNotFound:
            pass
        for turn in journal.turns:
            if turn.checkpoint:
                try:
                    store.remove_checkpoint(turn.checkpoint, force=True)
                except SproutError:
                    pass
