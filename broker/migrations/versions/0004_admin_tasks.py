"""Admin tasks (Celery: checkpoint evaluation and export) and the source of each evaluation.

An evaluation is now keyed by (job, step, source): the trainer's in-pipeline held-out round
(`pipeline`) and an offline evaluation of the step's checkpoint (`checkpoint`) are different
measurements of the same step and must not overwrite each other.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Batch mode: SQLite rebuilds the table to change its primary key; existing rows become
    # `pipeline` evaluations, which is what every evaluation before this revision was.
    with op.batch_alter_table("evals", recreate="always") as batch:
        batch.add_column(sa.Column("source", sa.String(), nullable=False, server_default="pipeline"))
        batch.drop_constraint("pk_evals", type_="primary")
        batch.create_primary_key("pk_evals", ["job_id", "step", "source"])
    op.create_table(
        "admin_tasks",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("actor", sa.String(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_admin_tasks_job_id", "admin_tasks", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_admin_tasks_job_id", table_name="admin_tasks")
    op.drop_table("admin_tasks")
    evals = sa.table("evals", sa.column("source", sa.String()))
    op.execute(evals.delete().where(evals.c.source != "pipeline"))
    with op.batch_alter_table("evals", recreate="always") as batch:
        batch.drop_constraint("pk_evals", type_="primary")
        batch.create_primary_key("pk_evals", ["job_id", "step"])
        batch.drop_column("source")
