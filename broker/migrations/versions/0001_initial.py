"""Initial ledger schema: jobs, policy_versions, generator_loads, samples, train_steps, evals.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Timestamps are aware UTC (broker.ledger.UTCDateTime wraps this type).
_TS = sa.DateTime(timezone=True)
# BIGINT on PostgreSQL; SQLite only autoincrements a column declared exactly INTEGER.
_ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
    )
    op.create_table(
        "policy_versions",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("checksum", sa.String(), nullable=False),
        sa.Column("num_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("job_id", "version", name="pk_policy_versions"),
    )
    op.create_table(
        "generator_loads",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("generator_id", sa.String(), nullable=False),
        sa.Column("fingerprint", sa.String(), nullable=True),
        sa.Column("loaded_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("job_id", "version", "generator_id", name="pk_generator_loads"),
    )
    op.create_table(
        "samples",
        sa.Column("id", _ROW_ID, autoincrement=True, nullable=False),
        sa.Column("msg_id", sa.String(), nullable=False),
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("group_id", sa.String(), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("prompt_index", sa.Integer(), nullable=False),
        sa.Column("generator_id", sa.String(), nullable=False),
        sa.Column("gen_version_min", sa.Integer(), nullable=False),
        sa.Column("gen_version_max", sa.Integer(), nullable=False),
        sa.Column("num_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("num_completion_tokens", sa.Integer(), nullable=False),
        sa.Column("completion", sa.Text(), nullable=False),
        sa.Column("finish_reason", sa.String(), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("drop_reason", sa.String(), nullable=True),
        sa.Column("trainer_version", sa.Integer(), nullable=True),
        sa.Column("staleness", sa.Integer(), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("scored_at", _TS, nullable=True),
        sa.Column("used_at", _TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_samples"),
        sa.UniqueConstraint("msg_id", name="uq_samples_msg_id"),
    )
    op.create_index("ix_samples_job_id_status", "samples", ["job_id", "status"])
    op.create_table(
        "train_steps",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("job_id", "step", name="pk_train_steps"),
    )
    op.create_table(
        "evals",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("policy_version_min", sa.Integer(), nullable=False),
        sa.Column("policy_version_max", sa.Integer(), nullable=False),
        sa.Column("reward_mean", sa.Float(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("job_id", "step", name="pk_evals"),
    )


def downgrade() -> None:
    op.drop_table("evals")
    op.drop_table("train_steps")
    op.drop_index("ix_samples_job_id_status", table_name="samples")
    op.drop_table("samples")
    op.drop_table("generator_loads")
    op.drop_table("policy_versions")
    op.drop_table("jobs")
