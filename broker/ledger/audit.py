"""Read-only audit queries over one job's samples, train steps and generator loads: the SQL behind
`broker.verify`'s invariants, each a named query.

Everything is grouped or counted in SQL with bound parameters, so a job of millions of samples is
audited without loading its rows; all queries of one `JobAudit` run in one read transaction.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from sqlalchemy import Select, and_, func, not_, or_, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from broker.ledger.engine import Repository
from broker.ledger.models import generator_loads_t, samples_t, train_steps_t
from broker.ledger.rows import (
    SAMPLE_STATUSES,
    USED_STATUSES,
    GenerationVersions,
    Offenders,
    TrainStepRow,
)

__all__ = ["AuditRepository", "JobAudit"]

_c = samples_t.c


class JobAudit:
    """The audit queries of one job, in the read transaction `session`.

    Args:
        examples: how many offending keys each query that finds offenders returns.
    """

    def __init__(self, session: Session, job_id: str, *, examples: int = 5) -> None:
        self._s = session
        self._job_id = job_id
        self._examples = examples
        self._mine = _c.job_id == job_id
        self._used = and_(self._mine, _c.status.in_(USED_STATUSES))
        self._trained = and_(self._mine, _c.status == "trained")

    # -- totals ---------------------------------------------------------------------------------

    def status_counts(self) -> dict[str, int]:
        """Samples per status (statuses with none are absent)."""
        stmt = select(_c.status, func.count()).where(self._mine).group_by(_c.status)
        return {s: int(n) for s, n in self._s.execute(stmt)}

    def train_steps(self) -> list[TrainStepRow]:
        """The job's train steps, in no particular order."""
        stmt = select(train_steps_t).where(train_steps_t.c.job_id == self._job_id)
        return [cast(TrainStepRow, dict(r)) for r in self._s.execute(stmt).mappings()]

    # -- per-sample invariants (examples: msg_ids) ----------------------------------------------

    def unknown_status(self) -> Offenders:
        """Samples whose status is not one of SAMPLE_STATUSES."""
        return self._samples_where(and_(self._mine, not_(_c.status.in_(SAMPLE_STATUSES))))

    def used_without_version(self) -> Offenders:
        """Used samples without a trainer version."""
        return self._samples_where(and_(self._used, _c.trainer_version.is_(None)))

    def wrong_staleness(self) -> Offenders:
        """Used samples with a trainer version whose staleness is not
        trainer_version - gen_version_min."""
        return self._samples_where(
            and_(
                self._used,
                _c.trainer_version.is_not(None),
                or_(_c.staleness.is_(None), _c.staleness != _c.trainer_version - _c.gen_version_min),
            )
        )

    def reversed_gen_versions(self) -> Offenders:
        """Samples with gen_version_min > gen_version_max."""
        return self._samples_where(and_(self._mine, _c.gen_version_min > _c.gen_version_max))

    # -- used at most once, groups whole (examples: the grouping keys, "/"-joined) ----------------

    def duplicate_msg_ids(self) -> Offenders:
        """msg_ids with more than one row."""
        return self._groups(select(_c.msg_id).where(self._mine).group_by(_c.msg_id).having(func.count() > 1))

    def trained_twice(self) -> Offenders:
        """(group_id, sample_index) pairs trained more than once."""
        return self._groups(
            select(_c.group_id, _c.sample_index)
            .where(self._trained)
            .group_by(_c.group_id, _c.sample_index)
            .having(func.count() > 1)
        )

    def split_groups(self) -> Offenders:
        """Training groups whose used samples differ in trainer version or status."""
        return self._groups(
            select(_c.group_id)
            .where(self._used, _c.kind == "train")
            .group_by(_c.group_id)
            .having(or_(func.count(_c.trainer_version.distinct()) > 1, func.count(_c.status.distinct()) > 1))
        )

    def groups_not_of_size(self, group_size: int) -> Offenders:
        """Trained training groups without exactly `group_size` trained samples."""
        return self._groups(
            select(_c.group_id)
            .where(self._trained, _c.kind == "train")
            .group_by(_c.group_id)
            .having(func.count() != group_size)
        )

    # -- steps and loads ----------------------------------------------------------------------

    def trained_per_version(self) -> dict[int, int]:
        """Trained samples per trainer version (samples without one are left out)."""
        stmt = (
            select(_c.trainer_version, func.count())
            .where(self._trained, _c.trainer_version.is_not(None))
            .group_by(_c.trainer_version)
        )
        return {int(v): int(k) for v, k in self._s.execute(stmt)}

    def loaded_versions(self) -> dict[str, set[int]]:
        """Per generator, the policy versions it recorded loading."""
        t = generator_loads_t
        loads: dict[str, set[int]] = {}
        for g, v in self._s.execute(select(t.c.generator_id, t.c.version).where(t.c.job_id == self._job_id)):
            loads.setdefault(g, set()).add(int(v))
        return loads

    def trained_generation_versions(self) -> list[GenerationVersions]:
        """Trained samples counted per (generator, gen_version_min, gen_version_max)."""
        stmt = (
            select(_c.generator_id, _c.gen_version_min, _c.gen_version_max, func.count())
            .where(self._trained)
            .group_by(_c.generator_id, _c.gen_version_min, _c.gen_version_max)
        )
        return [GenerationVersions(g, int(vmin), int(vmax), int(k)) for g, vmin, vmax, k in self._s.execute(stmt)]

    # -- helpers ----------------------------------------------------------------------------------

    def _samples_where(self, where: ColumnElement[bool]) -> Offenders:
        """How many samples match `where`, and the first few msg_ids among them (by row id)."""
        n = self._s.execute(select(func.count()).select_from(samples_t).where(where)).scalar_one()
        if not n:
            return Offenders(0, ())
        ex = self._s.execute(select(_c.msg_id).where(where).order_by(_c.id).limit(self._examples)).scalars()
        return Offenders(int(n), tuple(str(e) for e in ex))

    def _groups(self, stmt: Select[Any]) -> Offenders:
        """Run a GROUP BY ... HAVING statement whose columns name the offender."""
        rows = self._s.execute(stmt).all()
        return Offenders(len(rows), tuple("/".join(str(x) for x in r) for r in rows[: self._examples]))


class AuditRepository(Repository):
    @contextmanager
    def audit(self, job_id: str, *, examples: int = 5) -> Iterator[JobAudit]:
        """The audit queries of `job_id`, all in one read transaction (closed on exit)."""
        with self._db.read() as s:
            yield JobAudit(s, job_id, examples=examples)
