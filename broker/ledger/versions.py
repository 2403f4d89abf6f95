"""Policy versions: those the trainer published, and which generator loaded which one when."""

from __future__ import annotations

from datetime import datetime
from typing import cast

from sqlalchemy import select

from broker.ledger.engine import Repository
from broker.ledger.models import generator_loads_t, policy_versions_t, utcnow
from broker.ledger.rows import GeneratorLoadRow, PolicyVersionRow

__all__ = ["VersionRepository"]


class VersionRepository(Repository):
    def record_policy_version(self, job_id: str, version: int, checksum: str, num_bytes: int) -> bool:
        """Record a published policy version; returns False if it was already recorded."""
        stmt = (
            self._db.insert(policy_versions_t)
            .values(
                job_id=job_id,
                version=version,
                checksum=checksum,
                num_bytes=num_bytes,
                created_at=utcnow(),
            )
            .on_conflict_do_nothing(index_elements=["job_id", "version"])
            .returning(policy_versions_t.c.version)
        )
        with self._db.write() as s:
            return s.execute(stmt).first() is not None

    def policy_versions(self, job_id: str) -> list[PolicyVersionRow]:
        """A job's policy versions, ascending."""
        stmt = (
            select(policy_versions_t).where(policy_versions_t.c.job_id == job_id).order_by(policy_versions_t.c.version)
        )
        with self._db.read() as s:
            return [cast(PolicyVersionRow, dict(r)) for r in s.execute(stmt).mappings()]

    def record_generator_load(
        self, job_id: str, version: int, generator_id: str, fingerprint: str | None = None
    ) -> bool:
        """Record that a generator loaded a version; returns False if already recorded."""
        stmt = (
            self._db.insert(generator_loads_t)
            .values(
                job_id=job_id,
                version=version,
                generator_id=generator_id,
                fingerprint=fingerprint,
                loaded_at=utcnow(),
            )
            .on_conflict_do_nothing(index_elements=["job_id", "version", "generator_id"])
            .returning(generator_loads_t.c.version)
        )
        with self._db.write() as s:
            return s.execute(stmt).first() is not None

    def generator_loads(self, job_id: str) -> list[GeneratorLoadRow]:
        """A job's generator loads ordered by version, then load time."""
        t = generator_loads_t
        stmt = select(t).where(t.c.job_id == job_id).order_by(t.c.version, t.c.loaded_at, t.c.generator_id)
        with self._db.read() as s:
            return [cast(GeneratorLoadRow, dict(r)) for r in s.execute(stmt).mappings()]

    def swap_latencies(self, job_id: str) -> dict[int, float]:
        """Per version: seconds from its publication until the LAST generator that loaded it had
        it loaded (the time until every generator serves it). Versions nobody loaded are absent."""
        published = {r["version"]: r["created_at"] for r in self.policy_versions(job_id)}
        last: dict[int, datetime] = {}
        for r in self.generator_loads(job_id):
            if r["version"] in published:
                last[r["version"]] = max(last.get(r["version"], r["loaded_at"]), r["loaded_at"])
        return {v: (t - published[v]).total_seconds() for v, t in sorted(last.items())}
