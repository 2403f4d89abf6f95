"""Check a job's ledger against the invariants the pipeline promises, and print a summary.

    python -m broker.verify [--url URL] [--job JOB]

`verify(ledger, job_id)` is the same check as a function (tests and the chaos suite call it). It
only reads: every query is a named audit query of the ledger (`broker.ledger.audit`), grouped in
SQL so a job of millions of samples is checked without loading its rows.

Invariants (names as in `VerifyResult.checks`):

- `status_known`: every sample's status is one of SAMPLE_STATUSES.
- `used_has_version`: a used sample (trained/dropped/evaluated/lost) records the trainer version at use.
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
progress may still change. So are `lost` samples (`VerifyResult.lost`): those Redis lost in a
failover before they were used (the trainer records them when no stream holds anything of their
group any more, trainer_svc/sink.py `settle_lost`): an accounted loss, not a broken invariant.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table as RichTable
from sqlalchemy.engine import make_url

from broker.ledger import SAMPLE_STATUSES, Ledger
from broker.ledger.audit import JobAudit
from broker.ledger.rows import Offenders, TrainStepRow
from shared.jobspec import JobSpec, stored_spec
from shared.staleness_bound import in_flight_samples

__all__ = ["CHECKS", "Finding", "VerifyResult", "main", "verify"]

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
    check: str  # one of CHECKS, or "in_flight" / "lost" for info
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
    lost: int  # samples Redis lost before they were used (status "lost")
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


def _check(res: VerifyResult, name: str, found: Offenders, message: str) -> None:
    """Count `found` against check `name`: a violation when there is any."""
    res.checks[name] += found.total
    if found.total:
        res.add(Finding(name, "violation", found.total, message, found.examples))


def _check_samples(q: JobAudit, res: VerifyResult) -> None:
    """Per-sample invariants: status, trainer version, staleness, generation version order."""
    _check(res, "status_known", q.unknown_status(), f"samples with a status outside {SAMPLE_STATUSES}")
    _check(res, "used_has_version", q.used_without_version(), "used samples without a trainer version")
    _check(
        res, "staleness", q.wrong_staleness(), "used samples whose staleness is not trainer_version - gen_version_min"
    )
    _check(res, "gen_version_order", q.reversed_gen_versions(), "samples with gen_version_min > gen_version_max")


def _check_groups(q: JobAudit, res: VerifyResult, spec: JobSpec | None) -> None:
    """Used at most once, groups whole (complete when the stored spec gives its group_size)."""
    _check(res, "msg_id_unique", q.duplicate_msg_ids(), "msg_ids with more than one row")
    _check(res, "trained_once", q.trained_twice(), "(group_id, sample_index) pairs trained more than once")
    _check(
        res,
        "group_one_step",
        q.split_groups(),
        "training groups used in more than one step or split between trained and dropped",
    )
    if spec is not None and "group_size" in spec.model_fields_set:
        _check(
            res,
            "group_complete",
            q.groups_not_of_size(spec.group_size),
            f"trained groups without exactly group_size={spec.group_size} trained samples",
        )


def _check_steps(q: JobAudit, res: VerifyResult, steps: list[TrainStepRow], running: bool) -> None:
    """Train steps against trained rows: each step's `samples` metric, and a step for every
    trainer version with trained rows (a running job's newest may still be being recorded)."""
    per_version = q.trained_per_version()  # rows without a version: used_has_version's finding
    newest = max((s["policy_version"] for s in steps), default=0)
    by_trained: dict[int, list[TrainStepRow]] = {}
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
    _check(
        res,
        "step_samples",
        Offenders(len(bad_steps), tuple(bad_steps[:_EXAMPLES])),
        "train steps whose sample count differs from the trained rows",
    )
    if no_metric:
        res.add(Finding("step_samples", "info", no_metric, "train steps without a 'samples' metric (not checked)"))
    orphans = sorted(v for v in per_version if v not in by_trained)
    # A running job's current step writes its samples before its train_steps row.
    if running:
        pending = [v for v in orphans if v >= newest]
        orphans = [v for v in orphans if v < newest]
        if pending:
            res.add(
                Finding(
                    "trained_has_step",
                    "info",
                    len(pending),
                    "trainer versions with trained rows whose step is still being recorded",
                    tuple(f"v{v}" for v in pending),
                )
            )
    _check(
        res,
        "trained_has_step",
        Offenders(len(orphans), tuple(f"v{v}" for v in orphans[:_EXAMPLES])),
        "trainer versions with trained rows but no train step",
    )


def _check_loads(q: JobAudit, res: VerifyResult) -> None:
    """Generation versions were loaded, for generators that recorded loads."""
    loads = q.loaded_versions()
    unloaded, unknown_gens = 0, set()
    unloaded_ex: list[str] = []
    for g, vmin, vmax, k in q.trained_generation_versions():
        if g not in loads:
            unknown_gens.add(g)
            continue
        missing = sorted({vmin, vmax} - loads[g])
        if missing:
            unloaded += k
            unloaded_ex.append(f"{g} v{missing[0]}")
    _check(
        res,
        "gen_version_loaded",
        Offenders(unloaded, tuple(unloaded_ex[:_EXAMPLES])),
        "trained samples whose generation version their generator never recorded loading",
    )
    if unknown_gens:
        res.add(
            Finding(
                "gen_version_loaded",
                "info",
                len(unknown_gens),
                "generators with trained samples but no recorded loads (not checked)",
                tuple(sorted(unknown_gens)[:_EXAMPLES]),
            )
        )


def verify(ledger: Ledger, job_id: str) -> VerifyResult:
    """Check one job's ledger invariants (see the module docstring); read-only.

    Raises:
        LookupError: no such job.
    """
    job = ledger.get_job(job_id)
    if job is None:
        raise LookupError(f"no job {job_id!r} in the ledger")
    spec = _read_spec(job.get("spec") or {})
    running = job["state"] not in _FINISHED

    with ledger.audit(job_id, examples=_EXAMPLES) as q:
        counts = q.status_counts()
        steps = q.train_steps()
        res = VerifyResult(
            job_id=job_id,
            job_state=job["state"],
            counts=counts,
            in_flight=sum(counts.get(s, 0) for s in _IN_FLIGHT),
            lost=counts.get("lost", 0),
            steps=len(steps),
            checks=dict.fromkeys(CHECKS, 0),
        )
        _check_samples(q, res)
        _check_groups(q, res, spec)
        _check_steps(q, res, steps, running)
        _check_loads(q, res)

    # -- in flight ------------------------------------------------------------------------------
    if res.in_flight:
        bound = _in_flight_bound(spec)
        what = "finished job" if not running else f"{job['state']} job"
        msg = f"samples still generated/scored in a {what} (in flight, not used)"
        if bound is not None:
            msg += f"; nominal bound per trainer run {bound}"
        res.add(Finding("in_flight", "info", res.in_flight, msg))
    if res.lost:
        res.add(
            Finding(
                "lost",
                "info",
                res.lost,
                "samples Redis lost before they were used (a failover to a replica "
                "that had not received them), recorded by the trainer; never trained",
            )
        )
    return res


def _read_spec(stored: dict[str, Any]) -> JobSpec | None:
    """The job's stored spec (shared/jobspec.py `stored_spec`); None when it cannot be read (the
    checks that need it are skipped)."""
    try:
        return stored_spec(stored)
    except ValidationError:
        return None


def _in_flight_bound(spec: JobSpec | None) -> int | None:
    """(k + 1) * prompts_per_step training groups of group_size, plus one evaluation round of n_test
    problems (shared/staleness_bound.py); None for a spec that does not say (one without
    prompts_per_step, group_size or n_test, or none that can be read)."""
    if spec is None or not {"prompts_per_step", "group_size"} <= spec.model_fields_set or spec.task.n_test is None:
        return None
    return in_flight_samples(spec.staleness_bound, spec.prompts_per_step, spec.group_size, spec.task.n_test)


def render(res: VerifyResult, console: Console) -> None:
    """The summary: samples per status, then one row per check."""
    head = RichTable(title=f"ledger of job {res.job_id} ({res.job_state})", show_header=True)
    for col in ("samples", *SAMPLE_STATUSES, "in flight", "train steps"):
        head.add_column(col, justify="right")
    head.add_row(
        str(res.total), *(str(res.counts.get(s, 0)) for s in SAMPLE_STATUSES), str(res.in_flight), str(res.steps)
    )
    console.print(head)
    table = RichTable(show_header=True)
    table.add_column("check")
    table.add_column("result")
    table.add_column("details", overflow="fold")
    for name in CHECKS:
        found = [f for f in res.violations if f.check == name]
        notes = [f for f in res.info if f.check == name]
        if found:
            details = "; ".join(
                f"{f.count} {f.message}" + (f" (e.g. {', '.join(f.examples)})" if f.examples else "") for f in found
            )
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
        "--url",
        default=os.environ.get("DATABASE_URL", "sqlite:///runs/ledger.db"),
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
