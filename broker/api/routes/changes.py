"""A job's audit log."""

from __future__ import annotations

from fastapi import APIRouter

from broker.api.crud import job_or_404
from broker.api.deps import LedgerDep
from broker.api.errors import error_responses
from broker.api.models import ChangeRecord
from broker.ledger.rows import JobChangeRow

router = APIRouter(tags=["changes"])


@router.get("/jobs/{job_id}/changes", response_model=list[ChangeRecord], responses=error_responses(404, 422))
def changes(job_id: str, ledger: LedgerDep) -> list[JobChangeRow]:
    """The audit log: who changed what, when, oldest first."""
    job_or_404(ledger, job_id)
    return ledger.job_changes(job_id)
