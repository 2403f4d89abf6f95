"""The job API's routes, assembled: the open ones (health, metrics, the status page) and the job
routers, every one of which authenticates."""

from __future__ import annotations

from fastapi import APIRouter, Security

from broker.api.deps import authorize
from broker.api.errors import error_responses
from broker.api.routes import (
    agents,
    changes,
    checkpoints,
    control,
    health,
    jobs,
    metrics,
    queue,
    samples,
    status,
    summary,
    tasks,
    verify,
)

# The role a job route needs follows from its HTTP method, so a router added here cannot forget
# either check.
job_router = APIRouter(dependencies=[Security(authorize)], responses=error_responses(401, 503))
for resource in (jobs, queue, control, checkpoints, verify, summary, changes, samples, tasks, agents):
    job_router.include_router(resource.router)

api_router = APIRouter()
api_router.include_router(health.router)
api_router.include_router(metrics.router)
api_router.include_router(job_router)
api_router.include_router(status.router)
