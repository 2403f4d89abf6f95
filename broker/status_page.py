"""The status page: an HTML view of the jobs served by the job API at `/` and `/status`
(routes in broker.api.routes.status); this module holds its files and builds its data.

The page (`broker/static/`, no external assets: the machines are offline) polls the JSON API
every 2 s: `GET /queue` and `GET /fleet` (the running jobs, each queued job's place and what it
waits for, the fleet's services and what each serves: broker.fleet), `GET /jobs`, `GET /jobs/{id}`
and `GET /status/data/{id}` (the per-step series and the collapse guard's trips, which the page
shows above the charts).

Auth: the page and its assets are always open (they hold no data); every data request carries
the API's bearer token. Open `/status?token=<token>` once: the page keeps the token in the tab's
sessionStorage, drops it from the address bar, and sends it as `Authorization: Bearer`. The API's
access log shows it as `token=***` (broker.api.edge.AccessLogFilter), but a token in a URL can still
land in browser history and proxy logs; use a read-only token for the page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.guard_report import describe, guard_trips
from broker.job_summary import finite
from broker.ledger import Ledger

STATIC_DIR = Path(__file__).parent / "static"
# Only these files are served: a name from the URL never reaches the filesystem.
ASSETS = {
    "status.js": "text/javascript; charset=utf-8",
    "status.css": "text/css; charset=utf-8",
}
# The per-step metrics the page plots, as the trainer names them.
STEP_METRICS = (
    "reward/mean",
    "off_policy/mean",
    "off_policy/max",
    "throughput/samples_per_s",
    "time/step_s",
)


def step_series(ledger: Ledger, job_id: str) -> dict[str, Any]:
    """A job's plotted series: one row per train step (STEP_METRICS, null where absent), evals,
    and the collapse guard's trips (`guard_trips`: step, kind, one-line `text`) from the change log."""
    steps = [
        {
            "step": row["step"],
            "policy_version": row["policy_version"],
            **{k: finite((row["metrics"] or {}).get(k)) for k in STEP_METRICS},
        }
        for row in ledger.train_steps(job_id)
    ]
    evals = [
        {
            "step": e["step"],
            "reward_mean": finite(e["reward_mean"]),
            "n": e["n"],
            "policy_version_min": e["policy_version_min"],
            "policy_version_max": e["policy_version_max"],
            "source": e["source"],  # pipeline (the trainer's rounds) or checkpoint (admin worker)
            "name": e["name"],  # the evaluation set
            "wall_s": finite(e["wall_s"]) if e["wall_s"] is not None else None,
            "metrics": e["metrics"],
        }
        for e in ledger.evals(job_id)
    ]
    trips = [
        {"step": t.get("step"), "kind": t.get("kind"), "action": t.get("action"), "text": describe(t)}
        for t in guard_trips(ledger.job_changes(job_id))
    ]
    return {"job_id": job_id, "steps": steps, "evals": evals, "guard_trips": trips}
