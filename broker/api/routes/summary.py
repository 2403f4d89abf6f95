"""A job's summary: what the CLI prints when a job it follows ends (broker.job_summary)."""

from __future__ import annotations

from fastapi import APIRouter

from broker.api.crud import job_or_404
from broker.api.deps import LedgerDep
from broker.api.errors import error_responses
from broker.api.models import JobReport
from broker.job_summary import job_summary

router = APIRouter(tags=["jobs"])


@router.get("/jobs/{job_id}/summary", response_model=JobReport, responses=error_responses(404, 422))
def summary(job_id: str, ledger: LedgerDep) -> JobReport:
    """Reward per step, held-out rounds, staleness, samples by status, weight swap latency,
    steady-state throughput and the collapse guard's trips: `asyncrl run` prints it when the job
    ends, whichever fleet ran it."""
    job_or_404(ledger, job_id)
    return JobReport.model_validate(job_summary(ledger, job_id))
