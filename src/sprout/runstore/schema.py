"""Table definitions of the current schema, used to build queries.

The tables themselves are created and altered by ``migrations``; a test checks that
the migrated database has exactly these columns. Timestamps are stored as UTC epoch
seconds (float), JSON as text, so both engines store the same values.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Double, Integer, MetaData, Table, Text

metadata = MetaData()

jobs = Table(
    "jobs",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("payload", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("priority", Integer, nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("max_attempts", Integer, nullable=False),
    Column("lease_owner", Text),
    Column("lease_host", Text),
    Column("lease_token", BigInteger, nullable=False),
    Column("lease_expires_at", Double),
    Column("lease_expiries", Integer, nullable=False),
    Column("max_lease_expiries", Integer, nullable=False),
    Column("heartbeat_at", Double),
    Column("result", Text),
    Column("error", Text),
    Column("parent_id", BigInteger),
    Column("group_id", Text),
    Column("host", Text),
    Column("affinity_timeout_s", Double),
    # When a job with a preferred host becomes claimable by any host (NULL: never).
    Column("affinity_deadline", Double),
    Column("shipped_from", Text),
    Column("not_before", Double),
    Column("idempotency_key", Text),
    Column("created_at", Double, nullable=False),
    Column("updated_at", Double, nullable=False),
    Column("started_at", Double),
    Column("finished_at", Double),
)

events = Table(
    "events",
    metadata,
    Column("seq", BigInteger, primary_key=True),
    Column("job_id", BigInteger, nullable=False),
    Column("group_id", Text),
    Column("type", Text, nullable=False),
    Column("at", Double, nullable=False),
    Column("data", Text, nullable=False),
)

# Worker hosts and where each serves its store's checkpoints to the others (sprout.worker.shipping).
hosts = Table(
    "hosts",
    metadata,
    Column("name", Text, primary_key=True),
    Column("ship_url", Text),
    Column("seen_at", Double, nullable=False),
)

schema_version = Table(
    "schema_version",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("name", Text, nullable=False),
    Column("applied_at", Double, nullable=False),
)
