"""A job's samples, filtered and paged."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query

from broker.api.crud import job_or_404
from broker.api.deps import LedgerDep
from broker.api.errors import error_responses
from broker.api.models import SamplePage
from broker.ledger import SAMPLE_KINDS, SAMPLE_STATUSES

router = APIRouter(tags=["samples"])

# Bounded: the ledger's integers are 64-bit (an unbounded int was a 500, found by schemathesis).
Bound = Annotated[int | None, Query(ge=0, le=2**62)]


@router.get("/jobs/{job_id}/samples", response_model=SamplePage, responses=error_responses(404, 422))
def job_samples(
    job_id: str,
    ledger: LedgerDep,
    status: Annotated[str | None, Query(description=f"One of: {', '.join(SAMPLE_STATUSES)}.")] = None,
    kind: Annotated[str | None, Query(description=f"One of: {', '.join(SAMPLE_KINDS)}.")] = None,
    min_step: Annotated[
        int | None, Query(ge=0, le=2**62, description="Lowest trainer_version (the step that used the sample).")
    ] = None,
    max_step: Annotated[int | None, Query(ge=0, le=2**62, description="Highest trainer_version.")] = None,
    min_staleness: Bound = None,
    max_staleness: Bound = None,
    min_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    max_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
) -> SamplePage:
    """Browse a job's samples, oldest first. Bounds are inclusive; a bound on step, staleness
    or reward leaves out samples without that value yet. `total` counts every match."""
    job_or_404(ledger, job_id)
    for name, value, valid in (("status", status, SAMPLE_STATUSES), ("kind", kind, SAMPLE_KINDS)):
        if value is not None and value not in valid:
            raise HTTPException(422, f"unknown {name} '{value}'; valid: {', '.join(valid)}")
    filters: dict[str, Any] = {
        "status": status,
        "kind": kind,
        "min_trainer_version": min_step,
        "max_trainer_version": max_step,
        "min_staleness": min_staleness,
        "max_staleness": max_staleness,
        "min_reward": min_reward,
        "max_reward": max_reward,
    }
    rows = ledger.samples(job_id, **filters, limit=limit, offset=offset)
    return SamplePage.model_validate(
        {"total": ledger.count_samples(job_id, **filters), "limit": limit, "offset": offset, "items": rows}
    )
