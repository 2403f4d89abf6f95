"""Multi-turn episodes: turns, environment tokens and the stop reason per sample.

- samples.turns: the episode's model turns; samples.num_env_tokens: its completion tokens the
  environment appended (num_completion_tokens - num_env_tokens are the model's);
  samples.stop_reason: why the episode ended (done, max_turns, max_tokens, env_error: ...). All
  null for a single-turn sample, which is every sample before this revision.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("turns", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("num_env_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("stop_reason", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("stop_reason")
        batch.drop_column("num_env_tokens")
        batch.drop_column("turns")
