"""Live control of a job: stop, cancel, pause, resume, and PATCH its live knobs.

Each command goes to every service of the job on its control stream and into the audit log
(GET /jobs/{job_id}/changes).
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from broker.api.crud import live_job, send_control, storable
from broker.api.deps import Actor, LedgerDep, StreamsDep
from broker.api.errors import error_responses, errors_body
from broker.api.models import PatchedJob, StateChange
from shared.jobspec import JobPatch, JobSpec, format_validation_error

router = APIRouter(tags=["control"], responses=error_responses(403, 404, 409, 422))


@router.post("/jobs/{job_id}/stop", status_code=202, response_model=StateChange)
def stop(job_id: str, ledger: LedgerDep, streams: StreamsDep, actor: Actor) -> StateChange:
    """Drain: the trainer finishes its current step and the final evaluation, then every service
    of the job leaves it. A queued job is stopped at once: it never starts."""
    with live_job(ledger, job_id, "stop") as edit:
        if edit.job["state"] == "queued":
            edit.set(state="stopped")
            edit.record_change(actor, {"command": "stop"})
            return StateChange(id=job_id, state="stopped")
        send_control(edit, streams, actor, "stop", "stopping")
    return StateChange(id=job_id, state="stopping")


@router.post("/jobs/{job_id}/cancel", status_code=202, response_model=StateChange)
def cancel(job_id: str, ledger: LedgerDep, streams: StreamsDep, actor: Actor) -> StateChange:
    """Immediate: services leave the job without finishing the step or evaluating; a queued job
    never starts. Final: a later pause, resume or change is refused (409)."""
    with live_job(ledger, job_id, "cancel") as edit:
        send_control(edit, streams, actor, "cancel", "cancelled")
    return StateChange(id=job_id, state="cancelled")


@router.post("/jobs/{job_id}/pause", status_code=202, response_model=StateChange)
def pause(job_id: str, ledger: LedgerDep, streams: StreamsDep, actor: Actor) -> StateChange:
    """Generation, scoring and training stop taking new work; nothing in flight is lost."""
    with live_job(ledger, job_id, "pause") as edit:
        state = edit.job["state"]
        if state == "paused":
            raise HTTPException(409, f"job '{job_id}' is already paused; POST .../resume to continue")
        if state == "queued":
            raise HTTPException(
                409,
                f"job '{job_id}' is queued, not running; nothing to pause (POST .../cancel takes it out of the queue)",
            )
        if state == "stopping":
            raise HTTPException(409, f"job '{job_id}' is stopping: it ends after its current step; nothing to pause")
        send_control(edit, streams, actor, "pause", "paused")
    return StateChange(id=job_id, state="paused")


@router.post("/jobs/{job_id}/resume", status_code=202, response_model=StateChange)
def resume(job_id: str, ledger: LedgerDep, streams: StreamsDep, actor: Actor) -> StateChange:
    with live_job(ledger, job_id, "resume") as edit:
        if edit.job["state"] != "paused":
            raise HTTPException(409, f"job '{job_id}' is {edit.job['state']}, not paused; nothing to resume")
        send_control(edit, streams, actor, "resume", "running")
    return StateChange(id=job_id, state="running")


# exclude_unset: `changed` lists only the knobs given.
@router.patch("/jobs/{job_id}", response_model=PatchedJob, response_model_exclude_unset=True)
def patch(
    job_id: str, change: JobPatch, ledger: LedgerDep, streams: StreamsDep, actor: Actor
) -> PatchedJob | JSONResponse:
    """Change live knobs (lr, max_staleness, temperature, top_p, top_k, generation_batch); services
    apply them at their next step. The stored spec is updated so a restarted service keeps them.
    Concurrent changes apply one after the other, each to the spec the last one left, in the
    order the services receive them: the stored spec is what the services run."""
    changes = change.changes()
    if not changes:
        raise HTTPException(422, "nothing to change: give at least one of " + ", ".join(JobPatch.model_fields))
    with live_job(ledger, job_id, "change") as edit:
        if edit.job["state"] == "stopping":  # its services take no command but drain and cancel any more
            raise HTTPException(409, f"job '{job_id}' is stopping: it ends after its current step; nothing to change")
        try:
            spec = JobSpec.model_validate(change.apply(edit.job["spec"]))
        except ValidationError as exc:
            body = errors_body("the change makes the spec invalid", format_validation_error(exc))
            return JSONResponse(status_code=422, content=body)
        if "max_staleness" in changes and spec.mode == "sync":
            raise HTTPException(422, "max_staleness has no effect in sync mode (the bound is 0)")
        try:
            stored = storable(spec)
        except ValueError as exc:
            raise HTTPException(422, f"the change makes the spec invalid: {exc}") from None
        edit.set(spec=stored)
        send_control(edit, streams, actor, "set", None, settings=changes)
    # validated as the JSON was before: `changed` holds only the knobs given (exclude_unset)
    return PatchedJob.model_validate({"id": job_id, "changed": changes, "spec": stored})
