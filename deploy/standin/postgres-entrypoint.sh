#!/bin/sh
# The official postgres image's start-up, reduced to what docker-compose.yml uses: an empty data
# directory is initialised with POSTGRES_USER (superuser), POSTGRES_PASSWORD and POSTGRES_DB, and the
# server listens on every address with password authentication for remote clients.
set -eu
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
mkdir -p "$PGDATA" /var/run/postgresql
chown -R postgres:postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
as_pg() { runuser -u postgres -- "$@"; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}" > "$pwfile"
    chown postgres "$pwfile"
    as_pg initdb --username="$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 -D "$PGDATA"
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    if [ "$POSTGRES_DB" != "postgres" ]; then
        as_pg postgres --single -D "$PGDATA" -j postgres <<SQL
CREATE DATABASE "$POSTGRES_DB";
SQL
    fi
fi
if [ "$1" = "postgres" ]; then
    shift
    exec runuser -u postgres -- postgres -D "$PGDATA" -c listen_addresses='*' "$@"
fi
exec "$@"
