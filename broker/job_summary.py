"""A job's summary: what `asyncrl demo` and `asyncrl run` print when the job ends, and what
`GET /jobs/{id}/summary` answers (so a client of a remote fleet prints the same). No I/O but the
ledger's reads; the rendering is the client's (asyncrl/report.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from broker.guard_report import describe, guard_trips
from broker.ledger import Ledger
from broker.ledger.rows import TrainStepRow
from shared.drop_skew import summarize_job, warnings
from shared.jobspec import DropSkewSpec

# The per-step metrics the summary's table and plot use, as the trainer names them.
STEP_METRICS = ("reward/mean", "off_policy/mean", "off_policy/max", "off_policy/dropped")


def finite(value: Any) -> float | None:
    """A finite float, or None for a missing, non-numeric or non-finite metric (JSON has no NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _sum(steps: list[TrainStepRow], key: str) -> float:
    return sum(v for s in steps if (v := finite((s["metrics"] or {}).get(key))) is not None)


def drop_skew(steps: Sequence[TrainStepRow], spec: Mapping[str, Any] | None) -> dict[str, Any]:
    """What dropping skewed over the job's steps (shared/drop_skew.py), with the warnings its
    spec's `drop_skew` thresholds give (the defaults where the stored spec has none)."""
    try:
        limits = DropSkewSpec.model_validate((spec or {}).get("drop_skew") or {})
    except ValidationError:
        limits = DropSkewSpec()
    skew = summarize_job(s["metrics"] for s in steps)
    return skew.as_json(warnings(skew, limits.max_shift, limits.min_dropped))


def job_summary(ledger: Ledger, job_id: str) -> dict[str, Any]:
    """What the job did: reward per step, held-out rounds, staleness, samples by status, weight
    swap latency, steady-state throughput and the collapse guard's trips.

    Keys: `job_id`, `state`, `error`, `steps` (count), `per_step` (one dict per step: `step` and
    STEP_METRICS, None where missing or not finite), `reward_per_step`, `held_out` ([step,
    reward] of the first evaluation set), `eval_sets` (per set: step, reward, wall_s and the round's metrics),
    `staleness_histogram`, `sample_status`, `generators`, `swap_latency_s_median|max`, `samples_per_s`, `tokens_per_s`,
    `mean_step_s` (steady state: without the first step, which waits for the engines) and
    `guard_trips` (one line each).
    """
    job = ledger.get_job(job_id)
    steps = ledger.train_steps(job_id)
    evals = ledger.evals(job_id, source="pipeline")
    steady = steps[1:] or steps
    step_s = _sum(steady, "time/step_s")
    swaps = [dt for v, dt in ledger.swap_latencies(job_id).items() if v > 0]
    first_set = evals[0]["name"] if evals else None
    per_step = [{"step": s["step"], **{k: finite((s["metrics"] or {}).get(k)) for k in STEP_METRICS}} for s in steps]
    return {
        "job_id": job_id,
        "state": job["state"] if job else None,
        "error": job["error"] if job else None,
        "steps": len(steps),
        "per_step": per_step,
        "reward_per_step": [None if p["reward/mean"] is None else round(p["reward/mean"], 3) for p in per_step],
        "held_out": [(e["step"], round(e["reward_mean"], 3)) for e in evals if e["name"] == first_set],
        "eval_sets": {
            name: [
                {"step": e["step"], "reward": round(e["reward_mean"], 3), "wall_s": e["wall_s"], **(e["metrics"] or {})}
                for e in evals
                if e["name"] == name
            ]
            for name in dict.fromkeys(e["name"] for e in evals)
        },
        "staleness_histogram": ledger.staleness_histogram(job_id),
        "sample_status": ledger.status_counts(job_id),
        "generators": len({r["generator_id"] for r in ledger.generator_loads(job_id)}),
        "swap_latency_s_median": statistics.median(swaps) if swaps else None,
        "swap_latency_s_max": max(swaps) if swaps else None,
        "samples_per_s": _sum(steady, "samples") / step_s if step_s else 0.0,
        "tokens_per_s": _sum(steady, "tokens") / step_s if step_s else 0.0,
        "mean_step_s": step_s / len(steady) if steady else 0.0,
        "guard_trips": [describe(t) for t in guard_trips(ledger.job_changes(job_id))],
    }
