"""The status page (`broker.status_page`): its HTML and assets, always open (they hold no data),
and its data feed, which needs a token like the /jobs routes."""

from __future__ import annotations

from functools import cache

from fastapi import APIRouter, HTTPException, Security
from fastapi.responses import FileResponse, HTMLResponse

from broker.api.crud import job_or_404
from broker.api.deps import LedgerDep, authorize
from broker.api.models import StatusData
from broker.status_page import ASSETS, STATIC_DIR, step_series

router = APIRouter(tags=["status page"])


@cache
def _page() -> str:
    return (STATIC_DIR / "status.html").read_text()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
@router.get("/status", response_class=HTMLResponse)
def status_page() -> HTMLResponse:
    """The status page (HTML); `?job=<id>` selects a job, `?token=<token>` authenticates."""
    return HTMLResponse(_page())


@router.get("/status/static/{name}", include_in_schema=False)
def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise HTTPException(404, f"no status page asset '{name}'")
    return FileResponse(STATIC_DIR / name, media_type=ASSETS[name])


# Out of the OpenAPI schema: the page's own feed, not part of the public /jobs API.
@router.get(
    "/status/data/{job_id}", response_model=StatusData, dependencies=[Security(authorize)], include_in_schema=False
)
def status_data(job_id: str, ledger: LedgerDep) -> StatusData:
    """Per-step series of a job: `steps` (STEP_METRICS by step), held-out `evals` and the
    collapse guard's trips."""
    job_or_404(ledger, job_id)
    return StatusData.model_validate(step_series(ledger, job_id))
