"""/health: whether Redis and the ledger answer, within a second either way."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from broker.api.deps import ContextDep

router = APIRouter(tags=["health"])


class HealthBody(BaseModel):
    ok: bool
    redis: bool = Field(..., description="Redis answered a PING.")
    ledger_revision: str | None = Field(..., description="The ledger's migration revision; null when it is down.")


class HealthProblem(HealthBody):
    error: str = Field(..., description="What is down.")


@router.get(
    "/health",
    response_model=HealthBody,
    responses={503: {"model": HealthProblem, "description": "Redis or the ledger is down."}},
)
async def health(ctx: ContextDep) -> JSONResponse:
    """Redis and the ledger answer: 200 `{"ok": true, ...}`, else 503 `{"ok": false, "error": ...}`,
    within a second either way."""
    results, problems = await ctx.health.check_all({"redis": ctx.redis.ping, "ledger": ctx.ledger.current_revision})
    ok = not problems
    body: dict[str, Any] = {"ok": ok, "redis": bool(results.get("redis")), "ledger_revision": results.get("ledger")}
    if not ok:
        body["error"] = "; ".join(problems)
    return JSONResponse(status_code=200 if ok else 503, content=body)
