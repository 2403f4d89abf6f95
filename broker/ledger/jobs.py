"""Jobs: their spec, state and last completed step."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, cast

from sqlalchemy import select, update

from broker.ledger.engine import Database, Repository
from broker.ledger.models import jobs_t, utcnow
from broker.ledger.rows import JOB_STATES, JobRow, check_one_of

__all__ = ["JobRepository", "job_started_at"]


class JobRepository(Repository):
    def create_job(
        self, job_id: str, name: str, spec: dict[str, Any], state: str = "queued", priority: int | None = None
    ) -> bool:
        """Insert a job (its `priority`: the spec's, unless given); returns False (and changes
        nothing) if `job_id` already exists."""
        check_one_of(state, JOB_STATES, "job state")
        now = utcnow()
        stmt = (
            self._db.insert(jobs_t)
            .values(
                id=job_id,
                name=name,
                spec=spec,
                state=state,
                priority=int(spec.get("priority", 0)) if priority is None else priority,
                step=0,
                created_at=now,
                updated_at=now,
            )
            .on_conflict_do_nothing(index_elements=["id"])
            # RETURNING tells inserted from skipped; an INSERT's rowcount is -1 on psycopg
            # unless SQLAlchemy is asked to preserve it.
            .returning(jobs_t.c.id)
        )
        with self._db.write() as s:
            return s.execute(stmt).first() is not None

    def get_job(self, job_id: str) -> JobRow | None:
        with self._db.read() as s:
            row = s.execute(select(jobs_t).where(jobs_t.c.id == job_id)).mappings().first()
        return cast(JobRow, dict(row)) if row is not None else None

    def list_jobs(self, limit: int = 100, states: Iterable[str] | None = None) -> list[JobRow]:
        """Newest first; only jobs in `states` when given."""
        stmt = select(jobs_t).order_by(jobs_t.c.created_at.desc(), jobs_t.c.id.desc()).limit(limit)
        if states is not None:
            states = tuple(states)
            for state in states:
                check_one_of(state, JOB_STATES, "job state")
            stmt = stmt.where(jobs_t.c.state.in_(states))
        with self._db.read() as s:
            return [cast(JobRow, dict(r)) for r in s.execute(stmt).mappings()]

    def queue(self) -> list[JobRow]:
        """The queued jobs in the order a trainer takes them: higher priority first, then first
        in, first out."""
        stmt = (
            select(jobs_t)
            .where(jobs_t.c.state == "queued")
            .order_by(jobs_t.c.priority.desc(), jobs_t.c.created_at, jobs_t.c.id)
        )
        with self._db.read() as s:
            return [cast(JobRow, dict(r)) for r in s.execute(stmt).mappings()]

    def claim_next(self) -> JobRow | None:
        """Move the head of the queue to `running` and return it (None: the queue is empty).

        The move is conditional (`WHERE state = 'queued'`): of two trainers claiming at once, or a
        claim racing a cancel, exactly one wins; a loser tries the next head."""
        while True:
            with self._db.read() as s:
                head = s.execute(
                    select(jobs_t.c.id)
                    .where(jobs_t.c.state == "queued")
                    .order_by(jobs_t.c.priority.desc(), jobs_t.c.created_at, jobs_t.c.id)
                    .limit(1)
                ).scalar()
            if head is None:
                return None
            if self.move_job(head, ("queued",), "running"):
                return self.get_job(head)

    def move_job(self, job_id: str, from_states: Iterable[str], state: str, error: str | None = None) -> bool:
        """Set the job's state to `state` (and its error) only if it is in one of `from_states`;
        returns whether it was."""
        from_states = tuple(from_states)
        for st in (*from_states, state):
            check_one_of(st, JOB_STATES, "job state")
        stmt = (
            update(jobs_t)
            .where(jobs_t.c.id == job_id, jobs_t.c.state.in_(from_states))
            .values(state=state, error=error, updated_at=utcnow())
        )
        with self._db.write() as s:
            return bool(s.connection().execute(stmt).rowcount)

    def latest_job(self, states: Iterable[str] = ("queued", "running")) -> JobRow | None:
        """The newest job in one of `states`, or None."""
        states = tuple(states)
        for state in states:
            check_one_of(state, JOB_STATES, "job state")
        stmt = (
            select(jobs_t)
            .where(jobs_t.c.state.in_(states))
            .order_by(jobs_t.c.created_at.desc(), jobs_t.c.id.desc())
            .limit(1)
        )
        with self._db.read() as s:
            row = s.execute(stmt).mappings().first()
        return cast(JobRow, dict(row)) if row is not None else None

    def set_job_state(self, job_id: str, state: str, error: str | None = None) -> None:
        """Set a job's state (and error text; None clears it).

        Raises:
            ValueError: unknown state.
            LookupError: no such job.
        """
        check_one_of(state, JOB_STATES, "job state")
        _update_job(self._db, job_id, state=state, error=error)

    def mark_job_started(self, job_id: str) -> None:
        """Set the job's start time to now unless a trainer already started it (a restart keeps
        the first start: wall-clock curves count from there)."""
        stmt = update(jobs_t).where(jobs_t.c.id == job_id, jobs_t.c.started_at.is_(None)).values(started_at=utcnow())
        with self._db.write() as s:
            s.execute(stmt)

    def set_job_step(self, job_id: str, step: int) -> None:
        """Record `step` as the job's last completed trainer step.

        Raises:
            LookupError: no such job.
        """
        _update_job(self._db, job_id, step=step)

    def update_spec(self, job_id: str, spec: dict[str, Any]) -> None:
        """Replace a job's stored spec (live knob changes, so a restarted service picks them up).

        Raises:
            LookupError: no such job.
        """
        _update_job(self._db, job_id, spec=spec)


def _update_job(db: Database, job_id: str, **values: Any) -> None:
    stmt = update(jobs_t).where(jobs_t.c.id == job_id).values(**values, updated_at=utcnow())
    with db.write() as s:
        if s.connection().execute(stmt).rowcount == 0:
            raise LookupError(f"no job {job_id!r} in the ledger")


def job_started_at(db: Database, job_id: str) -> datetime | None:
    """When a trainer first started the job (None before, or for an unknown job)."""
    with db.read() as s:
        started: datetime | None = s.execute(select(jobs_t.c.started_at).where(jobs_t.c.id == job_id)).scalar()
    return started
