"""Jobs: submit, list, inspect."""

from __future__ import annotations

import logging
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query

from broker.api.crud import job_or_404, storable
from broker.api.deps import Actor, ContextDep, LedgerDep, StreamsDep
from broker.api.errors import error_responses
from broker.api.models import JobStatus, JobSummary, SubmittedJob
from broker.fleet import wake_fleet
from broker.job_summary import drop_skew
from broker.ledger.rows import JobRow
from shared.jobspec import JobSpec
from shared.logs import escape_control
from shared.rewards.base import failed_fraction

log = logging.getLogger(__name__)

router = APIRouter(tags=["jobs"])


# The ids the API gives out: 12 lowercase hex digits. A client may choose one of that form itself.
JOB_ID_PATTERN = r"^[0-9a-f]{12}$"


@router.post("/jobs", status_code=201, response_model=SubmittedJob, responses=error_responses(403, 409, 422))
def submit(
    spec: JobSpec,
    ledger: LedgerDep,
    ctx: ContextDep,
    actor: Actor,
    job_id: Annotated[
        str | None,
        Query(
            pattern=JOB_ID_PATTERN,
            description=(
                "The new job's id, chosen by the client (12 lowercase hex digits); default: a fresh random one. "
                "Lets a launcher start the job's services before the API is up, each told its JOB_ID."
            ),
        ),
    ] = None,
) -> SubmittedJob:
    """Queue a job; the fleet's trainer takes it when the jobs ahead of it (higher priority, or
    submitted earlier) are done (409 when `job_id` is taken). GET /queue shows its place."""
    try:
        stored = storable(spec)
    except ValueError as exc:
        raise HTTPException(422, f"invalid job spec: {exc}") from None
    job_id = job_id or uuid.uuid4().hex[:12]
    if not ledger.create_job(job_id, spec.name, stored):
        raise HTTPException(409, f"job '{job_id}' already exists; choose another id")
    log.info("job %s (%s) submitted by %s", job_id, escape_control(spec.name), actor)
    wake_fleet(ctx.redis, ctx.settings.stream_prefix)
    position = next((i for i, j in enumerate(ledger.queue(), start=1) if j["id"] == job_id), 0)
    return SubmittedJob.model_validate({"id": job_id, "state": "queued", "position": position, "spec": stored})


@router.get("/jobs", response_model=list[JobSummary], responses=error_responses(422))
def list_jobs(ledger: LedgerDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[JobRow]:
    """The newest `limit` jobs, newest first."""
    # Bounded: a limit past SQLite's 64-bit INTEGER was a 500; a negative one meant "all".
    return ledger.list_jobs(limit=limit)


# exclude_unset: a generator's `last_loaded_at` and `heartbeat` are absent until known.
@router.get(
    "/jobs/{job_id}", response_model=JobStatus, response_model_exclude_unset=True, responses=error_responses(404, 422)
)
def job_status(job_id: str, ledger: LedgerDep, streams: StreamsDep) -> JobStatus:
    """The job, its last metrics, evaluations, sample counts, staleness, reward errors, what
    dropping skewed, generators, and its usage (generator-seconds and tokens)."""
    job = job_or_404(ledger, job_id)
    steps = ledger.train_steps(job_id)
    generators: dict[str, dict[str, Any]] = {}
    for row in ledger.generator_loads(job_id):
        g = generators.setdefault(row["generator_id"], {"versions_loaded": []})
        g["versions_loaded"].append(row["version"])
        g["last_loaded_at"] = row["loaded_at"]
    for gid, hb in streams.heartbeats().items():
        generators.setdefault(gid, {"versions_loaded": []})["heartbeat"] = hb
    by_status = ledger.reward_status_counts(job_id)
    # validated from the dict: a generator's unknown keys stay unset (exclude_unset)
    return JobStatus.model_validate(
        {
            **{k: job[k] for k in ("id", "name", "state", "step", "error", "created_at", "started_at", "spec")},
            "last_metrics": steps[-1]["metrics"] if steps else None,
            "evals": ledger.evals(job_id),
            "samples": ledger.status_counts(job_id),
            "staleness": ledger.staleness_histogram(job_id),
            "reward_errors": {"by_status": by_status, "fraction": failed_fraction(by_status)},
            "drop_skew": drop_skew(steps, job["spec"]),
            "generators": generators,
            "usage": ledger.usage(job_id),
        }
    )
