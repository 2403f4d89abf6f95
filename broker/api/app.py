"""`create_app`: the job API from its settings, ledger and routers."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.routing import APIRoute

from broker.api.auth import TokenChecker, TokenGate, configured_tokens, needs_token
from broker.api.deps import ApiContext, authorize, request_redis
from broker.api.edge import EdgeGuard, install_access_log_filter
from broker.api.errors import error_responses, install_error_handlers
from broker.api.main import api_router
from broker.api.observe import RequestMetrics
from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from shared.settings import AdminSettings, BrokerSettings

log = logging.getLogger(__name__)


def create_app(
    settings: BrokerSettings | None = None,
    ledger: Ledger | None = None,
    admin: AdminSettings | None = None,
) -> FastAPI:
    """The job API app.

    Raises:
        ValueError, OSError: the token configuration is unusable (see `configured_tokens`).
    """
    settings = settings or BrokerSettings()
    admin = admin or AdminSettings()
    checker = TokenChecker(configured_tokens(settings))
    if not checker.enabled:
        log.warning(
            "job API is open: no bearer token configured (BROKER_TOKENS, BROKER_READ_ONLY_TOKENS, "
            "BROKER_TOKEN_FILE); anyone who can reach it can submit and stop jobs"
        )
    ledger = ledger or Ledger(settings.database_url)
    redis_url, _ = resolve_redis_url(settings.redis_url)
    # 400 and 413 come from the edge, for any route.
    app = FastAPI(title="asyncrl job API", version="0.1.0", responses=error_responses(400, 413))
    app.state.api = ctx = ApiContext(
        settings=settings,
        admin=admin,
        ledger=ledger,
        redis=request_redis(redis_url),
        checker=checker,
        metrics=RequestMetrics(ledger, settings.metrics_max_jobs),
    )
    install_access_log_filter()
    install_error_handlers(app)
    app.include_router(api_router)
    guarded = [r for r in app.routes if isinstance(r, APIRoute) and needs_token(r.dependant, authorize)]
    app.add_middleware(EdgeGuard, max_body_bytes=settings.max_body_bytes, gate=TokenGate(checker, guarded))
    # Added last, so outermost: it also counts the requests the edge refuses.
    app.middleware("http")(ctx.metrics.observe)
    return app
