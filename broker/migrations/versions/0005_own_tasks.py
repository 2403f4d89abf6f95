"""Own tasks: reward status and details per sample, named evaluation sets, the job's start time.

- samples.reward_status ("ok", "timeout", "error") and samples.reward_details (a weighted sum's
  terms, the reason a reward failed), samples.eval_set (the named evaluation set of an eval sample).
- evals.name joins the key: one row per (job, step, source, evaluation set); evals.metrics holds
  pass@k / mean@n / maj@k; evals.wall_s is seconds since the job started. Existing rows become the
  default set `held_out`, which is what every evaluation before this revision was.
- jobs.started_at: when the trainer first started the job (wall-clock curves start there).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("reward_status", sa.String(), nullable=True))
        batch.add_column(sa.Column("reward_details", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("eval_set", sa.String(), nullable=True))
    with op.batch_alter_table("evals", recreate="always") as batch:
        batch.add_column(sa.Column("name", sa.String(), nullable=False, server_default="held_out"))
        batch.add_column(sa.Column("metrics", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("wall_s", sa.Float(), nullable=True))
        batch.drop_constraint("pk_evals", type_="primary")
        batch.create_primary_key("pk_evals", ["job_id", "step", "source", "name"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("started_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("started_at")
    evals = sa.table("evals", sa.column("name", sa.String()))
    op.execute(evals.delete().where(evals.c.name != "held_out"))
    with op.batch_alter_table("evals", recreate="always") as batch:
        batch.drop_constraint("pk_evals", type_="primary")
        batch.drop_column("wall_s")
        batch.drop_column("metrics")
        batch.drop_column("name")
        batch.create_primary_key("pk_evals", ["job_id", "step", "source"])
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("eval_set")
        batch.drop_column("reward_details")
        batch.drop_column("reward_status")
