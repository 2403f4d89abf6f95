"""The fleet and its queue: which jobs run, which wait and for what, and which services serve them."""

from __future__ import annotations

from fastapi import APIRouter

from broker.api.deps import ContextDep, LedgerDep
from broker.api.models import FleetView, QueueView
from broker.fleet import fleet_members, queue_view

router = APIRouter(tags=["queue"])


@router.get("/queue", response_model=QueueView)
def queue(ledger: LedgerDep, ctx: ContextDep) -> QueueView:
    """The running jobs (each with its share and the services serving it), and every queued job in
    the order the fleet takes them (priority, then first in, first out) with its position and what
    it waits for."""
    return QueueView.model_validate(queue_view(ledger, fleet_members(ctx.redis, ctx.settings.stream_prefix)))


@router.get("/fleet", response_model=FleetView)
def fleet(ctx: ContextDep) -> FleetView:
    """The fleet's live services: role, id, host, the jobs each serves (none: idle), since when, and
    its load per job (share, busy seconds, tokens)."""
    return FleetView.model_validate({"services": fleet_members(ctx.redis, ctx.settings.stream_prefix)})
