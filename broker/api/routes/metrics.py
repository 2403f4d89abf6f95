"""/metrics: the Prometheus exposition."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from broker.api.deps import ContextDep

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"description": "Prometheus text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}
    },
)
def metrics(ctx: ContextDep) -> Response:
    """Prometheus exposition: request counts and latency, and gauges of the unfinished jobs."""
    return Response(ctx.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
