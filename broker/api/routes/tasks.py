"""Admin tasks: a job's, and one by id."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query

from broker.api.crud import job_or_404
from broker.api.deps import LedgerDep
from broker.api.errors import error_responses
from broker.api.models import AdminTask
from broker.ledger import ADMIN_TASK_KINDS
from broker.ledger.rows import AdminTaskRow

router = APIRouter(tags=["tasks"], responses=error_responses(404, 422))


@router.get("/jobs/{job_id}/tasks", response_model=list[AdminTask])
def job_tasks(
    job_id: str,
    ledger: LedgerDep,
    kind: Annotated[str | None, Query(description=f"One of: {', '.join(ADMIN_TASK_KINDS)}.")] = None,
) -> list[AdminTaskRow]:
    """The job's admin tasks, oldest first."""
    job_or_404(ledger, job_id)
    if kind is not None and kind not in ADMIN_TASK_KINDS:
        raise HTTPException(422, f"unknown kind '{kind}'; valid: {', '.join(ADMIN_TASK_KINDS)}")
    return ledger.admin_tasks(job_id, kind=kind)


@router.get("/tasks/{task_id}", response_model=AdminTask)
def task_status(task_id: str, ledger: LedgerDep) -> AdminTaskRow:
    """One admin task: queued, running, succeeded (with its result) or failed (with the error)."""
    task = ledger.get_admin_task(task_id)
    if task is None:
        raise HTTPException(404, f"no admin task '{task_id}'; GET /jobs/{{job_id}}/tasks lists a job's tasks")
    return task
