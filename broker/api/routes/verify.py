"""A job's ledger invariants."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter

from broker.api.crud import job_or_404
from broker.api.deps import LedgerDep
from broker.api.errors import error_responses
from broker.api.models import VerifyReport

router = APIRouter(tags=["verify"])


@router.get("/jobs/{job_id}/verify", response_model=VerifyReport, responses=error_responses(404, 422))
def verify_job(job_id: str, ledger: LedgerDep) -> VerifyReport:
    """Check the ledger's invariants for the job (broker.verify): every sample in one state,
    staleness = trainer version - generation version, nothing trained twice, step counts.
    `ok` is false when any check has violations; in-flight samples are information only."""
    job_or_404(ledger, job_id)
    from broker.verify import verify  # rich and the checks' queries load only when used

    res = verify(ledger, job_id)
    return VerifyReport.model_validate({"ok": res.ok, **dataclasses.asdict(res)})
