"""Per-job accounting: which adapter produced each sample, and its share of the generate call's time.

- samples.adapter: the LoRA adapter of the engine that produced the sample (e.g. "job-<id>/v3#7");
  null for a full-weight engine, and for every sample before this revision.
- samples.gen_seconds: the sample's share of its generate call's wall time; GET /jobs/{id}
  `usage` sums it into the job's generator-seconds. Null before this revision.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-08
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable columns without a default: an ALTER TABLE ADD COLUMN on both backends, no rewrite
    # of the samples table.
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("adapter", sa.String(200), nullable=True))
        batch.add_column(sa.Column("gen_seconds", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("gen_seconds")
        batch.drop_column("adapter")
