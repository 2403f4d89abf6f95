"""Train steps (each step's metrics and the policy version it produced), what each stepped on (for
`asyncrl replay`) and the checkpoints committed at them."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import select, update

from broker.ledger.engine import Repository
from broker.ledger.models import checkpoints_t, jobs_t, step_inputs_t, train_steps_t, utcnow
from broker.ledger.rows import CheckpointRow, StepInputIn, StepInputRow, TrainStepRow

__all__ = ["StepRepository"]


class StepRepository(Repository):
    def record_train_step(
        self, job_id: str, step: int, policy_version: int, metrics: dict[str, Any], *, job_step: bool = False
    ) -> None:
        """Upsert a train step's metrics (a replayed step overwrites, keeping created_at); with
        `job_step`, also record `step` as the job's last completed step (`set_job_step`) in the
        same transaction.

        Non-finite metric values are stored as null.

        Raises:
            LookupError: `job_step` and no such job (nothing is written).
        """
        ins = self._db.insert(train_steps_t).values(
            job_id=job_id,
            step=step,
            policy_version=policy_version,
            metrics=metrics,
            created_at=utcnow(),
        )
        stmt = ins.on_conflict_do_update(
            index_elements=["job_id", "step"],
            set_={"policy_version": ins.excluded.policy_version, "metrics": ins.excluded.metrics},
        )
        with self._db.write() as s:
            s.execute(stmt)
            if job_step:
                done = s.connection().execute(
                    update(jobs_t).where(jobs_t.c.id == job_id).values(step=step, updated_at=utcnow())
                )
                if done.rowcount == 0:
                    raise LookupError(f"no job {job_id!r} in the ledger")

    def last_train_step(self, job_id: str) -> TrainStepRow | None:
        """The job's newest train step, or None before the first."""
        stmt = (
            select(train_steps_t).where(train_steps_t.c.job_id == job_id).order_by(train_steps_t.c.step.desc()).limit(1)
        )
        with self._db.read() as s:
            row = s.execute(stmt).mappings().first()
        return cast(TrainStepRow, dict(row)) if row is not None else None

    def train_steps(self, job_id: str) -> list[TrainStepRow]:
        """A job's train steps ordered by step."""
        stmt = select(train_steps_t).where(train_steps_t.c.job_id == job_id).order_by(train_steps_t.c.step)
        with self._db.read() as s:
            return [cast(TrainStepRow, dict(r)) for r in s.execute(stmt).mappings()]

    def record_step_input(self, row: StepInputIn) -> None:
        """Upsert what a step stepped on (a step re-done after a resume overwrites its record, as
        its metrics: the weights that follow are the re-done step's)."""
        ins = self._db.insert(step_inputs_t).values({**row, "created_at": utcnow()})
        keep = ("job_id", "step", "created_at")
        stmt = ins.on_conflict_do_update(
            index_elements=["job_id", "step"],
            set_={c.name: ins.excluded[c.name] for c in step_inputs_t.columns if c.name not in keep},
        )
        with self._db.write() as s:
            s.execute(stmt)

    def step_input(self, job_id: str, step: int) -> StepInputRow | None:
        """What step `step` of the job stepped on; None when it was not recorded."""
        t = step_inputs_t
        with self._db.read() as s:
            row = s.execute(select(t).where(t.c.job_id == job_id, t.c.step == step)).mappings().first()
        return cast(StepInputRow, dict(row)) if row is not None else None

    def step_input_steps(self, job_id: str) -> list[int]:
        """The steps of the job whose inputs were recorded, ascending (their blobs not read)."""
        t = step_inputs_t
        with self._db.read() as s:
            return list(s.execute(select(t.c.step).where(t.c.job_id == job_id).order_by(t.c.step)).scalars())

    def record_checkpoint(self, job_id: str, step: int, policy_version: int, path: str) -> None:
        """Record a committed checkpoint (idempotent per job and step)."""
        stmt = (
            self._db.insert(checkpoints_t)
            .values(job_id=job_id, step=step, policy_version=policy_version, path=path, created_at=utcnow())
            .on_conflict_do_nothing(index_elements=["job_id", "step"])
        )
        with self._db.write() as s:
            s.execute(stmt)

    def checkpoints(self, job_id: str) -> list[CheckpointRow]:
        """A job's checkpoints, oldest first."""
        stmt = select(checkpoints_t).where(checkpoints_t.c.job_id == job_id).order_by(checkpoints_t.c.step)
        with self._db.read() as s:
            return [cast(CheckpointRow, dict(r)) for r in s.execute(stmt).mappings()]
