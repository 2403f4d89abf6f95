"""Jobs: their spec, state and last completed step."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, cast

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from broker.ledger.engine import Database, Repository
from broker.ledger.models import job_changes_t, jobs_t, utcnow
from broker.ledger.rows import JOB_STATES, JobRow, check_one_of

__all__ = ["JobEdit", "JobRepository", "job_started_at"]


class JobEdit:
    """A job's row held for a change (`JobRepository.edit_job`): `job` is the row as it is now,
    and no other writer can change it until the edit ends; `set` and `record_change` write in the
    edit's transaction, committed when the `with` block ends (rolled back if it raises)."""

    def __init__(self, session: Session, job: JobRow) -> None:
        self._session = session
        self.job = job

    def set(self, *, state: str | None = None, spec: dict[str, Any] | None = None, error: str | None = None) -> None:
        """Set the job's state (and its error: None clears it) and/or its spec.

        Raises:
            ValueError: unknown state.
        """
        values: dict[str, Any] = {"updated_at": utcnow()}
        if state is not None:
            check_one_of(state, JOB_STATES, "job state")
            values.update(state=state, error=error)
        if spec is not None:
            values["spec"] = spec
        self._session.execute(update(jobs_t).where(jobs_t.c.id == self.job["id"]).values(**values))
        self.job = cast(JobRow, {**self.job, **values})

    def record_change(self, actor: str, changes: dict[str, Any]) -> None:
        """Append the audit record of this change (as `ChangeRepository.record_change`)."""
        self._session.execute(
            insert(job_changes_t).values(job_id=self.job["id"], actor=actor, changes=changes, created_at=utcnow())
        )


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

    @contextmanager
    def edit_job(self, job_id: str) -> Iterator[JobEdit | None]:
        """Hold the job's row for a read-decide-write change (None: no such job): one write
        transaction with the row locked, `SELECT ... FOR UPDATE` on PostgreSQL, the database's
        write lock on SQLite (BEGIN IMMEDIATE). Concurrent edits of a job, and the services' own
        state moves (`move_job`), therefore happen one after the other, each seeing the last one's
        result; what the block does besides (publishing the change on the job's control stream)
        happens in that same order. Keep the block short: it holds the lock."""
        with self._db.write() as s:
            row = s.execute(select(jobs_t).where(jobs_t.c.id == job_id).with_for_update()).mappings().first()
            yield JobEdit(s, cast(JobRow, dict(row))) if row is not None else None

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
