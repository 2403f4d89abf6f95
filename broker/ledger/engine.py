"""The ledger's database: engine and sessions, SQLite's multi-process set-up, PostgreSQL's URL and
pool, JSON storage, and the Alembic migrations that own the schema."""

from __future__ import annotations

import json
import logging
import math
import numbers
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Table, create_engine, event, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker
from tenacity import retry, retry_if_exception, stop_after_delay, wait_random

__all__ = ["MIGRATIONS_DIR", "Database", "Repository", "chunks", "json_safe"]

MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "migrations"

log = logging.getLogger(__name__)

# Bound-parameter limits (SQLite 32766, PostgreSQL 65535) cap an IN list; lookups are chunked
# well below both whatever the caller's batch size.
_IN_CHUNK = 500
# Arbitrary constant: the pg_advisory_xact_lock key that serialises concurrent migrations.
_PG_MIGRATE_LOCK_KEY = 0x4C454447  # "LEDG"
_SQLITE_BUSY_TIMEOUT_MS = 30_000
# Execution option marking a write transaction (see `_configure_sqlite`).
_WRITE_OPTION = "ledger_write"

# The upsert constructs (INSERT ... ON CONFLICT) are dialect-specific in SQLAlchemy.
_INSERTS: dict[str, Callable[[Table], Any]] = {
    "sqlite": sqlite.insert,
    "postgresql": postgresql.insert,
}


def json_safe(value: Any) -> Any:
    """Make metrics/specs storable as JSON on every backend.

    Non-finite floats become null (JSON has no NaN; PostgreSQL rejects it) and numpy/torch
    scalars become Python numbers.

    Raises:
        TypeError: a value that has no JSON form.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    raise TypeError(f"not JSON-serialisable: {type(value).__name__} ({value!r})")


def _json_dumps(value: Any) -> str:
    return json.dumps(json_safe(value), allow_nan=False)


def chunks(items: Sequence[Any], size: int = _IN_CHUNK) -> Iterator[Sequence[Any]]:
    """`items` in slices of at most `size`: for IN lists under the bound-parameter limits."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _normalise_url(url: str | URL) -> URL:
    u = make_url(url)
    # A bare postgresql:// means psycopg2, which is not installed; psycopg 3 is.
    if u.drivername == "postgresql":
        u = u.set(drivername="postgresql+psycopg")
    return u


def _configure_sqlite(engine: Engine, url: URL) -> None:
    """Make SQLite safe for several processes writing at once.

    WAL lets readers proceed during a write; the busy timeout makes a writer wait for the lock
    instead of failing with "database is locked". pysqlite's own transaction handling is turned
    off so that we emit BEGIN ourselves: write transactions use BEGIN IMMEDIATE, which takes the
    write lock up front. A deferred transaction that reads and then writes fails at once with
    SQLITE_BUSY (the busy handler is not consulted) when another writer committed in between.
    """
    if url.database and url.database != ":memory:" and not url.database.startswith("file:"):
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        # busy_timeout first: switching to WAL itself needs the lock.
        cur.execute(f"PRAGMA busy_timeout = {_SQLITE_BUSY_TIMEOUT_MS}")
        _use_wal(cur)
        # Durable at each checkpoint rather than each commit; safe with WAL (no corruption).
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        write = conn.get_execution_options().get(_WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


@retry(
    retry=retry_if_exception(lambda e: isinstance(e, sqlite3.OperationalError) and "locked" in str(e)),
    wait=wait_random(0.01, 0.2),
    stop=stop_after_delay(_SQLITE_BUSY_TIMEOUT_MS / 1000),
    reraise=True,
)
def _use_wal(cur: sqlite3.Cursor) -> None:
    """Switch the file to WAL (persistent: done once per file), retried while the lock is taken.

    Several processes opening a new file at once race for the switch, and SQLite can answer
    "database is locked" to it without consulting the busy handler: a retry sees WAL already set.
    """
    if cur.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
        cur.execute("PRAGMA journal_mode = WAL")


class Database:
    """One engine on the ledger database, with its read and write transactions.

    Args:
        url: SQLAlchemy URL, e.g. ``sqlite:///runs/ledger.db`` (parent directory created) or
            ``postgresql+psycopg://user@host/db`` (a bare ``postgresql://`` means psycopg 3).

    Raises:
        ValueError: the URL's backend is neither SQLite nor PostgreSQL.
    """

    def __init__(self, url: str | URL) -> None:
        self.url = _normalise_url(url)
        self.dialect = self.url.get_dialect().name
        if self.dialect not in _INSERTS:
            raise ValueError(f"unsupported ledger backend {self.dialect!r}; valid: {', '.join(sorted(_INSERTS))}")
        kwargs: dict[str, Any] = {"json_serializer": _json_dumps}
        if self.dialect == "postgresql":
            # Long-lived services outlive server restarts and idle-connection reaping.
            kwargs["pool_pre_ping"] = True
        self.engine: Engine = create_engine(self.url, **kwargs)
        if self.dialect == "sqlite":
            _configure_sqlite(self.engine, self.url)
        # The INSERT construct with this dialect's ON CONFLICT clauses.
        self.insert = _INSERTS[self.dialect]
        self._read_sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(
            self.engine.execution_options(**{_WRITE_OPTION: True}), expire_on_commit=False
        )

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A write transaction (on SQLite it takes the write lock up front), committed on exit."""
        with self._write_sessions.begin() as session:
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A read transaction."""
        with self._read_sessions.begin() as session:
            yield session

    def upgrade(self, revision: str = "head") -> None:
        """Run Alembic migrations up to `revision` in one transaction, serialised across processes.

        A database already at `revision` is left untouched.
        """
        with self.write() as session:
            conn = session.connection()
            if self.dialect == "postgresql":
                # Released at commit; DDL is transactional on PostgreSQL, so a second process
                # waits here and then finds the schema at head. On SQLite the write transaction
                # (BEGIN IMMEDIATE) already serialises migrations the same way.
                conn.execute(select(func.pg_advisory_xact_lock(_PG_MIGRATE_LOCK_KEY)))
            before = MigrationContext.configure(conn).get_current_revision()
            command.upgrade(_alembic_config(conn), revision)
            after = MigrationContext.configure(conn).get_current_revision()
        if after != before:  # the services keep alembic's logger at WARNING (shared.logs)
            log.info("ledger schema migrated from %s to %s", before or "empty", after)

    def current_revision(self) -> str | None:
        """The Alembic revision the database is at; None before the first migration."""
        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def close(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()


def _alembic_config(connection: Connection) -> Config:
    """An Alembic Config for the migrations shipped in `broker/migrations`, run on `connection`.

    Built in code so that neither an alembic.ini nor the working directory matters.
    """
    cfg = Config(attributes={"connection": connection})
    # ConfigParser interpolation: a literal % must be doubled.
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return cfg


class Repository:
    """The reads and writes of one family of tables, over a `Database` shared with the others.

    Contract for every write method: one transaction per call, many rows per call, idempotent.
    """

    def __init__(self, db: Database) -> None:
        self._db = db
