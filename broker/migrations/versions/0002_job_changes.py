"""Audit log of job changes (live knobs, pause/resume, stop, cancel).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)
_ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "job_changes",
        sa.Column("id", _ROW_ID, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("actor", sa.String(), nullable=False),
        sa.Column("changes", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
    )
    op.create_index("ix_job_changes_job_id", "job_changes", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_job_changes_job_id", table_name="job_changes")
    op.drop_table("job_changes")
