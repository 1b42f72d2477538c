"""Schema creation and migration, and the errors of opening a store."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import inspect, select, text

from sprout.jobs.payloads import job_kinds
from sprout.runstore import JobState, StoreOpenError
from sprout.runstore.db import Database
from sprout.runstore.migrations import LATEST_VERSION, migrate
from sprout.runstore.schema import jobs, metadata, schema_version
from sprout.runstore.store import RunStore

pytestmark = pytest.mark.python_only  # needs no podman (pytest -m python_only)


def test_old_database_is_migrated(db_url: str) -> None:
    db = Database.open(db_url)
    assert migrate(db, time.time(), target=1) == 1
    with db.begin(write=True) as conn:
        assert "host" not in {c["name"] for c in inspect(conn).get_columns("jobs")}
        conn.execute(
            text(
                "INSERT INTO jobs (kind, payload, state, max_attempts, created_at, updated_at) "
                "VALUES ('gate', '{\"task_dir\": \"old\"}', 'queued', 3, 1.0, 1.0)"
            )
        )
    db.close()

    with RunStore(db_url, job_kinds()) as store:
        assert store.schema_version() == LATEST_VERSION == 4
        (old,) = store.list().jobs
        assert old.payload == {"task_dir": "old"} and old.host is None and old.lease_host is None
        assert old.max_lease_expiries == 10  # what a job submitted before it gets
        (claim,) = store.claim("w1", "h1")
        assert claim.job.id == old.id
        assert store.complete(old.id, claim.lease_token).state == JobState.SUCCEEDED
    with RunStore(db_url, job_kinds()) as store, store._db.begin(write=False) as conn:  # opening it again changes nothing
        assert conn.execute(select(schema_version.c.version)).scalars().all() == [1, 2, 3, 4]


def test_migrated_schema_matches_the_table_definitions(db_url: str) -> None:
    with RunStore(db_url, job_kinds()) as store, store._db.begin(write=False) as conn:
        inspector = inspect(conn)
        for table in metadata.tables.values():
            assert [c["name"] for c in inspector.get_columns(table.name)] != []
            assert {c["name"] for c in inspector.get_columns(table.name)} == set(table.columns.keys()), (
                table.name
            )
        assert {i["name"] for i in inspector.get_indexes(jobs.name)} >= {"jobs_queued", "jobs_leased"}


def test_concurrent_openers_migrate_once(db_url: str) -> None:
    errors: list[BaseException] = []

    def open_store() -> None:
        try:
            RunStore(db_url, job_kinds()).close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_store) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with RunStore(db_url, job_kinds()) as store:
        assert store.schema_version() == LATEST_VERSION


def test_newer_database_is_refused(db_url: str) -> None:
    RunStore(db_url, job_kinds()).close()
    db = Database.open(db_url)
    with db.begin(write=True) as conn:
        conn.execute(schema_version.insert().values(version=99, name="future", applied_at=0.0))
    db.close()
    with pytest.raises(StoreOpenError, match="schema version 99, newer than this Sprout knows"):
        RunStore(db_url, job_kinds())


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://u@localhost/db", "unsupported database 'mysql'"),
        ("sqlite://", "in-memory SQLite"),
        ("postgresql+psycopg2://u@localhost/db", "unsupported PostgreSQL driver 'psycopg2'"),
        (
            "postgresql+psycopg://u:s3cret@127.0.0.1:9/db",
            "cannot open database postgresql\\+psycopg://u:\\*\\*\\*@",
        ),
        ("   ", "empty database URL"),
    ],
)
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(StoreOpenError, match=message) as info:
        RunStore(url, job_kinds())
    assert "s3cret" not in str(info.value)


def test_plain_path_and_sqlite_url_open_the_same_file(tmp_path) -> None:
    path = tmp_path / "sub" / "store.db"
    with RunStore(str(path), job_kinds()) as store:
        job = store.submit("gate", {"task_dir": "x"})
    with RunStore(f"sqlite:///{path}", job_kinds()) as store:
        assert store.get(job.id).id == job.id
