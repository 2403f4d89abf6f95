"""Held-out evaluations: one row per (job, step, source, evaluation set); a re-run replaces it."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import select

from broker.ledger.engine import Database, Repository, json_safe
from broker.ledger.jobs import job_started_at
from broker.ledger.models import evals_t, utcnow
from broker.ledger.rows import EVAL_SOURCES, EvalRow, check_one_of

__all__ = ["EvalRepository", "eval_upsert"]


class EvalRepository(Repository):
    def record_eval(
        self,
        job_id: str,
        step: int,
        vmin: int,
        vmax: int,
        reward_mean: float,
        n: int,
        source: str = "pipeline",
        name: str = "held_out",
        metrics: dict[str, Any] | None = None,
        wall_s: float | None = None,
    ) -> None:
        """Upsert an evaluation of the policy at `step` (policy versions vmin..vmax) on the
        evaluation set `name`; `metrics` holds pass@k and the like, `wall_s` the seconds since the
        job started (None: computed from jobs.started_at when that is set).

        Raises:
            ValueError: `source` is not one of EVAL_SOURCES.
        """
        check_one_of(source, EVAL_SOURCES, "eval source")
        with self._db.write() as s:
            s.execute(eval_upsert(self._db, job_id, step, vmin, vmax, reward_mean, n, source, name, metrics, wall_s))

    def evals(self, job_id: str, source: str | None = None) -> list[EvalRow]:
        """A job's evaluations ordered by step (pipeline before checkpoint within a step)."""
        stmt = select(evals_t).where(evals_t.c.job_id == job_id)
        if source is not None:
            stmt = stmt.where(evals_t.c.source == source)
        stmt = stmt.order_by(evals_t.c.step, evals_t.c.source.desc(), evals_t.c.name)
        with self._db.read() as s:
            return [cast(EvalRow, dict(r)) for r in s.execute(stmt).mappings()]


def eval_upsert(
    db: Database,
    job_id: str,
    step: int,
    vmin: int,
    vmax: int,
    reward_mean: float,
    n: int,
    source: str = "pipeline",
    name: str = "held_out",
    metrics: dict[str, Any] | None = None,
    wall_s: float | None = None,
) -> Any:
    """The upsert statement of `EvalRepository.record_eval` (its arguments, `source` checked by
    the caller), for a caller to execute in its own write transaction. Reads the job's start
    time, in a transaction of its own, when `wall_s` is None."""
    now = utcnow()
    if wall_s is None:
        started = job_started_at(db, job_id)
        if started is not None:
            wall_s = (now - started).total_seconds()
    ins = db.insert(evals_t).values(
        job_id=job_id,
        step=step,
        source=source,
        name=name,
        policy_version_min=vmin,
        policy_version_max=vmax,
        reward_mean=float(reward_mean),
        n=n,
        metrics=json_safe(metrics) if metrics else None,
        wall_s=wall_s,
        created_at=now,
    )
    return ins.on_conflict_do_update(
        index_elements=["job_id", "step", "source", "name"],
        set_={
            c: ins.excluded[c]
            for c in ("policy_version_min", "policy_version_max", "reward_mean", "n", "metrics", "wall_s", "created_at")
        },
    )
