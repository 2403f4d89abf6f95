"""Samples: one row per completion, from generation through scoring to its use by the trainer.

A sample moves from generated (through scored) to trained, dropped, evaluated or lost, each move at
most once: every write is keyed by msg_id and only moves samples still in an earlier status, so a
redelivered message has no second effect.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import JSON, Float, Integer, String, Update, bindparam, func, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement
from typing_extensions import Unpack

from broker.ledger.engine import Repository, chunks, json_safe
from broker.ledger.models import samples_t, utcnow
from broker.ledger.rows import (
    REWARD_STATUSES,
    SAMPLE_KINDS,
    SAMPLE_STATUSES,
    UNUSED_STATUSES,
    USED_STATUSES,
    SampleFilters,
    SampleIn,
    SampleRow,
    ScoredItem,
    Usage,
    UsageGroup,
    UsageTotals,
    UsedItem,
    check_one_of,
)

__all__ = ["SampleRepository", "fold_usage"]

# The run-time checks of `record_generated` and `record_used`, from the declared row shapes (a
# test holds SampleIn to the table's columns).
_SAMPLE_REQUIRED = SampleIn.__required_keys__
_SAMPLE_COLUMNS = SampleIn.__required_keys__ | SampleIn.__optional_keys__
_USED_KEYS = UsedItem.__required_keys__ | UsedItem.__optional_keys__


class SampleRepository(Repository):
    def record_generated(self, rows: Sequence[SampleIn]) -> int:
        """Insert sample rows; rows whose msg_id is already present are skipped.

        Args:
            rows: dicts keyed by `samples` column names. Required: msg_id, job_id, group_id,
                sample_index, prompt_index, generator_id, gen_version_min,
                num_prompt_tokens, num_completion_tokens, completion. Defaults:
                gen_version_max = gen_version_min, kind "train", status "generated",
                created_at now, everything else null.

        Returns:
            Number of rows inserted (excludes duplicates). Within one call, row ids follow
            msg_id order.

        Raises:
            ValueError: unknown or missing keys, or an invalid kind/status.
        """
        if not rows:
            return 0
        now = utcnow()
        full = [_complete_sample(row, now) for row in rows]
        # Sorted so that concurrent writers take unique-index locks in the same order (no
        # deadlocks on PostgreSQL).
        full.sort(key=lambda r: r["msg_id"])
        stmt = self._db.insert(samples_t).on_conflict_do_nothing(index_elements=["msg_id"])
        with self._db.write() as s:
            # A plain executemany (psycopg pipelines it) is several times faster here than
            # INSERT ... RETURNING batches; SQLAlchemy only reports an INSERT's rowcount (the sum
            # over the batch, excluding skipped duplicates) when asked to preserve it.
            conn = s.connection(execution_options={"preserve_rowcount": True})
            return int(conn.execute(stmt, full).rowcount)

    def record_scored(self, items: Sequence[ScoredItem]) -> int:
        """Set rewards; only samples still 'generated' change.

        Args:
            items: (msg_id, reward) or (msg_id, reward, reward_status, reward_details) tuples;
                reward_status is "ok", "timeout" or "error" (default "ok"), reward_details a
                JSON-safe dict ({"components": {...}, "reason": "..."}) or None.

        Returns:
            Number of samples that moved to 'scored' (repeats and unknown msg_ids count 0).
        """
        return len(self.record_scored_ids(items))

    def record_scored_ids(self, items: Sequence[ScoredItem]) -> set[str]:
        """`record_scored`, returning the msg_ids scored by this call: those that moved to
        'scored', and those already scored from the same source, i.e. whose stored
        reward_details["entry"] equals this item's (a retry of a write whose publish was lost).
        A sample scored from another entry (a second stream entry carrying its msg_id), used or
        unknown is not among them. Concurrent callers scoring one msg_id: exactly one of them gets
        it (the rows are locked FOR UPDATE on PostgreSQL; SQLite writers are serialised)."""
        if not items:
            return set()
        stmt = (
            update(samples_t)
            .where(samples_t.c.msg_id == bindparam("b_msg_id"), samples_t.c.status == "generated")
            .values(
                reward=bindparam("b_reward"),
                reward_status=bindparam("b_reward_status"),
                reward_details=bindparam("b_reward_details", type_=JSON),
                status="scored",
                scored_at=utcnow(),
            )
        )
        params = [_scored_params(item) for item in sorted(items, key=lambda it: it[0])]
        source = {p["b_msg_id"]: (p["b_reward_details"] or {}).get("entry") for p in params}
        with self._db.write() as s:
            moving = _scorable(s, source, lock=self._db.dialect == "postgresql")
            s.connection().execute(stmt, params)
        return moving

    def record_used(self, items: Sequence[UsedItem]) -> int:
        """Mark samples used by the trainer or evaluator; each sample is used at most once.

        Args:
            items: dicts with msg_id, status ('trained' | 'dropped' | 'evaluated' | 'lost'),
                trainer_version, and optionally staleness (default: trainer_version -
                gen_version_min, computed in SQL), drop_reason, reward (kept if absent).

        Returns:
            Number of samples changed; only 'generated' or 'scored' samples change.

        Raises:
            ValueError: unknown status or keys.
        """
        if not items:
            return 0
        params = sorted((_used_params(item) for item in items), key=lambda p: p["b_msg_id"])
        with self._db.write() as s:
            return int(s.connection().execute(_used_update(), params).rowcount)

    def samples(
        self, job_id: str, *, limit: int | None = None, offset: int = 0, **filters: Unpack[SampleFilters]
    ) -> list[SampleRow]:
        """A job's samples in insertion order (row id, so pages are stable), optionally filtered.

        Bounds are inclusive; a bound on trainer_version, staleness or reward excludes samples
        where that column is still null (not yet used, or not yet scored).

        Raises:
            ValueError: unknown status or kind.
        """
        where = _sample_filters(job_id, **filters)
        stmt = select(samples_t).where(*where).order_by(samples_t.c.id).offset(offset).limit(limit)
        with self._db.read() as s:
            return [cast(SampleRow, dict(r)) for r in s.execute(stmt).mappings()]

    def count_samples(self, job_id: str, **filters: Unpack[SampleFilters]) -> int:
        """How many samples `samples` returns for the same filters without limit and offset.

        Raises:
            ValueError: unknown status or kind.
        """
        where = _sample_filters(job_id, **filters)
        with self._db.read() as s:
            return int(s.execute(select(func.count()).select_from(samples_t).where(*where)).scalar_one())

    def status_counts(self, job_id: str) -> dict[str, int]:
        """Number of a job's samples per status (statuses with none are absent)."""
        stmt = select(samples_t.c.status, func.count()).where(samples_t.c.job_id == job_id).group_by(samples_t.c.status)
        with self._db.read() as s:
            return {status: int(n) for status, n in s.execute(stmt)}

    def reward_status_counts(self, job_id: str) -> dict[str, int]:
        """Number of a job's scored samples per reward status (`ok`, `timeout`, `error`; those with
        none are absent). Samples dead-lettered before a reward was recorded (on_failure drop)
        have none and are not counted."""
        c = samples_t.c
        stmt = (
            select(c.reward_status, func.count())
            .where(c.job_id == job_id, c.reward_status.is_not(None))
            .group_by(c.reward_status)
        )
        with self._db.read() as s:
            return {status: int(n) for status, n in s.execute(stmt)}

    def staleness_histogram(self, job_id: str, *, status: str = "trained") -> dict[int, int]:
        """staleness -> number of samples with `status` (default: trained), ascending.

        Raises:
            ValueError: `status` is not one of USED_STATUSES.
        """
        check_one_of(status, USED_STATUSES, "used status")
        stmt = (
            select(samples_t.c.staleness, func.count())
            .where(
                samples_t.c.job_id == job_id,
                samples_t.c.status == status,
                samples_t.c.staleness.is_not(None),
            )
            .group_by(samples_t.c.staleness)
            .order_by(samples_t.c.staleness)
        )
        with self._db.read() as s:
            return {int(k): int(n) for k, n in s.execute(stmt)}

    def usage(self, job_id: str) -> Usage:
        """What the job's samples cost the generators (`fold_usage`): generator-seconds, samples
        and tokens over every sample it generated, training and evaluation, whatever became of
        them (a dropped or lost sample took its generate time too). Samples from before
        migration 0010 have no gen_seconds and count 0 seconds."""
        c = samples_t.c
        groups = (
            select(
                c.kind,
                c.generator_id,
                func.count(),
                func.coalesce(func.sum(c.gen_seconds), 0.0),
                func.coalesce(func.sum(c.num_prompt_tokens), 0),
                func.coalesce(func.sum(c.num_completion_tokens), 0),
            )
            .where(c.job_id == job_id)
            .group_by(c.kind, c.generator_id)
        )
        adapters = select(func.count(func.distinct(c.adapter))).where(c.job_id == job_id)  # nulls not counted
        with self._db.read() as s:
            rows = [
                UsageGroup(str(k), str(g), int(n), float(sec), int(p), int(t))
                for k, g, n, sec, p, t in s.execute(groups)
            ]
            n_adapters = int(s.execute(adapters).scalar_one())
        return fold_usage(rows, n_adapters)

    def used_msg_ids(self, job_id: str, msg_ids: Iterable[str]) -> set[str]:
        """The subset of `msg_ids` already used (USED_STATUSES)."""
        ids = sorted(set(msg_ids))
        found: set[str] = set()
        with self._db.read() as s:
            for chunk in chunks(ids):
                stmt = select(samples_t.c.msg_id).where(
                    samples_t.c.job_id == job_id,
                    samples_t.c.msg_id.in_(chunk),
                    samples_t.c.status.in_(USED_STATUSES),
                )
                found.update(s.execute(stmt).scalars())
        return found


def fold_usage(groups: Iterable[UsageGroup], adapters: int) -> Usage:
    """A job's usage from its per (kind, generator) sums: the totals, each generator's part and
    each kind's (every one of SAMPLE_KINDS, zeros where none), and `adapters` as given."""
    total = _zero_totals()
    by_kind = {kind: _zero_totals() for kind in SAMPLE_KINDS}
    by_generator: dict[str, Any] = {}
    for g in groups:
        for t in (total, by_kind.setdefault(g.kind, _zero_totals())):
            t["generator_seconds"] += g.seconds
            t["samples"] += g.samples
            t["prompt_tokens"] += g.prompt_tokens
            t["completion_tokens"] += g.completion_tokens
        gen = by_generator.setdefault(g.generator_id, {"seconds": 0.0, "samples": 0, "completion_tokens": 0})
        gen["seconds"] += g.seconds
        gen["samples"] += g.samples
        gen["completion_tokens"] += g.completion_tokens
    return {**total, "by_generator": dict(sorted(by_generator.items())), "by_kind": by_kind, "adapters": adapters}


def _zero_totals() -> UsageTotals:
    return {"generator_seconds": 0.0, "samples": 0, "prompt_tokens": 0, "completion_tokens": 0}


def _complete_sample(row: SampleIn, now: datetime) -> dict[str, Any]:
    """`row` with every column present (executemany needs the same keys in every row) and the
    defaults of `record_generated` filled in.

    Raises:
        ValueError: unknown or missing keys, or an invalid kind/status.
    """
    unknown = row.keys() - _SAMPLE_COLUMNS
    missing = _SAMPLE_REQUIRED - row.keys()
    if unknown or missing:
        raise ValueError(
            f"sample {row.get('msg_id')!r}: unknown keys {sorted(unknown)}, "
            f"missing keys {sorted(missing)}; columns: {sorted(_SAMPLE_COLUMNS)}"
        )
    r: dict[str, Any] = {**dict.fromkeys(_SAMPLE_COLUMNS), **row}
    r["kind"] = r["kind"] or "train"
    r["status"] = r["status"] or "generated"
    r["created_at"] = r["created_at"] or now
    if r["gen_version_max"] is None:
        r["gen_version_max"] = r["gen_version_min"]
    check_one_of(r["kind"], SAMPLE_KINDS, "sample kind")
    check_one_of(r["status"], SAMPLE_STATUSES, "sample status")
    return r


def _scored_params(item: ScoredItem) -> dict[str, Any]:
    """The bound parameters of one `record_scored` item.

    Raises:
        ValueError: unknown reward status.
    """
    msg_id, reward = item[0], float(item[1])
    status = item[2] if len(item) > 2 else "ok"
    check_one_of(status, REWARD_STATUSES, "reward status")
    details = json_safe(item[3]) if len(item) > 3 and item[3] else None
    return {"b_msg_id": msg_id, "b_reward": reward, "b_reward_status": status, "b_reward_details": details}


def _scorable(s: Session, source: dict[str, Any], *, lock: bool) -> set[str]:
    """Of the msg_ids in `source` (msg_id -> its stream entry or None), those still 'generated'
    or already scored from the same entry; `lock`: read them FOR UPDATE."""
    c = samples_t.c
    moving: set[str] = set()
    for chunk in chunks(sorted(source)):
        found = select(c.msg_id, c.status, c.reward_details).where(c.msg_id.in_(chunk))
        if lock:
            found = found.with_for_update()
        for msg_id, status, details in s.execute(found):
            entry = source[msg_id]
            if status == "generated" or (
                status == "scored" and entry is not None and isinstance(details, dict) and details.get("entry") == entry
            ):
                moving.add(msg_id)
    return moving


def _used_params(item: UsedItem) -> dict[str, Any]:
    """The bound parameters of one `record_used` item.

    Raises:
        ValueError: unknown keys or status, or msg_id or status missing.
    """
    unknown = item.keys() - _USED_KEYS
    if unknown or "msg_id" not in item or "status" not in item:
        raise ValueError(f"used item {item!r}: needs msg_id and status, allowed keys {sorted(_USED_KEYS)}")
    check_one_of(item["status"], USED_STATUSES, "used status")
    return {
        "b_msg_id": item["msg_id"],
        "b_status": item["status"],
        "b_trainer_version": item.get("trainer_version"),
        "b_staleness": item.get("staleness"),
        "b_drop_reason": item.get("drop_reason"),
        "b_reward": item.get("reward"),
    }


def _used_update() -> Update:
    """The executemany UPDATE of `record_used` over `_used_params` rows."""
    trainer_version = bindparam("b_trainer_version", type_=Integer)
    return (
        update(samples_t)
        .where(
            samples_t.c.msg_id == bindparam("b_msg_id"),
            # Not IN (...): expanding parameters are not allowed with executemany.
            or_(*(samples_t.c.status == st for st in UNUSED_STATUSES)),
        )
        .values(
            status=bindparam("b_status", type_=String),
            trainer_version=trainer_version,
            staleness=func.coalesce(
                bindparam("b_staleness", type_=Integer),
                trainer_version - samples_t.c.gen_version_min,
            ),
            drop_reason=bindparam("b_drop_reason", type_=String),
            reward=func.coalesce(bindparam("b_reward", type_=Float), samples_t.c.reward),
            used_at=utcnow(),
        )
    )


def _sample_filters(job_id: str, **f: Unpack[SampleFilters]) -> list[ColumnElement[bool]]:
    """WHERE conditions shared by `samples` and `count_samples`.

    Raises:
        ValueError: unknown status or kind.
    """
    if unknown := sorted(set(f) - SampleFilters.__optional_keys__):
        raise TypeError(f"unknown sample filters {unknown}; valid: {sorted(SampleFilters.__optional_keys__)}")
    c = samples_t.c
    where: list[ColumnElement[bool]] = [c.job_id == job_id]
    if (status := f.get("status")) is not None:
        check_one_of(status, SAMPLE_STATUSES, "sample status")
        where.append(c.status == status)
    if (kind := f.get("kind")) is not None:
        check_one_of(kind, SAMPLE_KINDS, "sample kind")
        where.append(c.kind == kind)
    bounds: tuple[tuple[Any, float | None, float | None], ...] = (
        (c.trainer_version, f.get("min_trainer_version"), f.get("max_trainer_version")),
        (c.staleness, f.get("min_staleness"), f.get("max_staleness")),
        (c.reward, f.get("min_reward"), f.get("max_reward")),
    )
    for column, lo, hi in bounds:
        if lo is not None:
            where.append(column >= lo)
        if hi is not None:
            where.append(column <= hi)
    return where
