"""Database connections for the Run Store: SQLite (a file) or PostgreSQL (psycopg 3).

The two engines differ in how writers are kept apart:

* SQLite: every write transaction starts with ``BEGIN IMMEDIATE``, which takes the
  database's write lock at once, so two claimers can never pick the same job.
  Threads of one process also queue on a process-wide lock per database file, so
  they wait in Python rather than in SQLite's busy handler (which sleeps in steps
  of up to 100 ms). The database runs in WAL mode: readers never block writers.
* PostgreSQL: claims lock the rows they pick with ``FOR UPDATE SKIP LOCKED``;
  appends to a group's event log are serialised by a transaction-level advisory
  lock per group, so a group's events become visible in ``seq`` order.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Connection, Engine, Executable, Row, create_engine, event, insert, make_url, text
from sqlalchemy.exc import ArgumentError, DBAPIError

from .errors import StoreOpenError
from .schema import events

_SQLITE_WRITE_LOCKS: dict[str, threading.Lock] = {}
_SQLITE_WRITE_LOCKS_GUARD = threading.Lock()
_MIGRATION_LOCK_KEY = 0x5370726F7574  # "Sprout"
_SQLITE_APPEND_EVENTS = insert(events)
# The locks subquery yields its one row after taking the lock of every group, in key
# order (so two transactions never wait on each other's locks); the key is the same
# hashtextextended(group_id, 0) as in queries._with_events.
_PG_APPEND_EVENTS = text(
    "INSERT INTO events (job_id, group_id, type, at, data) "
    "SELECT e.job_id, e.group_id, e.type, e.at, e.data "
    "FROM jsonb_to_recordset(CAST(:rows AS jsonb)) "
    "AS e(job_id bigint, group_id text, type text, at double precision, data text) "
    "CROSS JOIN (SELECT count(pg_advisory_xact_lock(k)) AS n FROM "
    "(SELECT DISTINCT hashtextextended(g, 0) AS k FROM unnest(CAST(:groups AS text[])) AS g ORDER BY k) AS keys"
    ") AS locks"
)
_USAGE = "use a file path, sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE"


def parse_url(url: str) -> URL:
    """Turn a file path or database URL into the SQLAlchemy URL the store uses."""
    if "://" not in url:
        if not url.strip():
            raise StoreOpenError(f"empty database URL; {_USAGE}")
        return URL.create("sqlite+pysqlite", database=str(Path(url).expanduser().resolve()))
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StoreOpenError(f"cannot parse database URL {url!r}; {_USAGE}") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise StoreOpenError(f"in-memory SQLite cannot be shared between connections; {_USAGE}")
        return parsed.set(drivername="sqlite+pysqlite", database=str(Path(parsed.database).resolve()))
    if backend in ("postgresql", "postgres"):
        if parsed.get_driver_name() not in ("psycopg", "postgresql", "postgres"):
            raise StoreOpenError(f"unsupported PostgreSQL driver {parsed.get_driver_name()!r}; {_USAGE}")
        return parsed.set(drivername="postgresql+psycopg")
    raise StoreOpenError(f"unsupported database {backend!r}; {_USAGE}")


@dataclass
class Database:
    engine: Engine
    dialect: str  # "sqlite" or "postgresql"
    safe_url: str  # the URL with its password hidden, for messages
    _write_lock: threading.Lock | None

    def __post_init__(self) -> None:
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")

    @classmethod
    def open(cls, url: str, pool_size: int = 10) -> Database:
        parsed = parse_url(url)
        safe_url = parsed.render_as_string(hide_password=True)
        if parsed.get_backend_name() == "sqlite":
            path = Path(parsed.database or "")
            path.parent.mkdir(parents=True, exist_ok=True)
            engine = create_engine(parsed, pool_size=pool_size, max_overflow=pool_size * 4)
            event.listen(engine, "connect", _configure_sqlite)
            with _SQLITE_WRITE_LOCKS_GUARD:
                lock = _SQLITE_WRITE_LOCKS.setdefault(str(path), threading.Lock())
            db = cls(engine, "sqlite", safe_url, lock)
        else:
            engine = create_engine(
                parsed,
                pool_size=pool_size,
                max_overflow=pool_size * 4,
                connect_args={"connect_timeout": 10, "application_name": "sprout-runstore"},
            )
            db = cls(engine, "postgresql", safe_url, None)
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except DBAPIError as exc:
            engine.dispose()
            reason = " ".join(str(exc.orig).split())
            raise StoreOpenError(f"cannot open database {safe_url}: {reason}") from None
        return db

    @contextmanager
    def begin(self, write: bool) -> Iterator[Connection]:
        """A transaction; ``write`` ones are serialised on SQLite."""
        if self.dialect == "postgresql":
            with self.engine.begin() as conn:
                yield conn
            return
        lock = self._write_lock if write and self._write_lock is not None else nullcontext()
        with lock, self.engine.connect() as conn, conn.begin():
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
            yield conn

    def execute_alone(self, statement: Executable, params: dict[str, Any]) -> list[Row[Any]]:
        """Run one statement as its own transaction, in one round trip (PostgreSQL only)."""
        assert self.dialect == "postgresql", "SQLite writes must hold the write lock: use begin()"
        with self._autocommit.connect() as conn:
            return list(conn.execute(statement, params).all())

    def lock_for_migration(self, conn: Connection) -> None:
        if self.dialect == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK_KEY})

    def append_events(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        """Insert event rows (job_id, group_id, type, at, data) in order.

        On PostgreSQL the same statement first takes an advisory lock per group, held
        until commit, so a group's events commit in ``seq`` order and a reader that
        resumes after a ``seq`` never misses one that was committed later.
        """
        if self.dialect == "sqlite":
            conn.execute(_SQLITE_APPEND_EVENTS, rows)
            return
        groups = sorted({r["group_id"] for r in rows if r["group_id"] is not None})
        conn.execute(_PG_APPEND_EVENTS, {"rows": json.dumps(rows), "groups": groups})

    def close(self) -> None:
        self.engine.dispose()


def _configure_sqlite(dbapi_conn, _record) -> None:
    # Driver-level autocommit: transactions are begun explicitly by Database.begin.
    dbapi_conn.isolation_level = None
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA busy_timeout = 30000")
    cursor.execute("PRAGMA journal_mode = WAL")
    cursor.execute("PRAGMA synchronous = NORMAL")
    cursor.close()
