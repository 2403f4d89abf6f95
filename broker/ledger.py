"""The SQL ledger: the source of truth for jobs, samples, policy versions and train steps.

Redis is only the transport; every fact a job's history depends on lands here, keyed so that a
redelivered message has no second effect (DESIGN.md, "The ledger"). Each process (generator,
reward, trainer, API) opens its own `Ledger`; all of them write concurrently.

Contract for every write method: one transaction per call, many rows per call, idempotent.
Only plain dicts cross the boundary; no ORM object escapes this module.

SQLite (default) and PostgreSQL (production) are supported. The schema is owned by the Alembic
migrations in `broker/migrations`; the models below must match them (a test compares the two).

Operators migrate an existing database with::

    python -m broker.ledger upgrade --url postgresql+psycopg://user@host/db
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import numbers
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar, cast

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    bindparam,
    create_engine,
    event,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.schema import MetaData
from sqlalchemy.sql.elements import ColumnElement

from shared.schema import clean_text

__all__ = [
    "ADMIN_TASK_KINDS",
    "ADMIN_TASK_STATES",
    "EVAL_SOURCES",
    "JOB_STATES",
    "REWARD_STATUSES",
    "SAMPLE_KINDS",
    "SAMPLE_STATUSES",
    "USED_STATUSES",
    "AdminTask",
    "Base",
    "Eval",
    "GeneratorLoad",
    "Job",
    "Ledger",
    "PolicyVersion",
    "Sample",
    "TrainStep",
    "main",
    "row_error",
    "write_isolating",
]

log = logging.getLogger(__name__)

JOB_STATES = ("submitted", "running", "paused", "stopping", "stopped", "finished", "failed", "cancelled")
SAMPLE_KINDS = ("train", "eval")
SAMPLE_STATUSES = ("generated", "scored", "trained", "dropped", "evaluated")
# Terminal sample statuses: the trainer (or evaluator) used the sample; it is never used twice.
USED_STATUSES = ("trained", "dropped", "evaluated")
REWARD_STATUSES = ("ok", "timeout", "error")
_UNUSED_STATUSES = ("generated", "scored")
EVAL_SOURCES = ("pipeline", "checkpoint")
ADMIN_TASK_KINDS = ("evaluate", "export")
ADMIN_TASK_STATES = ("queued", "running", "succeeded", "failed")

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

# Bound-parameter limits (SQLite 32766, PostgreSQL 65535) cap an IN list; lookups are chunked
# well below both whatever the caller's batch size.
_IN_CHUNK = 500
# Arbitrary constant: the pg_advisory_xact_lock key that serialises concurrent migrations.
_PG_MIGRATE_LOCK_KEY = 0x4C454447  # "LEDG"
_SQLITE_BUSY_TIMEOUT_MS = 30_000
# Execution option marking a write transaction (see `_configure_sqlite`).
_WRITE_OPTION = "ledger_write"


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend.

    SQLite has no timezone type and returns naive values; PostgreSQL returns values in the
    session's time zone. Both come back as aware UTC datetimes. Naive inputs are rejected
    because their zone is a guess.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware datetime")
        value = value.astimezone(timezone.utc)
        # Stored naive on SQLite so that text ordering equals time ordering.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


# BIGINT for row ids on PostgreSQL (samples outgrow 2**31), but SQLite only autoincrements a
# column declared exactly INTEGER.
_RowId = BigInteger().with_variant(Integer(), "sqlite")

# Deterministic constraint names so that later migrations can refer to them on both backends.
_NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=_NAMING)


# Enumerated columns (state, status, kind) are plain strings validated in Python rather than
# CHECK constraints: adding a value must not need a table rebuild on SQLite's samples table.


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    name: Mapped[str] = mapped_column(String)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String, default="submitted")
    # Last completed trainer step; 0 until the first one completes.
    step: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=_utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=_utcnow)
    # When a trainer first started the job: wall-clock curves (evaluations) count from here.
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class PolicyVersion(Base):
    __tablename__ = "policy_versions"

    job_id: Mapped[str] = mapped_column(String, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    checksum: Mapped[str] = mapped_column(String)
    num_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=_utcnow)


class GeneratorLoad(Base):
    __tablename__ = "generator_loads"

    job_id: Mapped[str] = mapped_column(String, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    generator_id: Mapped[str] = mapped_column(String, primary_key=True)
    fingerprint: Mapped[str | None] = mapped_column(String)
    loaded_at: Mapped[datetime] = mapped_column(UTCDateTime, default=_utcnow)


class Sample(Base):
    """One completion, from generation to its use (or drop) by the trainer."""

    __tablename__ = "samples"
    __table_args__ = (
        UniqueConstraint("msg_id"),
        # Also serves lookups by job_id alone (leftmost prefix), so no separate job_id index.
        Index(None, "job_id", "status"),
    )

    id: Mapped[int] = mapped_column(_RowId, primary_key=True, autoincrement=True)
    msg_id: Mapped[str] = mapped_column(String)
    job_id: Mapped[str] = mapped_column(String)
    group_id: Mapped[str] = mapped_column(String)
    sample_index: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String, default="train")
    prompt_index: Mapped[int] = mapped_column(Integer)
    generator_id: Mapped[str] = mapped_column(String)
    gen_version_min: Mapped[int] = mapped_column(Integer)
    gen_version_max: Mapped[int] = mapped_column(Integer)
    num_prompt_tokens: Mapped[int] = mapped_column(Integer)
    num_completion_tokens: Mapped[int] = mapped_column(Integer)
    completion: Mapped[str] = mapped_column(Text)
    finish_reason: Mapped[str | None] = mapped_column(String)
    reward: Mapped[float | None] = mapped_column(Float)
    # "ok", "timeout" or "error" (the job's reward policy then set `reward`); details: a weighted
    # sum's terms ({"components": {...}}) and the reason a reward failed ({"reason": "..."}).
    reward_status: Mapped[str | None] = mapped_column(String)
    reward_details: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    eval_set: Mapped[str | None] = mapped_column(String)  # kind "eval": the named evaluation set
    status: Mapped[str] = mapped_column(String, default="generated")
    drop_reason: Mapped[str | None] = mapped_column(String)
    # The trainer's policy version when it used or dropped the sample.
    trainer_version: Mapped[int | None] = mapped_column(Integer)
    # trainer_version - gen_version_min: how many policy updates old the sample was at use.
    staleness: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=_utcnow)
    scored_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class TrainStep(Base):
    __tablename__ = "train_steps"

    job_id: Mapped[str] = mapped_column(String, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    # The policy version this step produced.
    policy_version: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=_utcnow)


class Eval(Base):
    """A held-out evaluation result; one per (job, step, source), a re-run replaces it.

    `source` is `pipeline` for the trainer's round through the running generators, `checkpoint`
    for an offline evaluation of the step's checkpoint (the admin worker's task).
    """

    __tablename__ = "evals"

    job_id: Mapped[str] = mapped_column(String, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    source: Mapped[str] = mapped_column(String, primary_key=True, server_default="pipeline")
    # The named evaluation set (the job spec's eval_sets; `held_out` is the task's test split).
    name: Mapped[str] = mapped_column(String, primary_key=True, server_default="held_out")
    policy_version_min: Mapped[int] = mapped_column(Integer)
    policy_version_max: Mapped[int] = mapped_column(Integer)
    reward_mean: Mapped[float] = mapped_column(Float)
    n: Mapped[int] = mapped_column(Integer)
    # pass@k / mean@n / maj@k and the like ({"pass@4": 0.8, ...}); None for a plain greedy round.
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Seconds from the job's start (jobs.started_at) to the round's completion.
    wall_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=_utcnow)


class Checkpoint(Base):
    """A committed trainer checkpoint (an HF-format directory) of one job at one step."""

    __tablename__ = "checkpoints"

    job_id: Mapped[str] = mapped_column(String, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    policy_version: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=_utcnow)


class AdminTask(Base):
    """A long admin task (Celery) on a job: what was asked, by whom, and how it ended."""

    __tablename__ = "admin_tasks"

    id: Mapped[str] = mapped_column(String, primary_key=True)  # the Celery task id
    job_id: Mapped[str] = mapped_column(String, index=True)
    kind: Mapped[str] = mapped_column(String)  # one of ADMIN_TASK_KINDS
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String)  # one of ADMIN_TASK_STATES
    actor: Mapped[str] = mapped_column(String)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    # Deliveries that started the task: above 1 after a worker died mid-task (acks_late).
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=_utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class JobChange(Base):
    """Who changed what on a job, and when (live knobs, pause/resume, stop, cancel)."""

    __tablename__ = "job_changes"

    id: Mapped[int] = mapped_column(_RowId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String, index=True)
    actor: Mapped[str] = mapped_column(String)
    changes: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=_utcnow)


_jobs = cast(Table, Job.__table__)
_job_changes = cast(Table, JobChange.__table__)
_checkpoints = cast(Table, Checkpoint.__table__)
_policy_versions = cast(Table, PolicyVersion.__table__)
_generator_loads = cast(Table, GeneratorLoad.__table__)
_samples = cast(Table, Sample.__table__)
_train_steps = cast(Table, TrainStep.__table__)
_evals = cast(Table, Eval.__table__)
_admin_tasks = cast(Table, AdminTask.__table__)

_SAMPLE_COLUMNS = frozenset(c.name for c in _samples.columns) - {"id"}
_SAMPLE_REQUIRED = frozenset(
    {
        "msg_id",
        "job_id",
        "group_id",
        "sample_index",
        "prompt_index",
        "generator_id",
        "gen_version_min",
        "num_prompt_tokens",
        "num_completion_tokens",
        "completion",
    }
)

# The upsert constructs (INSERT ... ON CONFLICT) are dialect-specific in SQLAlchemy.
_INSERTS: dict[str, Callable[[Table], Any]] = {
    "sqlite": sqlite.insert,
    "postgresql": postgresql.insert,
}


def _json_safe(value: Any) -> Any:
    """Make metrics/specs storable as JSON on every backend.

    Non-finite floats become null (JSON has no NaN; PostgreSQL rejects it) and numpy/torch
    scalars become Python numbers.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    raise TypeError(f"not JSON-serialisable: {type(value).__name__} ({value!r})")


def _json_dumps(value: Any) -> str:
    return json.dumps(_json_safe(value), allow_nan=False)


def _check(value: str, allowed: Sequence[str], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(allowed)}")


def _chunks(items: Sequence[Any], size: int = _IN_CHUNK) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _sample_filters(
    job_id: str,
    *,
    status: str | None,
    kind: str | None,
    min_trainer_version: int | None,
    max_trainer_version: int | None,
    min_staleness: int | None,
    max_staleness: int | None,
    min_reward: float | None,
    max_reward: float | None,
) -> list[ColumnElement[bool]]:
    """WHERE conditions shared by `Ledger.samples` and `Ledger.count_samples`."""
    c = _samples.c
    where: list[ColumnElement[bool]] = [c.job_id == job_id]
    if status is not None:
        _check(status, SAMPLE_STATUSES, "sample status")
        where.append(c.status == status)
    if kind is not None:
        _check(kind, SAMPLE_KINDS, "sample kind")
        where.append(c.kind == kind)
    bounds: tuple[tuple[Any, float | None, float | None], ...] = (
        (c.trainer_version, min_trainer_version, max_trainer_version),
        (c.staleness, min_staleness, max_staleness),
        (c.reward, min_reward, max_reward),
    )
    for column, lo, hi in bounds:
        if lo is not None:
            where.append(column >= lo)
        if hi is not None:
            where.append(column <= hi)
    return where


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
        cur.execute("PRAGMA journal_mode = WAL")
        # Durable at each checkpoint rather than each commit; safe with WAL (no corruption).
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        write = conn.get_execution_options().get(_WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


class Ledger:
    """Synchronous access to the ledger database, one instance per process.

    Args:
        url: SQLAlchemy URL, e.g. ``sqlite:///runs/ledger.db`` (parent directory created) or
            ``postgresql+psycopg://user@host/db`` (a bare ``postgresql://`` means psycopg 3).
        migrate: run Alembic ``upgrade head`` first. Safe when several processes start at once
            (PostgreSQL: advisory lock; SQLite: the database write lock).

    Raises:
        ValueError: the URL's backend is neither SQLite nor PostgreSQL.
    """

    def __init__(self, url: str | URL, *, migrate: bool = True) -> None:
        self.url = _normalise_url(url)
        dialect = self.url.get_dialect().name
        if dialect not in _INSERTS:
            raise ValueError(
                f"unsupported ledger backend {dialect!r}; valid: {', '.join(sorted(_INSERTS))}"
            )
        kwargs: dict[str, Any] = {"json_serializer": _json_dumps}
        if dialect == "postgresql":
            # Long-lived services outlive server restarts and idle-connection reaping.
            kwargs["pool_pre_ping"] = True
        self.engine: Engine = create_engine(self.url, **kwargs)
        if dialect == "sqlite":
            _configure_sqlite(self.engine, self.url)
        self._insert = _INSERTS[dialect]
        self._read_sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(
            self.engine.execution_options(**{_WRITE_OPTION: True}), expire_on_commit=False
        )
        if migrate:
            self.upgrade()

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({self.url.render_as_string(hide_password=True)!r})"

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with self._write_sessions.begin() as session:
            yield session

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._read_sessions.begin() as session:
            yield session

    # -- migrations -----------------------------------------------------------------------------

    def upgrade(self, revision: str = "head") -> None:
        """Run Alembic migrations up to `revision` in one transaction, serialised across processes.

        A database already at `revision` is left untouched.
        """
        with self._write() as session:
            conn = session.connection()
            if self.engine.dialect.name == "postgresql":
                # Released at commit; DDL is transactional on PostgreSQL, so a second process
                # waits here and then finds the schema at head. On SQLite the write transaction
                # (BEGIN IMMEDIATE) already serialises migrations the same way.
                conn.execute(select(func.pg_advisory_xact_lock(_PG_MIGRATE_LOCK_KEY)))
            command.upgrade(_alembic_config(conn), revision)

    def current_revision(self) -> str | None:
        """The Alembic revision the database is at; None before the first migration."""
        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    # -- jobs -----------------------------------------------------------------------------------

    def create_job(
        self, job_id: str, name: str, spec: dict[str, Any], state: str = "submitted"
    ) -> bool:
        """Insert a job; returns False (and changes nothing) if `job_id` already exists."""
        _check(state, JOB_STATES, "job state")
        now = _utcnow()
        stmt = (
            self._insert(_jobs)
            .values(
                id=job_id,
                name=name,
                spec=spec,
                state=state,
                step=0,
                created_at=now,
                updated_at=now,
            )
            .on_conflict_do_nothing(index_elements=["id"])
            # RETURNING tells inserted from skipped; an INSERT's rowcount is -1 on psycopg
            # unless SQLAlchemy is asked to preserve it.
            .returning(_jobs.c.id)
        )
        with self._write() as s:
            return s.execute(stmt).first() is not None

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        with self._read() as s:
            row = s.execute(select(_jobs).where(_jobs.c.id == job_id)).mappings().first()
        return dict(row) if row is not None else None

    def list_jobs(self, limit: int = 100, states: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Newest first; only jobs in `states` when given."""
        stmt = select(_jobs).order_by(_jobs.c.created_at.desc(), _jobs.c.id.desc()).limit(limit)
        if states is not None:
            states = tuple(states)
            for state in states:
                _check(state, JOB_STATES, "job state")
            stmt = stmt.where(_jobs.c.state.in_(states))
        with self._read() as s:
            return [dict(r) for r in s.execute(stmt).mappings()]

    def latest_job(self, states: Iterable[str] = ("submitted", "running")) -> dict[str, Any] | None:
        """The newest job in one of `states`, or None."""
        states = tuple(states)
        for state in states:
            _check(state, JOB_STATES, "job state")
        stmt = (
            select(_jobs)
            .where(_jobs.c.state.in_(states))
            .order_by(_jobs.c.created_at.desc(), _jobs.c.id.desc())
            .limit(1)
        )
        with self._read() as s:
            row = s.execute(stmt).mappings().first()
        return dict(row) if row is not None else None

    def set_job_state(self, job_id: str, state: str, error: str | None = None) -> None:
        """Set a job's state (and error text; None clears it).

        Raises:
            ValueError: unknown state.
            LookupError: no such job.
        """
        _check(state, JOB_STATES, "job state")
        self._update_job(job_id, state=state, error=error)

    def mark_job_started(self, job_id: str) -> None:
        """Set the job's start time to now unless a trainer already started it (a restart keeps
        the first start: wall-clock curves count from there)."""
        stmt = (update(_jobs).where(_jobs.c.id == job_id, _jobs.c.started_at.is_(None))
                .values(started_at=_utcnow()))
        with self._write() as s:
            s.execute(stmt)

    def set_job_step(self, job_id: str, step: int) -> None:
        """Record `step` as the job's last completed trainer step.

        Raises:
            LookupError: no such job.
        """
        self._update_job(job_id, step=step)

    def _update_job(self, job_id: str, **values: Any) -> None:
        stmt = update(_jobs).where(_jobs.c.id == job_id).values(**values, updated_at=_utcnow())
        with self._write() as s:
            if s.connection().execute(stmt).rowcount == 0:
                raise LookupError(f"no job {job_id!r} in the ledger")

    # -- samples --------------------------------------------------------------------------------

    def record_generated(self, rows: Sequence[dict[str, Any]]) -> int:
        """Insert sample rows; rows whose msg_id is already present are skipped.

        Args:
            rows: dicts keyed by `samples` column names. Required: msg_id, job_id, group_id,
                sample_index, prompt_index, generator_id, gen_version_min,
                num_prompt_tokens, num_completion_tokens, completion. Defaults:
                gen_version_max = gen_version_min, kind "train", status "generated",
                created_at now, everything else null.

        Returns:
            Number of rows inserted (excludes duplicates). Within one call, row ids follow
            msg_id order.

        Raises:
            ValueError: unknown or missing keys, or an invalid kind/status.
        """
        if not rows:
            return 0
        now = _utcnow()
        full = []
        for row in rows:
            unknown = row.keys() - _SAMPLE_COLUMNS
            missing = _SAMPLE_REQUIRED - row.keys()
            if unknown or missing:
                raise ValueError(
                    f"sample {row.get('msg_id')!r}: unknown keys {sorted(unknown)}, "
                    f"missing keys {sorted(missing)}; columns: {sorted(_SAMPLE_COLUMNS)}"
                )
            # executemany needs the same keys in every row.
            r: dict[str, Any] = {**dict.fromkeys(_SAMPLE_COLUMNS), **row}
            r["kind"] = r["kind"] or "train"
            r["status"] = r["status"] or "generated"
            r["created_at"] = r["created_at"] or now
            if r["gen_version_max"] is None:
                r["gen_version_max"] = r["gen_version_min"]
            _check(r["kind"], SAMPLE_KINDS, "sample kind")
            _check(r["status"], SAMPLE_STATUSES, "sample status")
            full.append(r)
        # Sorted so that concurrent writers take unique-index locks in the same order (no
        # deadlocks on PostgreSQL).
        full.sort(key=lambda r: r["msg_id"])
        stmt = self._insert(_samples).on_conflict_do_nothing(index_elements=["msg_id"])
        with self._write() as s:
            # A plain executemany (psycopg pipelines it) is several times faster here than
            # INSERT ... RETURNING batches; SQLAlchemy only reports an INSERT's rowcount (the sum
            # over the batch, excluding skipped duplicates) when asked to preserve it.
            conn = s.connection(execution_options={"preserve_rowcount": True})
            return conn.execute(stmt, full).rowcount

    def record_scored(self, items: Sequence[tuple[Any, ...]]) -> int:
        """Set rewards; only samples still 'generated' change.

        Args:
            items: (msg_id, reward) or (msg_id, reward, reward_status, reward_details) tuples;
                reward_status is "ok", "timeout" or "error" (default "ok"), reward_details a
                JSON-safe dict ({"components": {...}, "reason": "..."}) or None.

        Returns:
            Number of samples that moved to 'scored' (repeats and unknown msg_ids count 0).
        """
        return len(self.record_scored_ids(items))

    def record_scored_ids(self, items: Sequence[tuple[Any, ...]]) -> set[str]:
        """`record_scored`, returning the msg_ids scored by this call: those that moved to
        'scored', and those already scored from the same source, i.e. whose stored
        reward_details["entry"] equals this item's (a retry of a write whose publish was lost).
        A sample scored from another entry (a second stream entry carrying its msg_id), used or
        unknown is not among them. Concurrent callers scoring one msg_id: exactly one of them gets
        it (the rows are locked FOR UPDATE on PostgreSQL; SQLite writers are serialised)."""
        if not items:
            return set()
        now = _utcnow()
        stmt = (
            update(_samples)
            .where(_samples.c.msg_id == bindparam("b_msg_id"), _samples.c.status == "generated")
            .values(reward=bindparam("b_reward"), reward_status=bindparam("b_reward_status"),
                    reward_details=bindparam("b_reward_details", type_=JSON), status="scored", scored_at=now)
        )
        params = []
        for item in sorted(items, key=lambda it: it[0]):
            msg_id, reward = item[0], float(item[1])
            status = item[2] if len(item) > 2 else "ok"
            _check(status, REWARD_STATUSES, "reward status")
            details = _json_safe(item[3]) if len(item) > 3 and item[3] else None
            params.append({"b_msg_id": msg_id, "b_reward": reward, "b_reward_status": status,
                           "b_reward_details": details})
        source = {p["b_msg_id"]: (p["b_reward_details"] or {}).get("entry") for p in params}
        moving: set[str] = set()
        with self._write() as s:
            for chunk in _chunks(sorted(source)):
                c = _samples.c
                found = select(c.msg_id, c.status, c.reward_details).where(c.msg_id.in_(chunk))
                if self.engine.dialect.name == "postgresql":
                    found = found.with_for_update()
                for msg_id, status, details in s.execute(found):
                    entry = source[msg_id]
                    if status == "generated" or (status == "scored" and entry is not None
                                                 and isinstance(details, dict) and details.get("entry") == entry):
                        moving.add(msg_id)
            s.connection().execute(stmt, params)
        return moving

    def record_used(self, items: Sequence[dict[str, Any]]) -> int:
        """Mark samples used by the trainer or evaluator; each sample is used at most once.

        Args:
            items: dicts with msg_id, status ('trained' | 'dropped' | 'evaluated'),
                trainer_version, and optionally staleness (default: trainer_version -
                gen_version_min, computed in SQL), drop_reason, reward (kept if absent).

        Returns:
            Number of samples changed; only 'generated' or 'scored' samples change.

        Raises:
            ValueError: unknown status or keys.
        """
        if not items:
            return 0
        allowed = {"msg_id", "status", "trainer_version", "staleness", "drop_reason", "reward"}
        params = []
        for item in items:
            unknown = item.keys() - allowed
            if unknown or "msg_id" not in item or "status" not in item:
                raise ValueError(
                    f"used item {item!r}: needs msg_id and status, allowed keys {sorted(allowed)}"
                )
            _check(item["status"], USED_STATUSES, "used status")
            params.append(
                {
                    "b_msg_id": item["msg_id"],
                    "b_status": item["status"],
                    "b_trainer_version": item.get("trainer_version"),
                    "b_staleness": item.get("staleness"),
                    "b_drop_reason": item.get("drop_reason"),
                    "b_reward": item.get("reward"),
                }
            )
        params.sort(key=lambda p: p["b_msg_id"])
        trainer_version = bindparam("b_trainer_version", type_=Integer)
        stmt = (
            update(_samples)
            .where(
                _samples.c.msg_id == bindparam("b_msg_id"),
                # Not IN (...): expanding parameters are not allowed with executemany.
                or_(*(_samples.c.status == st for st in _UNUSED_STATUSES)),
            )
            .values(
                status=bindparam("b_status", type_=String),
                trainer_version=trainer_version,
                staleness=func.coalesce(
                    bindparam("b_staleness", type_=Integer),
                    trainer_version - _samples.c.gen_version_min,
                ),
                drop_reason=bindparam("b_drop_reason", type_=String),
                reward=func.coalesce(bindparam("b_reward", type_=Float), _samples.c.reward),
                used_at=_utcnow(),
            )
        )
        with self._write() as s:
            return s.connection().execute(stmt, params).rowcount

    def samples(
        self,
        job_id: str,
        *,
        status: str | None = None,
        kind: str | None = None,
        min_trainer_version: int | None = None,
        max_trainer_version: int | None = None,
        min_staleness: int | None = None,
        max_staleness: int | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[dict[str, Any]]:
        """A job's samples in insertion order (row id, so pages are stable), optionally filtered.

        Bounds are inclusive; a bound on trainer_version, staleness or reward excludes samples
        where that column is still null (not yet used, or not yet scored).

        Raises:
            ValueError: unknown status or kind.
        """
        where = _sample_filters(
            job_id,
            status=status,
            kind=kind,
            min_trainer_version=min_trainer_version,
            max_trainer_version=max_trainer_version,
            min_staleness=min_staleness,
            max_staleness=max_staleness,
            min_reward=min_reward,
            max_reward=max_reward,
        )
        stmt = select(_samples).where(*where).order_by(_samples.c.id).offset(offset).limit(limit)
        with self._read() as s:
            return [dict(r) for r in s.execute(stmt).mappings()]

    def count_samples(
        self,
        job_id: str,
        *,
        status: str | None = None,
        kind: str | None = None,
        min_trainer_version: int | None = None,
        max_trainer_version: int | None = None,
        min_staleness: int | None = None,
        max_staleness: int | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
    ) -> int:
        """How many samples `samples` returns for the same filters without limit and offset.

        Raises:
            ValueError: unknown status or kind.
        """
        where = _sample_filters(
            job_id,
            status=status,
            kind=kind,
            min_trainer_version=min_trainer_version,
            max_trainer_version=max_trainer_version,
            min_staleness=min_staleness,
            max_staleness=max_staleness,
            min_reward=min_reward,
            max_reward=max_reward,
        )
        with self._read() as s:
            return int(s.execute(select(func.count()).select_from(_samples).where(*where)).scalar_one())

    def status_counts(self, job_id: str) -> dict[str, int]:
        """Number of a job's samples per status (statuses with none are absent)."""
        stmt = (
            select(_samples.c.status, func.count())
            .where(_samples.c.job_id == job_id)
            .group_by(_samples.c.status)
        )
        with self._read() as s:
            return {status: int(n) for status, n in s.execute(stmt)}

    def staleness_histogram(self, job_id: str, *, status: str = "trained") -> dict[int, int]:
        """staleness -> number of samples with `status` (default: trained), ascending."""
        _check(status, USED_STATUSES, "used status")
        stmt = (
            select(_samples.c.staleness, func.count())
            .where(
                _samples.c.job_id == job_id,
                _samples.c.status == status,
                _samples.c.staleness.is_not(None),
            )
            .group_by(_samples.c.staleness)
            .order_by(_samples.c.staleness)
        )
        with self._read() as s:
            return {int(k): int(n) for k, n in s.execute(stmt)}

    def used_msg_ids(self, job_id: str, msg_ids: Iterable[str]) -> set[str]:
        """The subset of `msg_ids` already trained, dropped or evaluated."""
        ids = sorted(set(msg_ids))
        found: set[str] = set()
        with self._read() as s:
            for chunk in _chunks(ids):
                stmt = select(_samples.c.msg_id).where(
                    _samples.c.job_id == job_id,
                    _samples.c.msg_id.in_(chunk),
                    _samples.c.status.in_(USED_STATUSES),
                )
                found.update(s.execute(stmt).scalars())
        return found

    # -- policy versions and generator loads -----------------------------------------------------

    def record_policy_version(
        self, job_id: str, version: int, checksum: str, num_bytes: int
    ) -> bool:
        """Record a published policy version; returns False if it was already recorded."""
        stmt = (
            self._insert(_policy_versions)
            .values(
                job_id=job_id,
                version=version,
                checksum=checksum,
                num_bytes=num_bytes,
                created_at=_utcnow(),
            )
            .on_conflict_do_nothing(index_elements=["job_id", "version"])
            .returning(_policy_versions.c.version)
        )
        with self._write() as s:
            return s.execute(stmt).first() is not None

    def policy_versions(self, job_id: str) -> list[dict[str, Any]]:
        """A job's policy versions, ascending."""
        stmt = (
            select(_policy_versions)
            .where(_policy_versions.c.job_id == job_id)
            .order_by(_policy_versions.c.version)
        )
        with self._read() as s:
            return [dict(r) for r in s.execute(stmt).mappings()]

    def record_generator_load(
        self, job_id: str, version: int, generator_id: str, fingerprint: str | None = None
    ) -> bool:
        """Record that a generator loaded a version; returns False if already recorded."""
        stmt = (
            self._insert(_generator_loads)
            .values(
                job_id=job_id,
                version=version,
                generator_id=generator_id,
                fingerprint=fingerprint,
                loaded_at=_utcnow(),
            )
            .on_conflict_do_nothing(index_elements=["job_id", "version", "generator_id"])
            .returning(_generator_loads.c.version)
        )
        with self._write() as s:
            return s.execute(stmt).first() is not None

    def generator_loads(self, job_id: str) -> list[dict[str, Any]]:
        """A job's generator loads ordered by version, then load time."""
        t = _generator_loads
        stmt = (
            select(t)
            .where(t.c.job_id == job_id)
            .order_by(t.c.version, t.c.loaded_at, t.c.generator_id)
        )
        with self._read() as s:
            return [dict(r) for r in s.execute(stmt).mappings()]

    def swap_latencies(self, job_id: str) -> dict[int, float]:
        """Per version: seconds from its publication until the LAST generator that loaded it had
        it loaded (the time until every generator serves it). Versions nobody loaded are absent."""
        published = {r["version"]: r["created_at"] for r in self.policy_versions(job_id)}
        last: dict[int, Any] = {}
        for r in self.generator_loads(job_id):
            if r["version"] in published:
                last[r["version"]] = max(last.get(r["version"], r["loaded_at"]), r["loaded_at"])
        return {v: (t - published[v]).total_seconds() for v, t in sorted(last.items())}

    # -- train steps and evals -------------------------------------------------------------------

    def record_train_step(
        self, job_id: str, step: int, policy_version: int, metrics: dict[str, Any]
    ) -> None:
        """Upsert a train step's metrics (a replayed step overwrites, keeping created_at).

        Non-finite metric values are stored as null.
        """
        ins = self._insert(_train_steps).values(
            job_id=job_id,
            step=step,
            policy_version=policy_version,
            metrics=metrics,
            created_at=_utcnow(),
        )
        stmt = ins.on_conflict_do_update(
            index_elements=["job_id", "step"],
            set_={"policy_version": ins.excluded.policy_version, "metrics": ins.excluded.metrics},
        )
        with self._write() as s:
            s.execute(stmt)

    def record_checkpoint(self, job_id: str, step: int, policy_version: int, path: str) -> None:
        """Record a committed checkpoint (idempotent per job and step)."""
        stmt = (
            self._insert(_checkpoints)
            .values(job_id=job_id, step=step, policy_version=policy_version, path=path, created_at=_utcnow())
            .on_conflict_do_nothing(index_elements=["job_id", "step"])
        )
        with self._write() as s:
            s.execute(stmt)

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        """A job's checkpoints, oldest first."""
        stmt = select(_checkpoints).where(_checkpoints.c.job_id == job_id).order_by(_checkpoints.c.step)
        with self._read() as s:
            return [dict(r) for r in s.execute(stmt).mappings()]

    def record_change(self, job_id: str, actor: str, changes: dict[str, Any]) -> None:
        """Append an audit record: `actor` did `changes` (e.g. {"lr": 1e-5} or {"command": "pause"})."""
        with self._write() as s:
            s.execute(insert(_job_changes).values(job_id=job_id, actor=actor, changes=changes, created_at=_utcnow()))

    def job_changes(self, job_id: str) -> list[dict[str, Any]]:
        """A job's audit records, oldest first."""
        stmt = select(_job_changes).where(_job_changes.c.job_id == job_id).order_by(_job_changes.c.id)
        with self._read() as s:
            return [dict(r) for r in s.execute(stmt).mappings()]

    def update_spec(self, job_id: str, spec: dict[str, Any]) -> None:
        """Replace a job's stored spec (live knob changes, so a restarted service picks them up)."""
        self._update_job(job_id, spec=spec)

    def last_train_step(self, job_id: str) -> dict[str, Any] | None:
        """The job's newest train step, or None before the first."""
        stmt = (
            select(_train_steps).where(_train_steps.c.job_id == job_id).order_by(_train_steps.c.step.desc()).limit(1)
        )
        with self._read() as s:
            row = s.execute(stmt).mappings().first()
        return dict(row) if row is not None else None

    def train_steps(self, job_id: str) -> list[dict[str, Any]]:
        """A job's train steps ordered by step."""
        stmt = (
            select(_train_steps)
            .where(_train_steps.c.job_id == job_id)
            .order_by(_train_steps.c.step)
        )
        with self._read() as s:
            return [dict(r) for r in s.execute(stmt).mappings()]

    def record_eval(
        self,
        job_id: str,
        step: int,
        vmin: int,
        vmax: int,
        reward_mean: float,
        n: int,
        source: str = "pipeline",
        name: str = "held_out",
        metrics: dict[str, Any] | None = None,
        wall_s: float | None = None,
    ) -> None:
        """Upsert an evaluation of the policy at `step` (policy versions vmin..vmax) on the
        evaluation set `name`; `metrics` holds pass@k and the like, `wall_s` the seconds since the
        job started (None: computed from jobs.started_at when that is set)."""
        _check(source, EVAL_SOURCES, "eval source")
        with self._write() as s:
            s.execute(self._eval_upsert(job_id, step, vmin, vmax, reward_mean, n, source, name, metrics, wall_s))

    def _eval_upsert(
        self, job_id: str, step: int, vmin: int, vmax: int, reward_mean: float, n: int, source: str,
        name: str = "held_out", metrics: dict[str, Any] | None = None, wall_s: float | None = None,
    ) -> Any:
        now = _utcnow()
        if wall_s is None:
            with self._read() as r:
                started = r.execute(select(_jobs.c.started_at).where(_jobs.c.id == job_id)).scalar()
            if started is not None:
                wall_s = (now - started).total_seconds()
        ins = self._insert(_evals).values(
            job_id=job_id,
            step=step,
            source=source,
            name=name,
            policy_version_min=vmin,
            policy_version_max=vmax,
            reward_mean=float(reward_mean),
            n=n,
            metrics=_json_safe(metrics) if metrics else None,
            wall_s=wall_s,
            created_at=now,
        )
        return ins.on_conflict_do_update(
            index_elements=["job_id", "step", "source", "name"],
            set_={
                c: ins.excluded[c]
                for c in ("policy_version_min", "policy_version_max", "reward_mean", "n", "metrics", "wall_s",
                          "created_at")
            },
        )

    def evals(self, job_id: str, source: str | None = None) -> list[dict[str, Any]]:
        """A job's evaluations ordered by step (pipeline before checkpoint within a step)."""
        stmt = select(_evals).where(_evals.c.job_id == job_id)
        if source is not None:
            stmt = stmt.where(_evals.c.source == source)
        stmt = stmt.order_by(_evals.c.step, _evals.c.source.desc(), _evals.c.name)
        with self._read() as s:
            return [dict(r) for r in s.execute(stmt).mappings()]

    # -- admin tasks ----------------------------------------------------------------------------

    def create_admin_task(
        self, task_id: str, job_id: str, kind: str, params: dict[str, Any], actor: str
    ) -> bool:
        """Record a submitted admin task as `queued`; False (nothing changed) if the id exists."""
        _check(kind, ADMIN_TASK_KINDS, "admin task kind")
        stmt = (
            self._insert(_admin_tasks)
            .values(id=task_id, job_id=job_id, kind=kind, params=params, state="queued", actor=actor,
                    attempts=0, created_at=_utcnow())
            .on_conflict_do_nothing(index_elements=["id"])
            .returning(_admin_tasks.c.id)
        )
        with self._write() as s:
            return s.execute(stmt).first() is not None

    def admin_task_counts(self) -> dict[tuple[str, str], int]:
        """Admin tasks of every job by (kind, state): the worker's backlog and failures at a glance."""
        stmt = select(_admin_tasks.c.kind, _admin_tasks.c.state, func.count()).group_by(
            _admin_tasks.c.kind, _admin_tasks.c.state
        )
        with self._read() as s:
            return {(kind, state): int(n) for kind, state, n in s.execute(stmt)}

    def get_admin_task(self, task_id: str) -> dict[str, Any] | None:
        with self._read() as s:
            row = s.execute(select(_admin_tasks).where(_admin_tasks.c.id == task_id)).mappings().first()
        return dict(row) if row is not None else None

    def admin_tasks(self, job_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        """A job's admin tasks, oldest first."""
        stmt = select(_admin_tasks).where(_admin_tasks.c.job_id == job_id)
        if kind is not None:
            stmt = stmt.where(_admin_tasks.c.kind == kind)
        with self._read() as s:
            return [dict(r) for r in s.execute(stmt.order_by(_admin_tasks.c.created_at)).mappings()]

    def start_admin_task(self, task_id: str) -> dict[str, Any] | None:
        """Mark a task `running` and count the attempt, unless it already succeeded.

        Returns the row as it was before (None if unknown). A redelivered task whose first run
        succeeded (the worker died before acking) finds `succeeded` and must not run again.
        """
        with self._write() as s:
            row = s.execute(select(_admin_tasks).where(_admin_tasks.c.id == task_id)).mappings().first()
            if row is None or row["state"] == "succeeded":
                return dict(row) if row is not None else None
            s.execute(
                update(_admin_tasks)
                .where(_admin_tasks.c.id == task_id)
                .values(state="running", attempts=_admin_tasks.c.attempts + 1, started_at=_utcnow(),
                        error=None)
            )
            return dict(row)

    def finish_admin_task(
        self,
        task_id: str,
        *,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        eval_row: dict[str, Any] | None = None,
    ) -> None:
        """End a task: `succeeded` with `result`, or `failed` with `error`.

        `eval_row` (keyword arguments of `record_eval`) is written in the same transaction, so an
        evaluation's result and its task's success are one effect: both or neither.
        """
        state = "failed" if error is not None else "succeeded"
        with self._write() as s:
            if eval_row is not None:
                row = {"source": "checkpoint", **eval_row}
                _check(row["source"], EVAL_SOURCES, "eval source")
                s.execute(self._eval_upsert(**row))
            s.execute(
                update(_admin_tasks)
                .where(_admin_tasks.c.id == task_id)
                .values(state=state, result=_json_safe(result), error=error, finished_at=_utcnow())
            )


# -- poison isolation -------------------------------------------------------------------------------

T = TypeVar("T")
R = TypeVar("R")


def row_error(exc: BaseException) -> str | None:
    """Why the database refused the *values* written (an out-of-range integer, a NUL in a text
    column, a constraint), as short text; None when `exc` says nothing about them (connection lost,
    lock or statement timeout, deadlock, disk full, an SQL bug): that must propagate, not be pinned
    on a row. The text is the driver's message only: SQLAlchemy's own rendering repeats the
    statement and its parameters, which may be megabytes of completion."""
    if isinstance(exc, (sa_exc.DataError, sa_exc.IntegrityError)):
        text = str(exc.orig)
    elif isinstance(exc, sa_exc.DBAPIError):
        return None  # OperationalError, InterfaceError, ProgrammingError, InternalError, ...
    elif isinstance(exc, sa_exc.StatementError):  # a value a column type could not bind
        text = str(exc.orig) if exc.orig is not None else str(exc)
    elif isinstance(exc, (OverflowError, ValueError, TypeError)):
        # raised while binding: sqlite3 on an integer beyond int64, _json_safe on a non-JSON value,
        # _check on an unknown kind or status
        text = str(exc)
    else:
        return None
    return clean_text(f"{type(getattr(exc, 'orig', None) or exc).__name__}: {text}".strip())[:1000]


def write_isolating(write: Callable[[Sequence[T]], R], items: Sequence[T]) -> tuple[list[R], dict[int, str]]:
    """Write `items` with `write` (a `Ledger.record_*` method: one transaction per call); when the
    database refuses the batch for its values (`row_error`), bisect it and write the halves, down
    to single items. Returns the results of the writes that committed, and {index in `items`: the
    database's reason} for each item refused on its own.

    One poisoned item costs about 2 log2(len(items)) extra transactions and nothing else: the
    others are written. Errors that are not about values propagate unchanged.
    """
    results: list[R] = []
    rejected: dict[int, str] = {}

    def attempt(lo: int, hi: int) -> None:
        try:
            results.append(write(items[lo:hi]))
        except Exception as exc:
            reason = row_error(exc)
            if reason is None:
                raise
            if hi - lo == 1:
                rejected[lo] = reason
                return
            log.warning("ledger refused a batch of %d (%s); splitting it", hi - lo, reason)
            mid = (lo + hi) // 2
            attempt(lo, mid)
            attempt(mid, hi)

    if items:
        attempt(0, len(items))
    return results, rejected


def _alembic_config(connection: Connection) -> Config:
    """An Alembic Config for the migrations shipped in this package, run on `connection`.

    Built in code so that neither an alembic.ini nor the working directory matters.
    """
    cfg = Config(attributes={"connection": connection})
    # ConfigParser interpolation: a literal % must be doubled.
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m broker.ledger upgrade [--url URL] [--revision REV]`."""
    parser = argparse.ArgumentParser(
        prog="python -m broker.ledger", description="Ledger database maintenance."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upgrade", help="migrate the ledger database to a revision (default head)")
    up.add_argument(
        "--url",
        default=os.environ.get("DATABASE_URL"),
        required="DATABASE_URL" not in os.environ,
        help="SQLAlchemy URL (default: $DATABASE_URL)",
    )
    up.add_argument("--revision", default="head")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    ledger = Ledger(args.url, migrate=False)
    try:
        ledger.upgrade(args.revision)
        log.info("ledger %r at revision %s", ledger, ledger.current_revision())
    finally:
        ledger.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
