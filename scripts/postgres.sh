#!/usr/bin/env bash
# Make sure a local PostgreSQL answers (Debian's, started once), make a database, print its URL for Prefect.
#   eval "$(scripts/postgres.sh [DATABASE])"    # exports PREFECT_API_DATABASE_CONNECTION_URL
#   scripts/postgres.sh DATABASE drop            # removes that database (a test session's, when it ends)
# A Prefect server that many workers share belongs on PostgreSQL, as Prefect recommends past one
# machine: SQLite answers "database is locked" once a few workers poll and report at once.
# A server that already answers on the port is reused; Debian's postgresql is installed if missing.
set -euo pipefail

database=${1:-prefect}
port=${E31_POSTGRES_PORT:-55432}
data=${E31_POSTGRES_DATA:-/var/lib/e31-postgres}
socket_dir=/run/e31-postgres

# One caller at a time sets it up (parallel test sessions each ask for a database at once).
exec 9>"${TMPDIR:-/tmp}/e31-postgres.lock"
flock 9

if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "installing postgresql ..." >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
fi
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
as_postgres() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$*"; else sh -c "$*"; fi; }

if ! "$bin/pg_isready" -q -h 127.0.0.1 -p "$port"; then
  mkdir -p "$data" "$socket_dir"
  [ "$(id -u)" = 0 ] && chown postgres:postgres "$data" "$socket_dir"
  if [ ! -f "$data/PG_VERSION" ]; then
    as_postgres "$bin/initdb -D $data -A trust -U postgres" >/dev/null
  fi
  as_postgres "$bin/pg_ctl -D $data -l $data/server.log -w -o \"-p $port -k $socket_dir \
    -c listen_addresses=127.0.0.1 -c max_connections=500\" start" >/dev/null 9>&-  # the server keeps no lock
fi
psql=("$bin/psql" -q -h 127.0.0.1 -p "$port" -U postgres -d postgres)
if [ "${2:-}" = drop ]; then
  "${psql[@]}" -c "DROP DATABASE IF EXISTS \"$database\" WITH (FORCE)" >/dev/null
  exit 0
fi
if [ -z "$("${psql[@]}" -tAc "SELECT 1 FROM pg_database WHERE datname = '$database'")" ]; then
  "${psql[@]}" -c "CREATE DATABASE \"$database\"" >/dev/null
fi
echo "export PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://postgres@127.0.0.1:$port/$database"
