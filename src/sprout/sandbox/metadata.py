"""Metadata of images, sandboxes and checkpoints: one SQLite file beside the store's subvolumes.

A row is written only after its subvolume exists, so a crash mid-operation leaves at worst an
orphan subvolume without a row (never listed, removed by gc); gc also drops rows whose subvolume went.
`owner` (JSON, optional) names the process a sandbox or checkpoint belongs to until it is adopted.
"""

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS images (
    key TEXT PRIMARY KEY, image_id TEXT NOT NULL, names TEXT NOT NULL, config TEXT NOT NULL,
    created REAL NOT NULL, layers TEXT);
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY, image_key TEXT NOT NULL, base_checkpoint TEXT, last_checkpoint TEXT,
    container TEXT NOT NULL, limits TEXT NOT NULL, label TEXT, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, image_key TEXT NOT NULL, parent TEXT,
    label TEXT, created REAL NOT NULL, duration_ms REAL, limits TEXT);
CREATE INDEX IF NOT EXISTS checkpoints_parent ON checkpoints(parent);
CREATE INDEX IF NOT EXISTS sandboxes_base ON sandboxes(base_checkpoint);
"""
# Columns stores made by earlier versions lack (NULL in their old rows): a checkpoint's copy of its
# sandbox's limits, the owner of sandboxes and checkpoints, an image's layers.
ADDED_COLUMNS = (("checkpoints", "limits"), ("sandboxes", "owner"), ("checkpoints", "owner"),
                 ("images", "layers"))


class Metadata:
    def __init__(self, path: Path):
        self.path = path
        self._db = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        for table, column in ADDED_COLUMNS:
            if column not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} TEXT")
        self._lock = threading.RLock()  # one connection, shared by the threads of a process

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def one(self, sql: str, *args) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def all(self, sql: str, *args) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def execute(self, sql: str, *args) -> None:
        with self.transaction() as db:
            db.execute(sql, args)

    def put_image(self, key: str, image_id: str, names: list[str], config: dict,
                  layers: list[str] | None = None) -> None:
        """`layers`: the image's layer digests, bottom first (None: not known, e.g. a shipped image)."""
        self.execute("INSERT OR REPLACE INTO images (key, image_id, names, config, created, layers) "
                     "VALUES (?, ?, ?, ?, ?, ?)", key, image_id, json.dumps(names), json.dumps(config),
                     time.time(), None if layers is None else json.dumps(layers))

    def put_sandbox(self, sandbox_id: str, image_key: str, base_checkpoint: str | None, container: str,
                    limits: dict, label: str | None, owner: dict | None = None) -> None:
        self.execute("INSERT INTO sandboxes (id, image_key, base_checkpoint, last_checkpoint, container, limits, "
                     "label, created, owner) VALUES (?, ?, ?, NULL, ?, ?, ?, ?, ?)", sandbox_id, image_key,
                     base_checkpoint, container, json.dumps(limits), label, time.time(),
                     json.dumps(owner) if owner else None)

    def put_checkpoint(self, checkpoint_id: str, sandbox_id: str, image_key: str, parent: str | None,
                       label: str | None, created: float, duration_ms: float, limits: dict) -> None:
        with self.transaction() as db:
            db.execute("INSERT INTO checkpoints (id, sandbox_id, image_key, parent, label, created, duration_ms, "
                       "limits, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, (SELECT owner FROM sandboxes WHERE id = ?))",
                       (checkpoint_id, sandbox_id, image_key, parent, label, created, duration_ms,
                        json.dumps(limits), sandbox_id))
            db.execute("UPDATE sandboxes SET last_checkpoint = ? WHERE id = ?", (checkpoint_id, sandbox_id))

    def close(self) -> None:
        self._db.close()
