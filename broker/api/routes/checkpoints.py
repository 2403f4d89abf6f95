"""A job's checkpoints, and the admin tasks (Celery) that evaluate or export one."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Response
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.api.crud import job_or_404
from broker.api.deps import Actor, ContextDep, LedgerDep
from broker.api.errors import error_responses
from broker.api.models import AdminTask, CheckpointRecord
from broker.ledger.rows import AdminTaskRow, CheckpointRow
from shared.spectypes import PrintableStr, refuse_bad_text

router = APIRouter(tags=["checkpoints"])

Step = Annotated[int, PathParam(ge=0, le=2**62)]
TASK_RESPONSES = {
    **error_responses(403, 404, 422),
    200: {"model": AdminTask, "description": "The same task, submitted before (a retried request)."},
}


class ExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: PrintableStr | None = Field(
        None,
        min_length=1,
        max_length=500,
        description="Folder under the worker's ADMIN_EXPORT_DIR (relative, no '..', printable); "
        "default <job id>/step-NNNNNN.",
    )

    @model_validator(mode="before")
    @classmethod
    def _text_is_storable(cls, data: Any) -> Any:
        refuse_bad_text(cls.__name__, data)
        return data


@router.get("/jobs/{job_id}/checkpoints", response_model=list[CheckpointRecord], responses=error_responses(404, 422))
def checkpoints(job_id: str, ledger: LedgerDep) -> list[CheckpointRow]:
    """Committed HF-format checkpoints of the job (step, policy version, path)."""
    job_or_404(ledger, job_id)
    return ledger.checkpoints(job_id)


def submit_admin(
    ctx: ContextDep, actor: str, response: Response, job_id: str, step: int, kind: str, params: dict[str, Any]
) -> AdminTaskRow:
    """Record the task in the ledger, then enqueue it. The same request again while the first
    is queued, running or done answers that task (200) instead of starting another: client
    retries are safe. A failed task may be submitted again.

    Raises:
        HTTPException: 404, no such job or checkpoint; 503, the task queue is unreachable.
    """
    ledger = ctx.ledger
    job_or_404(ledger, job_id)
    if not any(c["step"] == step for c in ledger.checkpoints(job_id)):
        steps = [c["step"] for c in ledger.checkpoints(job_id)]
        raise HTTPException(
            404,
            f"job '{job_id}' has no checkpoint at step {step}; "
            f"GET /jobs/{job_id}/checkpoints lists them ({steps or 'none yet'})",
        )
    params = {"job_id": job_id, "step": step, **params}
    for t in ledger.admin_tasks(job_id, kind=kind):
        if t["params"] == params and t["state"] != "failed":
            response.status_code = 200
            return t
    from broker.admin import TASK_NAMES  # Celery loads only when used

    celery = ctx.celery()
    task_id = uuid.uuid4().hex
    ledger.create_admin_task(task_id, job_id, kind, params, actor)
    try:
        # A few quick retries, then answer: a request must not hang on a dead queue.
        celery.send_task(
            TASK_NAMES[kind],
            kwargs=params,
            task_id=task_id,
            queue=ctx.admin.queue,
            retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.5},
        )
    except Exception as exc:  # the broker is down: say so, and leave no task waiting forever
        ledger.finish_admin_task(task_id, error=f"could not enqueue: {exc}")
        raise HTTPException(
            503,
            f"the admin task queue is unreachable ({type(exc).__name__}); "
            "check ADMIN_CELERY_BROKER_URL / REDIS_URL and retry",
        ) from exc
    task = ledger.get_admin_task(task_id)
    assert task is not None
    return task


@router.post(
    "/jobs/{job_id}/checkpoints/{step}/evaluate", status_code=202, response_model=AdminTask, responses=TASK_RESPONSES
)
def evaluate_checkpoint(job_id: str, step: Step, ctx: ContextDep, actor: Actor, response: Response) -> AdminTaskRow:
    """Evaluate the checkpoint on the job's held-out set (greedy, the trainer's protocol) in
    the admin worker; the result lands in the ledger's evals (source `checkpoint`) and in
    GET /tasks/{task_id}."""
    return submit_admin(ctx, actor, response, job_id, step, "evaluate", {})


@router.post(
    "/jobs/{job_id}/checkpoints/{step}/export", status_code=202, response_model=AdminTask, responses=TASK_RESPONSES
)
def export_checkpoint(
    job_id: str, step: Step, ctx: ContextDep, actor: Actor, response: Response, body: ExportRequest | None = None
) -> AdminTaskRow:
    """Copy the checkpoint's HF-format files (no trainer state) to a folder under the worker's
    ADMIN_EXPORT_DIR, verified and renamed into place."""
    name = body.name if body is not None else None
    if name is not None:
        from broker.admin import export_destination

        try:
            export_destination(ctx.admin, job_id, step, name)
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
    return submit_admin(ctx, actor, response, job_id, step, "export", {"name": name})
