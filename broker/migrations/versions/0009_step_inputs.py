"""What each train step stepped on, for `asyncrl replay`: the batch (compressed), its lr, RNG
state, the weights' checksum after it and the software it ran on.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "step_inputs",
        sa.Column("job_id", sa.String(), primary_key=True),
        sa.Column("step", sa.Integer(), primary_key=True),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("lr", sa.Float(), nullable=False),
        sa.Column("checksum", sa.String(), nullable=False),
        sa.Column("restored_from", sa.Integer(), nullable=True),
        sa.Column("identity", sa.JSON(), nullable=False),
        sa.Column("meta", sa.JSON(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("step_inputs")
