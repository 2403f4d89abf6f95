"""The routes' dependencies, as `Annotated` types: a route names what it needs by its parameter's
type (`ledger: LedgerDep`, `actor: Actor`) and FastAPI provides it from the app's `ApiContext`.

The dependencies here are async and do no I/O, so resolving them never waits for a worker thread
(`/health` must answer while every thread is stuck on a dead ledger).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import redis
from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from broker.api.auth import TokenChecker, check_access
from broker.api.observe import HealthProbe, RequestMetrics
from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from broker.streams import JobStreams, is_cluster_url, plain_url
from shared.settings import AdminSettings, BrokerSettings

# Request-path Redis calls: fail fast (503) rather than hold a request thread through an outage.
REDIS_SOCKET_TIMEOUT_S = 0.5

# auto_error=False: `authorize` answers a missing token itself (401, or nothing when auth is off).
bearer = HTTPBearer(
    auto_error=False,
    description="A token from BROKER_TOKENS (read-write) or BROKER_READ_ONLY_TOKENS (GET only).",
)


def request_redis(url: str) -> redis.Redis | RedisCluster:
    """A Redis client for request paths: short socket timeouts and no retries, so an outage is
    a quick 503 rather than a request thread held for seconds (services use broker.streams.connect,
    which rides outages out). A cluster URL (`redis+cluster://`) gives redis-py's cluster client."""
    if is_cluster_url(url):
        return RedisCluster.from_url(
            plain_url(url),
            socket_timeout=REDIS_SOCKET_TIMEOUT_S,
            socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
    return redis.Redis.from_url(
        url,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
        socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=30,
    )


@dataclass
class ApiContext:
    """What one app's routes share (`app.state.api`)."""

    settings: BrokerSettings
    admin: AdminSettings
    ledger: Ledger
    redis: redis.Redis | RedisCluster
    checker: TokenChecker
    metrics: RequestMetrics
    health: HealthProbe = field(default_factory=HealthProbe)
    _celery: Any = field(default=None, init=False, repr=False)
    _agent_redis: Any = field(default=None, init=False, repr=False)

    def agent_redis(self) -> Any:
        """An asyncio Redis client for the agent routes (broker/api/routes/agents.py), built at the
        first agent call: they wait on Redis lists for minutes (a model turn), which the request
        client's 0.5 s socket timeout and the request threads are not for."""
        if self._agent_redis is None:
            from redis.asyncio import Redis
            from redis.asyncio.cluster import RedisCluster as AsyncCluster

            url, _ = resolve_redis_url(self.settings.redis_url)
            self._agent_redis = (
                AsyncCluster.from_url(plain_url(url), socket_timeout=None)
                if is_cluster_url(url)
                else Redis.from_url(url, socket_timeout=None, health_check_interval=30)
            )
        return self._agent_redis

    def celery(self) -> Any:
        """The Celery app that sends admin tasks, built at the first one: most API uses never
        need it, and Celery loads only then."""
        if self._celery is None:
            from broker.admin import make_celery

            self._celery = make_celery(self.admin)
        return self._celery

    def streams(self, job_id: str) -> JobStreams:
        return JobStreams(self.redis, job_id, prefix=self.settings.stream_prefix)


async def get_context(request: Request) -> ApiContext:
    return request.app.state.api  # type: ignore[no-any-return]


ContextDep = Annotated[ApiContext, Depends(get_context)]


async def get_ledger(ctx: ContextDep) -> Ledger:
    return ctx.ledger


async def job_streams(job_id: str, ctx: ContextDep) -> JobStreams:
    """The streams of the job the path names."""
    return ctx.streams(job_id)


LedgerDep = Annotated[Ledger, Depends(get_ledger)]
StreamsDep = Annotated[JobStreams, Depends(job_streams)]


async def authorize(
    request: Request,
    ctx: ContextDep,
    _creds: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],  # the scheme, for the OpenAPI
) -> str:
    """The caller as the audit log names it (never the token itself).

    The edge (`broker.api.auth.TokenGate`) has already refused a request without a valid token
    before its body was read; this repeats the check where the route is, and documents the scheme
    in the OpenAPI.

    Raises:
        HTTPException: 401 without a valid token, 403 when a read-only token asks to write.
    """
    actor, denied = check_access(ctx.checker, request.headers.get("authorization"), request.method, request.url.path)
    if denied is not None:
        raise denied
    return actor


# Routes that record who did something take `actor: Actor`; FastAPI runs `authorize` once per
# request however many times it is named (the job routers also depend on it as a whole).
Actor = Annotated[str, Security(authorize)]
