"""Collapse-guard calibration: replay jobs' recorded step metrics through the guard's checks.

Every job in a ledger has its per-step metrics (`Ledger.train_steps`: reward/mean, reward/std,
samples, is/*, loss, grad_norm, ...). Replaying them through trainer_svc/guard.py `check` with a
given GuardSpec says where that spec would have tripped; over jobs a user calls healthy, every
trip is a false one. After a reward-collapse trip the replayed reward series starts afresh (what
the default `on_no_checkpoint: lower_lr` does, and near enough what a roll-back does: the jobs
went on as recorded, so later steps are not those a roll-back would have produced).

    python -m asyncrl.guard_calibration --url sqlite:///runs/demo/ledger.db [--url URL ...]
        [--job ID ...] [--guard '{"reward_window": 3}'] [--out results/guard_calibration.json]
        [--md results/guard_calibration.md]

prints a markdown table (task, mode, k, seed, loss, steps, trips and their reasons) and writes
the JSON (the GuardSpec used, one row per job) with --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shared.jobspec import GuardSpec, JobSpec, stored_spec
from trainer_svc.guard import IS_SIGNALS, check

# the metrics the checks read besides the loss's IS_SIGNALS; a job that lacks one was not fully
# checked (e.g. a ledger from before the applied-weight metrics: its importance-weight check is
# skipped)
CHECKED = ("loss", "grad_norm", "reward/mean", "reward/std", "samples")


def replay(steps: Sequence[tuple[int, Mapping[str, float]]], cfg: GuardSpec, loss: str) -> list[dict[str, Any]]:
    """The guard's trips over one job's `steps` ((step, metrics), oldest first): one
    {step, kind, reason} per tripping step. A reward-collapse trip restarts the reward series at
    the next step (module docstring); the other checks look at each step's own metrics."""
    trips: list[dict[str, Any]] = []
    rewards: list[float] = []
    for step, metrics in steps:
        if "reward/mean" in metrics:
            rewards.append(float(metrics["reward/mean"]))
        trip = check(metrics, rewards, cfg, loss)
        if trip is None:
            continue
        trips.append({"step": step, "kind": trip[0], "reason": trip[1]})
        if trip[0] == "reward_collapse":
            rewards = []
    return trips


def _staleness(spec: JobSpec) -> str:
    """The job's staleness bound as the table shows it: 0 (sync), k, or the adaptive range."""
    if spec.mode == "sync":
        return "0"
    if spec.adaptive_staleness is not None:
        return f"{spec.adaptive_staleness.k_min}-{spec.adaptive_staleness.k_max} (adaptive)"
    return str(spec.max_staleness)


def job_row(url: str, job: Mapping[str, Any], steps: Sequence[Mapping[str, Any]], cfg: GuardSpec) -> dict[str, Any]:
    """One job's calibration row: what it was (task, mode, k, seed, loss; its stored spec read by
    shared/jobspec.py `stored_spec`) and its trips."""
    spec = stored_spec(job.get("spec") or {})
    loss = spec.algorithm.loss
    series = [(int(s["step"]), s["metrics"] or {}) for s in steps]
    needed = (*CHECKED, *IS_SIGNALS.get(loss, ()))
    missing = sorted({k for _, m in series for k in needed if k not in m})
    trips = replay(series, cfg, loss)
    return {
        "url": url,
        "job_id": job["id"],
        "name": job.get("name"),
        "state": job.get("state"),
        "task": spec.task.name,
        "mode": spec.mode,
        "k": _staleness(spec),
        "seed": spec.seed,
        "loss": loss,
        "steps": len(series),
        "trips": trips,
        "n_trips": len(trips),
        "missing_metrics": missing,
    }


def calibrate(urls: Sequence[str], job_ids: Sequence[str], cfg: GuardSpec, migrate: bool = False) -> dict[str, Any]:
    """Rows for `job_ids` (every job when empty) of each ledger in `urls`, and the totals;
    `migrate` upgrades an older ledger's schema first (as a service opening it would)."""
    from broker.ledger import Ledger

    rows = []
    for url in urls:
        ledger = Ledger(url, migrate=migrate)
        try:
            jobs = [ledger.get_job(j) for j in job_ids] if job_ids else ledger.list_jobs(limit=1_000_000)
            for job in jobs:
                if job is not None:
                    rows.append(job_row(url, job, ledger.train_steps(job["id"]), cfg))
        finally:
            ledger.close()
    return {
        "guard": cfg.model_dump(),
        "jobs": rows,
        "jobs_with_trips": sum(r["n_trips"] > 0 for r in rows),
        "total_trips": sum(r["n_trips"] for r in rows),
    }


def markdown(result: Mapping[str, Any]) -> str:
    """The rows as a markdown table, the GuardSpec above it."""
    lines = [
        f"GuardSpec: `{json.dumps(result['guard'])}`",
        "",
        "| job | task | mode | k | seed | loss | steps | trips | reasons |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["jobs"]:
        reasons = "; ".join(f"step {t['step']}: {t['reason']}" for t in r["trips"]) or "-"
        if r["missing_metrics"]:
            reasons += f" (not recorded: {', '.join(r['missing_metrics'])})"
        lines.append(
            f"| {r['job_id']} | {r['task']} | {r['mode']} | {r['k']} | {r['seed']} | {r['loss']} | "
            f"{r['steps']} | {r['n_trips']} | {reasons.replace('|', '/')} |"
        )
    lines += ["", f"{result['jobs_with_trips']} of {len(result['jobs'])} jobs tripped; {result['total_trips']} trips."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.guard_calibration", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", action="append", required=True, help="ledger URL (SQLite or PostgreSQL); repeatable")
    ap.add_argument("--job", action="append", default=[], help="job id; repeatable (default: every job)")
    ap.add_argument("--guard", default="{}", help="GuardSpec fields as JSON (default: the defaults)")
    ap.add_argument("--out", type=Path, help="write the JSON here")
    ap.add_argument("--md", type=Path, help="write the markdown table here")
    ap.add_argument(
        "--migrate",
        action="store_true",
        help="upgrade an older ledger's schema to this checkout's first (it is read as it is otherwise)",
    )
    args = ap.parse_args(argv)
    cfg = GuardSpec.model_validate(json.loads(args.guard))
    result = calibrate(args.url, args.job, cfg, args.migrate)
    table = markdown(result)
    for path, text in ((args.out, json.dumps(result, indent=2, default=str)), (args.md, table)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
