"""Samples in a job's insertion order: an index on (job_id, id).

A page of GET /jobs/{id}/samples is `WHERE job_id = ? ORDER BY id LIMIT n`. Without this index
PostgreSQL walks the primary key from the first row of the table, filtering by job: a new job's
first page reads every row of the jobs before it (0.2 s behind 100 k rows, seconds behind millions;
bench/capacity.py measures it, docs/scaling.md). With it the page reads n index entries.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_samples_job_id_id", "samples", ["job_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_samples_job_id_id", table_name="samples")
