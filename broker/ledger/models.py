"""The ledger's tables as SQLAlchemy ORM models (the Alembic migrations in `broker/migrations`
own the schema; a test checks that these models match them).

Enumerated columns (state, status, kind) are plain strings validated in Python (`rows.py`) rather
than CHECK constraints: adding a value must not need a table rebuild on SQLite's samples table.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.schema import MetaData

__all__ = [
    "AdminTask",
    "Base",
    "Checkpoint",
    "Eval",
    "GeneratorLoad",
    "Job",
    "JobChange",
    "PolicyVersion",
    "Sample",
    "StepInput",
    "TrainStep",
    "UTCDateTime",
    "utcnow",
]


def utcnow() -> datetime:
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


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (Index(None, "state", "priority", "created_at"),)  # the queue's head (0008)

    id: Mapped[str] = mapped_column(String, primary_key=True)
    name: Mapped[str] = mapped_column(String)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String, default="queued")
    # Last completed trainer step; 0 until the first one completes.
    step: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # When a trainer first started the job: wall-clock curves (evaluations) count from here.
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The queue's order (JobRepository.queue): higher first, then first in, first out.
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class PolicyVersion(Base):
    __tablename__ = "policy_versions"

    job_id: Mapped[str] = mapped_column(String, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    checksum: Mapped[str] = mapped_column(String)
    num_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class GeneratorLoad(Base):
    __tablename__ = "generator_loads"

    job_id: Mapped[str] = mapped_column(String, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    generator_id: Mapped[str] = mapped_column(String, primary_key=True)
    fingerprint: Mapped[str | None] = mapped_column(String)
    loaded_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Sample(Base):
    """One completion, from generation to its use (or drop) by the trainer."""

    __tablename__ = "samples"
    __table_args__ = (
        UniqueConstraint("msg_id"),
        # Also serves lookups by job_id alone (leftmost prefix), so no separate job_id index.
        Index(None, "job_id", "status"),
        # A job's samples in insertion order (its pages), without walking other jobs' rows (0007).
        Index(None, "job_id", "id"),
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
    # A multi-turn episode (shared/environments): model turns, completion tokens the environment
    # appended (the rest are the model's), and why the episode ended. Null: a single-turn sample.
    turns: Mapped[int | None] = mapped_column(Integer)
    num_env_tokens: Mapped[int | None] = mapped_column(Integer)
    stop_reason: Mapped[str | None] = mapped_column(String)
    # Per-job accounting (0010): the engine's LoRA adapter that produced the sample (null: full
    # weights) and the sample's share of its generate call's wall time (null: before 0010).
    adapter: Mapped[str | None] = mapped_column(String(200))
    gen_seconds: Mapped[float | None] = mapped_column(Float)
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
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    scored_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class TrainStep(Base):
    __tablename__ = "train_steps"

    job_id: Mapped[str] = mapped_column(String, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    # The policy version this step produced.
    policy_version: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class StepInput(Base):
    """What one train step stepped on, so `asyncrl replay` can take it again (trainer_svc/replay.py):
    kept apart from `train_steps` because its blob is the size of the batch, and the curves and the
    resume plan read every train step."""

    __tablename__ = "step_inputs"

    job_id: Mapped[str] = mapped_column(String, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    policy_version: Mapped[int] = mapped_column(Integer)  # the version the step produced
    lr: Mapped[float] = mapped_column(Float)  # the step size it took (schedule, live lr, staleness)
    # The weights' checksum after the step: the published version's manifest checksum.
    checksum: Mapped[str] = mapped_column(String)
    # A collapse-guard roll-back before this step's last try: the checkpoint step whose weights and
    # optimizer state it started from (0: the initial model); null: it followed the previous step.
    restored_from: Mapped[int | None] = mapped_column(Integer)
    # The software and hardware bit-exactness depends on (torch build, threads, device, flags).
    identity: Mapped[dict[str, Any]] = mapped_column(JSON)
    # How `data` is encoded: format, codec, the uncompressed size and digest, tensor-less fields.
    meta: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The batch's tensors and the RNG state the step began with (safetensors, compressed).
    data: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


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
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Checkpoint(Base):
    """A committed trainer checkpoint (an HF-format directory) of one job at one step."""

    __tablename__ = "checkpoints"

    job_id: Mapped[str] = mapped_column(String, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    policy_version: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


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
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class JobChange(Base):
    """Who changed what on a job, and when (live knobs, pause/resume, stop, cancel)."""

    __tablename__ = "job_changes"

    id: Mapped[int] = mapped_column(_RowId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String, index=True)
    actor: Mapped[str] = mapped_column(String)
    changes: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


# The Core tables behind the models: the repositories query these (rows come out as dicts, no
# ORM object escapes the package).
jobs_t = cast(Table, Job.__table__)
job_changes_t = cast(Table, JobChange.__table__)
checkpoints_t = cast(Table, Checkpoint.__table__)
policy_versions_t = cast(Table, PolicyVersion.__table__)
generator_loads_t = cast(Table, GeneratorLoad.__table__)
samples_t = cast(Table, Sample.__table__)
train_steps_t = cast(Table, TrainStep.__table__)
step_inputs_t = cast(Table, StepInput.__table__)
evals_t = cast(Table, Eval.__table__)
admin_tasks_t = cast(Table, AdminTask.__table__)
