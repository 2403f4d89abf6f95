"""What the job routes do to the ledger and the streams, shared between routers."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import HTTPException
from pydantic import ValidationError

from broker.ledger import Ledger
from broker.ledger.jobs import JobEdit
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


@contextmanager
def live_job(ledger: Ledger, job_id: str, action: str) -> Iterator[JobEdit]:
    """The job's row held for a change (`Ledger.edit_job`), if the job has not ended: the changes
    of one job (and the services' moves of its state) happen one at a time, so a state or spec
    decided from `edit.job` is never overwritten by a change that read the row before it, and a
    terminal state is never left.

    Raises:
        HTTPException: 404, no such job; 409, the job is in a terminal state.
    """
    with ledger.edit_job(job_id) as edit:
        if edit is None:
            raise HTTPException(404, f"no job '{job_id}'; GET /jobs lists the known ones")
        if edit.job["state"] in TERMINAL_STATES:
            raise HTTPException(409, f"job '{job_id}' is already {edit.job['state']}; cannot {action} it")
        yield edit


def send_control(edit: JobEdit, streams: JobStreams, actor: str, command: str, state: str | None, **extra: Any) -> None:
    """Within a held edit (`live_job`): record who did it, move the job's state, and tell every
    service of the job (`streams`: its control stream). The publish comes last, so a ledger error
    publishes nothing, and before the edit commits, so the control stream carries the job's
    changes in the order the ledger made them: the services, which fold the stream in order
    (broker.runtime.ControlWatcher), end where the ledger does. A publish that fails (Redis is
    down: 503) rolls the whole change back."""
    edit.record_change(actor, {"command": command, **extra})
    if state is not None:
        edit.set(state=state)
    msg = Control(
        job_id=edit.job["id"],
        msg_id=control_id(command, uuid.uuid4().hex[:8]),
        policy_version=0,
        command=command,
        **extra,
    )  # type: ignore[arg-type]
    streams.publish(CONTROL, msg)
