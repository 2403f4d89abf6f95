"""The job queue: jobs.priority, and `submitted` renamed `queued`.

A job now waits in the fleet's queue (state `queued`) until a trainer takes it; the queue's order
is priority (higher first), then submission time. Jobs stored as `submitted` are queued jobs.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
    op.execute("UPDATE jobs SET state = 'queued' WHERE state = 'submitted'")
    op.create_index("ix_jobs_state_priority_created_at", "jobs", ["state", "priority", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_state_priority_created_at", table_name="jobs")
    op.execute("UPDATE jobs SET state = 'submitted' WHERE state = 'queued'")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("priority")
