"""Check a job's ledger against the invariants the pipeline promises, and print a summary.

    python -m broker.verify [--url URL] [--job JOB]

`verify(ledger, job_id)` is the same check as a function (tests and the chaos suite call it). It
only reads: every query is SQLAlchemy Core on the ledger's tables with bound parameters, grouped in
SQL so a job of millions of samples is checked without loading its rows.

Invariants (names as in `VerifyResult.checks`):

- `status_known`: every sample's status is one of SAMPLE_STATUSES.
- `used_has_version`: a trained/dropped/evaluated sample records the trainer version at use.
- `staleness`: staleness = trainer_version - gen_version_min for every used sample.
- `gen_version_order`: gen_version_min <= gen_version_max.
- `msg_id_unique`: one row per msg_id (a UNIQUE constraint; checked in case it was lost).
- `trained_once`: no (group_id, sample_index) trained twice (e.g. under two msg_ids).
- `group_one_step`: a training group is used whole in one step: all its used samples share one
  status and one trainer version (the trainer takes or drops complete groups, trainer_svc/train.py).
- `group_complete`: a trained group has exactly the job's group_size trained samples.
- `step_samples`: each train step's `samples` metric equals the trained rows of the version it
  trained (train_steps.policy_version is the version it produced, so trainer_version = that - 1).
- `trained_has_step`: every trainer version with trained rows has its train step recorded.
- `gen_version_loaded`: a trained sample's generation version was loaded by its generator
  (generator_loads), for generators that recorded loads.

Samples still `generated` or `scored` are in flight, not violations: a finished job keeps those it
generated beyond its last step (at most (k + 1) * prompts_per_step groups per trainer run, plus an
unfinished evaluation). They are reported as info, as is anything that a running job's step in
progress may still change.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from rich.console import Console
from rich.table import Table as RichTable
from sqlalchemy import Table, and_, func, not_, or_, select
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.sql.elements import ColumnElement

from broker.ledger import (
    SAMPLE_STATUSES,
    USED_STATUSES,
    GeneratorLoad,
    Ledger,
    Sample,
    TrainStep,
)

__all__ = ["CHECKS", "Finding", "VerifyResult", "main", "verify"]

_samples = cast(Table, Sample.__table__)
_steps = cast(Table, TrainStep.__table__)
_loads = cast(Table, GeneratorLoad.__table__)

CHECKS = (
    "status_known",
    "used_has_version",
    "staleness",
    "gen_version_order",
    "msg_id_unique",
    "trained_once",
    "group_one_step",
    "group_complete",
    "step_samples",
    "trained_has_step",
    "gen_version_loaded",
)
_EXAMPLES = 5  # offending keys kept per finding
_FINISHED = ("finished", "stopped", "failed", "cancelled")
_IN_FLIGHT = ("generated", "scored")


@dataclass(frozen=True)
class Finding:
    check: str  # one of CHECKS, or "in_flight" for info
    level: Literal["violation", "info"]
    count: int  # offending rows (samples, groups or steps, as the message says)
    message: str
    examples: tuple[str, ...] = ()  # a few msg_ids / group ids / versions to look at


@dataclass
class VerifyResult:
    job_id: str
    job_state: str
    counts: dict[str, int]  # samples per status
    in_flight: int  # samples still generated or scored
    steps: int  # train steps recorded
    checks: dict[str, int] = field(default_factory=dict)  # check -> violating rows (0: holds)
    violations: list[Finding] = field(default_factory=list)
    info: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, finding: Finding) -> None:
        (self.violations if finding.level == "violation" else self.info).append(finding)


def _count_and_examples(conn: Connection, where: ColumnElement[bool], key: Any) -> tuple[int, tuple[str, ...]]:
    """How many samples match `where`, and the first few values of `key` among them."""
    n = conn.execute(select(func.count()).select_from(_samples).where(where)).scalar_one()
    if not n:
        return 0, ()
    ex = conn.execute(select(key).where(where).order_by(_samples.c.id).limit(_EXAMPLES)).scalars()
    return int(n), tuple(str(e) for e in ex)


def _grouped(conn: Connection, stmt: Any) -> tuple[int, tuple[str, ...]]:
    """Run a GROUP BY ... HAVING statement whose columns name the offender."""
    rows = conn.execute(stmt).all()
    return len(rows), tuple("/".join(str(x) for x in r) for r in rows[:_EXAMPLES])


def verify(ledger: Ledger, job_id: str) -> VerifyResult:
    """Check one job's ledger invariants (see the module docstring); read-only.

    Raises:
        LookupError: no such job.
    """
    job = ledger.get_job(job_id)
    if job is None:
        raise LookupError(f"no job {job_id!r} in the ledger")
    spec = job.get("spec") or {}
    running = job["state"] not in _FINISHED
    c = _samples.c
    mine = c.job_id == job_id
    used = and_(mine, c.status.in_(USED_STATUSES))
    trained = and_(mine, c.status == "trained")

    with ledger.engine.connect() as conn:
        counts = {
            s: int(n)
            for s, n in conn.execute(select(c.status, func.count()).where(mine).group_by(c.status))
        }
        steps = [dict(r) for r in conn.execute(select(_steps).where(_steps.c.job_id == job_id)).mappings()]
        res = VerifyResult(
            job_id=job_id,
            job_state=job["state"],
            counts=counts,
            in_flight=sum(counts.get(s, 0) for s in _IN_FLIGHT),
            steps=len(steps),
            checks=dict.fromkeys(CHECKS, 0),
        )

        def check(name: str, n: int, message: str, examples: tuple[str, ...] = ()) -> None:
            res.checks[name] += n
            if n:
                res.add(Finding(name, "violation", n, message, examples))

        # -- per-sample invariants ----------------------------------------------------------
        n, ex = _count_and_examples(conn, and_(mine, not_(c.status.in_(SAMPLE_STATUSES))), c.msg_id)
        check("status_known", n, f"samples with a status outside {SAMPLE_STATUSES}", ex)
        n, ex = _count_and_examples(conn, and_(used, c.trainer_version.is_(None)), c.msg_id)
        check("used_has_version", n, "used samples without a trainer version", ex)
        stale_wrong = and_(
            used,
            c.trainer_version.is_not(None),
            or_(c.staleness.is_(None), c.staleness != c.trainer_version - c.gen_version_min),
        )
        n, ex = _count_and_examples(conn, stale_wrong, c.msg_id)
        check("staleness", n, "used samples whose staleness is not trainer_version - gen_version_min", ex)
        n, ex = _count_and_examples(conn, and_(mine, c.gen_version_min > c.gen_version_max), c.msg_id)
        check("gen_version_order", n, "samples with gen_version_min > gen_version_max", ex)

        # -- used at most once, groups whole --------------------------------------------------
        n, ex = _grouped(conn, select(c.msg_id).where(mine).group_by(c.msg_id).having(func.count() > 1))
        check("msg_id_unique", n, "msg_ids with more than one row", ex)
        n, ex = _grouped(
            conn,
            select(c.group_id, c.sample_index)
            .where(trained)
            .group_by(c.group_id, c.sample_index)
            .having(func.count() > 1),
        )
        check("trained_once", n, "(group_id, sample_index) pairs trained more than once", ex)
        n, ex = _grouped(
            conn,
            select(c.group_id)
            .where(used, c.kind == "train")
            .group_by(c.group_id)
            .having(or_(func.count(c.trainer_version.distinct()) > 1, func.count(c.status.distinct()) > 1)),
        )
        check("group_one_step", n, "training groups used in more than one step or split between trained and dropped", ex)
        if "group_size" in spec:
            n, ex = _grouped(
                conn,
                select(c.group_id)
                .where(trained, c.kind == "train")
                .group_by(c.group_id)
                .having(func.count() != int(spec["group_size"])),
            )
            check("group_complete", n, f"trained groups without exactly group_size={spec['group_size']} trained samples", ex)

        # -- steps against trained rows -------------------------------------------------------
        per_version = {
            int(v): int(k)
            for v, k in conn.execute(
                select(c.trainer_version, func.count())
                .where(trained, c.trainer_version.is_not(None))  # null: used_has_version's finding
                .group_by(c.trainer_version)
            )
        }
        newest = max((s["policy_version"] for s in steps), default=0)
        by_trained: dict[int, list[dict]] = {}
        for s in steps:
            by_trained.setdefault(int(s["policy_version"]) - 1, []).append(s)
        bad_steps: list[str] = []
        no_metric = 0
        for v, rows in sorted(by_trained.items()):
            claimed = [(r["metrics"] or {}).get("samples") for r in rows]
            if any(x is None for x in claimed):
                no_metric += 1
                continue
            # Two steps that produced the same version (a trainer restarted without resume)
            # claim the same rows: their sum must match.
            total = sum(int(x) for x in claimed if x is not None)
            if total != per_version.get(v, 0):
                bad_steps.append(f"step {rows[0]['step']}: {total} samples, {per_version.get(v, 0)} trained rows at v{v}")
        check("step_samples", len(bad_steps), "train steps whose sample count differs from the trained rows", tuple(bad_steps[:_EXAMPLES]))
        if no_metric:
            res.add(Finding("step_samples", "info", no_metric, "train steps without a 'samples' metric (not checked)"))
        orphans = sorted(v for v in per_version if v not in by_trained)
        # A running job's current step writes its samples before its train_steps row.
        if running:
            pending = [v for v in orphans if v >= newest]
            orphans = [v for v in orphans if v < newest]
            if pending:
                res.add(Finding("trained_has_step", "info", len(pending),
                                "trainer versions with trained rows whose step is still being recorded",
                                tuple(f"v{v}" for v in pending)))
        check("trained_has_step", len(orphans), "trainer versions with trained rows but no train step",
              tuple(f"v{v}" for v in orphans[:_EXAMPLES]))

        # -- generation versions were loaded --------------------------------------------------
        loads: dict[str, set[int]] = {}
        for g, v in conn.execute(select(_loads.c.generator_id, _loads.c.version).where(_loads.c.job_id == job_id)):
            loads.setdefault(g, set()).add(int(v))
        used_versions = conn.execute(
            select(c.generator_id, c.gen_version_min, c.gen_version_max, func.count())
            .where(trained)
            .group_by(c.generator_id, c.gen_version_min, c.gen_version_max)
        ).all()
        unloaded, unknown_gens = 0, set()
        unloaded_ex: list[str] = []
        for g, vmin, vmax, k in used_versions:
            if g not in loads:
                unknown_gens.add(g)
                continue
            missing = sorted({int(vmin), int(vmax)} - loads[g])
            if missing:
                unloaded += int(k)
                unloaded_ex.append(f"{g} v{missing[0]}")
        check("gen_version_loaded", unloaded, "trained samples whose generation version their generator never recorded loading",
              tuple(unloaded_ex[:_EXAMPLES]))
        if unknown_gens:
            res.add(Finding("gen_version_loaded", "info", len(unknown_gens),
                            "generators with trained samples but no recorded loads (not checked)",
                            tuple(sorted(unknown_gens)[:_EXAMPLES])))

    # -- in flight ------------------------------------------------------------------------------
    if res.in_flight:
        bound = _in_flight_bound(spec)
        what = "finished job" if not running else f"{job['state']} job"
        msg = f"samples still generated/scored in a {what} (in flight, not used)"
        if bound is not None:
            msg += f"; nominal bound per trainer run {bound}"
        res.add(Finding("in_flight", "info", res.in_flight, msg))
    return res


def _in_flight_bound(spec: dict) -> int | None:
    """(k + 1) * prompts_per_step training groups of group_size, plus one evaluation round
    (shared/staleness_bound.py); None for a spec that does not say."""
    from shared.staleness_bound import in_flight_samples

    try:
        return in_flight_samples(spec)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def render(res: VerifyResult, console: Console) -> None:
    """The summary: samples per status, then one row per check."""
    head = RichTable(title=f"ledger of job {res.job_id} ({res.job_state})", show_header=True)
    for col in ("samples", *SAMPLE_STATUSES, "in flight", "train steps"):
        head.add_column(col, justify="right")
    head.add_row(str(res.total), *(str(res.counts.get(s, 0)) for s in SAMPLE_STATUSES), str(res.in_flight), str(res.steps))
    console.print(head)
    table = RichTable(show_header=True)
    table.add_column("check")
    table.add_column("result")
    table.add_column("details", overflow="fold")
    for name in CHECKS:
        found = [f for f in res.violations if f.check == name]
        notes = [f for f in res.info if f.check == name]
        if found:
            details = "; ".join(f"{f.count} {f.message}" + (f" (e.g. {', '.join(f.examples)})" if f.examples else "") for f in found)
            table.add_row(name, "[red]FAIL[/red]", details)
        else:
            table.add_row(name, "[green]ok[/green]", "; ".join(f"{f.count} {f.message}" for f in notes))
    for f in res.info:
        if f.check not in CHECKS:
            table.add_row(f.check, "[yellow]info[/yellow]", f"{f.count} {f.message}")
    console.print(table)
    verdict = "[green]ledger OK[/green]" if res.ok else f"[red]{len(res.violations)} invariant(s) violated[/red]"
    console.print(verdict)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when every invariant holds, 1 on violations, 2 when there is no such job."""
    parser = argparse.ArgumentParser(prog="python -m broker.verify", description="Check a job's ledger invariants.")
    parser.add_argument(
        "--url", default=os.environ.get("DATABASE_URL", "sqlite:///runs/ledger.db"),
        help="SQLAlchemy URL of the ledger (default: $DATABASE_URL, else sqlite:///runs/ledger.db)",
    )
    parser.add_argument("--job", help="job id (default: the newest job)")
    args = parser.parse_args(argv)
    console = Console()
    url = make_url(args.url)
    if url.get_backend_name() == "sqlite" and url.database and not Path(url.database).exists():
        console.print(f"no ledger at {url.database}")  # a checker must not create an empty one
        return 2
    ledger = Ledger(url, migrate=False)
    try:
        job_id = args.job
        if job_id is None:
            newest = ledger.list_jobs(limit=1)
            if not newest:
                console.print(f"no jobs in the ledger {ledger!r}")
                return 2
            job_id = newest[0]["id"]
        try:
            res = verify(ledger, job_id)
        except LookupError as exc:
            console.print(str(exc))
            return 2
        render(res, console)
        return 0 if res.ok else 1
    finally:
        ledger.close()


if __name__ == "__main__":
    sys.exit(main())
