"""What the job routes do to the ledger and the streams, shared between routers."""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import HTTPException
from pydantic import ValidationError

from broker.ledger import Ledger
from broker.ledger.rows import JobRow
from broker.streams import CONTROL, JobStreams
from shared.ids import control_id
from shared.jobspec import JobSpec, format_validation_error
from shared.schema import Control

TERMINAL_STATES = frozenset({"finished", "stopped", "failed", "cancelled"})


def storable(spec: JobSpec) -> dict[str, Any]:
    """The spec as the ledger stores it (JSON), checked to validate again as read back.

    Raises:
        ValueError: the stored form would not validate (a spec no service could start).
    """
    stored = json.loads(json.dumps(spec.model_dump(mode="json"), allow_nan=False))
    try:
        JobSpec.model_validate(stored)
    except ValidationError as exc:
        summary = "; ".join(f"{f['field']}: {f['message']}" for f in format_validation_error(exc)[:5])
        raise ValueError(f"the spec would not validate as stored ({summary})") from None
    return stored


def job_or_404(ledger: Ledger, job_id: str) -> JobRow:
    """The job's ledger row.

    A call in the route rather than a dependency: FastAPI runs dependencies before it validates
    the route's own parameters, and an invalid request is a 422 whether or not the job exists.

    Raises:
        HTTPException: 404, no such job.
    """
    job = ledger.get_job(job_id)
    if job is None:
        raise HTTPException(404, f"no job '{job_id}'; GET /jobs lists the known ones")
    return job


def live_job(ledger: Ledger, job_id: str, action: str) -> JobRow:
    """The job's row, if it has not ended.

    Raises:
        HTTPException: 404, no such job; 409, the job is in a terminal state.
    """
    job = job_or_404(ledger, job_id)
    if job["state"] in TERMINAL_STATES:
        raise HTTPException(409, f"job '{job_id}' is already {job['state']}; cannot {action} it")
    return job


def send_control(
    ledger: Ledger, streams: JobStreams, job_id: str, actor: str, command: str, state: str | None, **extra: Any
) -> None:
    """Tell every service of the job (`streams`: its control stream), record who did it, move the
    job's state."""
    msg = Control(
        job_id=job_id, msg_id=control_id(command, uuid.uuid4().hex[:8]), policy_version=0, command=command, **extra
    )  # type: ignore[arg-type]
    streams.publish(CONTROL, msg)
    ledger.record_change(job_id, actor, {"command": command, **extra})
    if state is not None:
        ledger.set_job_state(job_id, state)
