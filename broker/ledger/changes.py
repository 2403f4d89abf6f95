"""The audit trail of a job: who changed what, and when (live knobs, pause/resume, stop, cancel)."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import insert, select

from broker.ledger.engine import Repository
from broker.ledger.models import job_changes_t, utcnow
from broker.ledger.rows import JobChangeRow

__all__ = ["ChangeRepository"]


class ChangeRepository(Repository):
    def record_change(self, job_id: str, actor: str, changes: dict[str, Any]) -> None:
        """Append an audit record: `actor` did `changes` (e.g. {"lr": 1e-5} or {"command": "pause"})."""
        stmt = insert(job_changes_t).values(job_id=job_id, actor=actor, changes=changes, created_at=utcnow())
        with self._db.write() as s:
            s.execute(stmt)

    def job_changes(self, job_id: str) -> list[JobChangeRow]:
        """A job's audit records, oldest first."""
        stmt = select(job_changes_t).where(job_changes_t.c.job_id == job_id).order_by(job_changes_t.c.id)
        with self._db.read() as s:
            return [cast(JobChangeRow, dict(r)) for r in s.execute(stmt).mappings()]
