#!/usr/bin/env bash
# Start (or reuse) a throwaway PostgreSQL cluster for the Run Store tests.
#
# Idempotent: installs the `postgresql` package with apt when its binaries are
# missing, initialises a cluster in $SPROUT_PG_DIR once, starts it when it is not
# running, creates the user and database when absent, and prints the SQLAlchemy
# URL on its last line:
#
#   export SPROUT_TEST_POSTGRES_URL="$(bash ops/postgres_for_tests.sh | tail -n1)"
#
# The cluster trades durability for speed (fsync off): it is for tests only.
# Stop it with: runuser -u postgres -- "$(dirname "$(command -v initdb)")/pg_ctl" -D "$SPROUT_PG_DIR" stop
set -euo pipefail

PG_DIR="${SPROUT_PG_DIR:-/tmp/sprout-test-pg}"
PG_PORT="${SPROUT_PG_PORT:-54329}"
PG_USER="${SPROUT_PG_USER:-sprout}"
PG_PASSWORD="${SPROUT_PG_PASSWORD:-sprout}"
PG_DB="${SPROUT_PG_DB:-sprout_test}"

log() { echo "postgres_for_tests: $*" >&2; }

find_bindir() {
    local dir
    for dir in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
        if [[ -x "$dir/initdb" && -x "$dir/pg_ctl" ]]; then
            echo "$dir"
            return 0
        fi
    done
    return 1
}

if ! BIN="$(find_bindir)"; then
    log "installing postgresql with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq postgresql >&2
    BIN="$(find_bindir)" || { log "postgresql installed but initdb not found"; exit 1; }
fi

if [[ "$(id -u)" == 0 ]]; then
    id postgres >/dev/null 2>&1 || useradd --system --create-home postgres
    as_pg() { runuser -u postgres -- "$@"; }
else
    as_pg() { "$@"; }
fi

if [[ ! -s "$PG_DIR/PG_VERSION" ]]; then
    log "initialising a cluster in $PG_DIR"
    mkdir -p "$PG_DIR"
    [[ "$(id -u)" == 0 ]] && chown postgres: "$PG_DIR"
    chmod 700 "$PG_DIR"
    pwfile="$(mktemp)"
    echo postgres >"$pwfile"
    [[ "$(id -u)" == 0 ]] && chown postgres: "$pwfile"
    as_pg "$BIN/initdb" -D "$PG_DIR" --username=postgres --pwfile="$pwfile" \
        --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 >&2
    rm -f "$pwfile"
fi

if ! as_pg "$BIN/pg_ctl" -D "$PG_DIR" status >/dev/null 2>&1; then
    log "starting the cluster on 127.0.0.1:$PG_PORT"
    as_pg "$BIN/pg_ctl" -D "$PG_DIR" -l "$PG_DIR/server.log" -w -t 60 start -o \
        "-p $PG_PORT -k $PG_DIR -c listen_addresses=127.0.0.1 -c max_connections=300 \
         -c fsync=off -c synchronous_commit=off -c full_page_writes=off" >&2
fi

psql_pg() { as_pg "$BIN/psql" -h "$PG_DIR" -p "$PG_PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -qtA "$@"; }

if [[ -z "$(psql_pg -c "SELECT 1 FROM pg_roles WHERE rolname = '$PG_USER'")" ]]; then
    psql_pg -c "CREATE ROLE \"$PG_USER\" LOGIN PASSWORD '$PG_PASSWORD'" >&2
fi
if [[ -z "$(psql_pg -c "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'")" ]]; then
    psql_pg -c "CREATE DATABASE \"$PG_DB\" OWNER \"$PG_USER\"" >&2
fi

echo "postgresql+psycopg://$PG_USER:$PG_PASSWORD@127.0.0.1:$PG_PORT/$PG_DB"
