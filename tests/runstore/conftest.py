"""Fixtures of the Run Store tests: every test that takes ``db_url`` (or ``store``) runs on
SQLite and on PostgreSQL. PostgreSQL comes from ``SPROUT_TEST_POSTGRES_URL`` (see
``ops/postgres_for_tests.sh``); without it those tests are skipped, or fail under CI."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import create_engine, make_url, text

from sprout.jobs.payloads import job_kinds
from sprout.runstore.store import RunStore

PG_ENV = "SPROUT_TEST_POSTGRES_URL"


class FakeClock:
    """A clock the tests move by hand (epoch seconds)."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    url = os.environ.get(PG_ENV)
    if not url:
        message = f"{PG_ENV} is not set; start a server with: export {PG_ENV}=$(bash ops/postgres_for_tests.sh | tail -n1)"
        pytest.skip(message)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A fresh, empty database: a SQLite file, or a PostgreSQL schema of its own."""
    if request.param == "sqlite":
        yield str(tmp_path / "runstore.db")
        return
    admin_url = request.getfixturevalue("pg_admin_url")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    url = make_url(admin_url).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_store(db_url: str) -> Iterator[Callable[..., RunStore]]:
    """Open stores on the test's database (closed at teardown)."""
    opened: list[RunStore] = []

    def make(kinds: object = None, **kwargs: object) -> RunStore:
        store = RunStore(db_url, kinds or job_kinds(), **kwargs)  # type: ignore[arg-type]
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def store(make_store: Callable[..., RunStore], clock: FakeClock) -> RunStore:
    """A store on a fake clock."""
    return make_store(clock=clock)
