"""Admin tasks: long jobs of the Celery worker (offline evaluations, exports), from submission
to their end, counted per delivery."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import func, select, update

from broker.ledger.engine import Repository, json_safe
from broker.ledger.evals import eval_upsert
from broker.ledger.models import admin_tasks_t, utcnow
from broker.ledger.rows import ADMIN_TASK_KINDS, EVAL_SOURCES, AdminTaskRow, EvalArgs, check_one_of

__all__ = ["AdminTaskRepository"]


class AdminTaskRepository(Repository):
    def create_admin_task(self, task_id: str, job_id: str, kind: str, params: dict[str, Any], actor: str) -> bool:
        """Record a submitted admin task as `queued`; False (nothing changed) if the id exists.

        Raises:
            ValueError: `kind` is not one of ADMIN_TASK_KINDS.
        """
        check_one_of(kind, ADMIN_TASK_KINDS, "admin task kind")
        stmt = (
            self._db.insert(admin_tasks_t)
            .values(
                id=task_id,
                job_id=job_id,
                kind=kind,
                params=params,
                state="queued",
                actor=actor,
                attempts=0,
                created_at=utcnow(),
            )
            .on_conflict_do_nothing(index_elements=["id"])
            .returning(admin_tasks_t.c.id)
        )
        with self._db.write() as s:
            return s.execute(stmt).first() is not None

    def admin_task_counts(self) -> dict[tuple[str, str], int]:
        """Admin tasks of every job by (kind, state): the worker's backlog and failures at a glance."""
        stmt = select(admin_tasks_t.c.kind, admin_tasks_t.c.state, func.count()).group_by(
            admin_tasks_t.c.kind, admin_tasks_t.c.state
        )
        with self._db.read() as s:
            return {(kind, state): int(n) for kind, state, n in s.execute(stmt)}

    def get_admin_task(self, task_id: str) -> AdminTaskRow | None:
        with self._db.read() as s:
            row = s.execute(select(admin_tasks_t).where(admin_tasks_t.c.id == task_id)).mappings().first()
        return cast(AdminTaskRow, dict(row)) if row is not None else None

    def admin_tasks(self, job_id: str, kind: str | None = None) -> list[AdminTaskRow]:
        """A job's admin tasks, oldest first."""
        stmt = select(admin_tasks_t).where(admin_tasks_t.c.job_id == job_id)
        if kind is not None:
            stmt = stmt.where(admin_tasks_t.c.kind == kind)
        stmt = stmt.order_by(admin_tasks_t.c.created_at)
        with self._db.read() as s:
            return [cast(AdminTaskRow, dict(r)) for r in s.execute(stmt).mappings()]

    def start_admin_task(self, task_id: str) -> AdminTaskRow | None:
        """Mark a task `running` and count the attempt, unless it already succeeded.

        Returns the row as it was before (None if unknown). A redelivered task whose first run
        succeeded (the worker died before acking) finds `succeeded` and must not run again.
        """
        with self._db.write() as s:
            row = s.execute(select(admin_tasks_t).where(admin_tasks_t.c.id == task_id)).mappings().first()
            if row is None:
                return None
            if row["state"] != "succeeded":
                s.execute(
                    update(admin_tasks_t)
                    .where(admin_tasks_t.c.id == task_id)
                    .values(state="running", attempts=admin_tasks_t.c.attempts + 1, started_at=utcnow(), error=None)
                )
            return cast(AdminTaskRow, dict(row))

    def finish_admin_task(
        self,
        task_id: str,
        *,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        eval_row: EvalArgs | None = None,
    ) -> None:
        """End a task: `succeeded` with `result`, or `failed` with `error`.

        `eval_row` (keyword arguments of `record_eval`) is written in the same transaction, so an
        evaluation's result and its task's success are one effect: both or neither.

        Raises:
            ValueError: `eval_row`'s source is not one of EVAL_SOURCES.
        """
        state = "failed" if error is not None else "succeeded"
        with self._db.write() as s:
            if eval_row is not None:
                row: EvalArgs = {"source": "checkpoint", **eval_row}
                check_one_of(row["source"], EVAL_SOURCES, "eval source")
                s.execute(eval_upsert(self._db, **row))
            s.execute(
                update(admin_tasks_t)
                .where(admin_tasks_t.c.id == task_id)
                .values(state=state, result=json_safe(result), error=error, finished_at=utcnow())
            )
