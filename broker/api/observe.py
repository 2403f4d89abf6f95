"""What the job API tells about itself: Prometheus metrics (request counts and latency by route
template, job gauges read from the ledger at scrape time) and the health probes of its Redis and
ledger."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import sqlalchemy.exc
from fastapi import Request, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.routing import Match

from broker.ledger import Ledger
from broker.ledger.rows import JobRow

log = logging.getLogger(__name__)

# /metrics: per-job gauges for at most BrokerSettings.metrics_max_jobs unfinished jobs, those a
# service works on first, then the newest submitted ones: a scrape stays small and fast however
# many jobs are submitted.
METRICS_JOB_STATES = (("running", "paused", "stopping"), ("queued",))
# /health answers within this long, whatever Redis and the ledger do.
HEALTH_TIMEOUT_S = 0.8


class JobCollector:
    """Job gauges read from the ledger at scrape time, for at most `max_jobs` unfinished jobs
    (METRICS_JOB_STATES), and `asyncrl_ledger_up` (0 when the ledger cannot be read: the scrape
    still answers)."""

    def __init__(self, ledger: Ledger, max_jobs: int) -> None:
        self.ledger = ledger
        self.max_jobs = max_jobs

    def describe(self) -> list[Metric]:
        # Without describe, registering would call collect and so query the ledger.
        return []

    def collect(self) -> Iterator[Metric]:
        step = GaugeMetricFamily("asyncrl_job_step", "Last completed trainer step.", labels=["job_id"])
        reward = GaugeMetricFamily("asyncrl_job_reward_mean", "reward/mean of the last train step.", labels=["job_id"])
        staleness = GaugeMetricFamily(
            "asyncrl_job_staleness_mean",
            "off_policy/mean of the last train step.",
            labels=["job_id"],
        )
        # A gauge: a status's count falls as samples move on (generated -> scored -> trained).
        samples = GaugeMetricFamily("asyncrl_samples", "Samples in the ledger by status.", labels=["job_id", "status"])
        tasks = GaugeMetricFamily(
            "asyncrl_admin_tasks", "Admin tasks (Celery) by kind and state.", labels=["kind", "state"]
        )
        up = GaugeMetricFamily("asyncrl_ledger_up", "1 when this scrape could read the ledger.")
        try:
            jobs: list[JobRow] = []
            for states in METRICS_JOB_STATES:
                if len(jobs) < self.max_jobs:
                    jobs += self.ledger.list_jobs(limit=self.max_jobs - len(jobs), states=states)
            for job in jobs:
                job_id = job["id"]
                last = self.ledger.last_train_step(job_id)
                step.add_metric([job_id], last["step"] if last else job["step"])
                metrics = (last["metrics"] or {}) if last else {}
                for family, key in ((reward, "reward/mean"), (staleness, "off_policy/mean")):
                    if isinstance(metrics.get(key), (int, float)):
                        family.add_metric([job_id], float(metrics[key]))
                for status, n in self.ledger.status_counts(job_id).items():
                    samples.add_metric([job_id, status], n)
            for (kind, state), n in self.ledger.admin_task_counts().items():
                tasks.add_metric([kind, state], n)
            up.add_metric([], 1)
        except sqlalchemy.exc.SQLAlchemyError as exc:
            log.warning("/metrics: the ledger cannot be read (%s); job gauges left out", type(exc).__name__)
            up.add_metric([], 0)
        yield from (step, reward, staleness, samples, tasks, up)


class RequestMetrics:
    """One app's metrics: its own registry (several apps in one process must not share series)."""

    def __init__(self, ledger: Ledger, max_jobs: int) -> None:
        self.registry = CollectorRegistry()
        self.requests_total = Counter(
            "asyncrl_http_requests", "Job API requests.", ["method", "route", "status"], registry=self.registry
        )
        self.request_seconds = Histogram(
            "asyncrl_http_request_duration_seconds",
            "Job API request latency.",
            ["method", "route"],
            registry=self.registry,
        )
        self.registry.register(JobCollector(ledger, max_jobs))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def observe(self, request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        """HTTP middleware: count the request and time it, under its route template."""
        start = time.perf_counter()
        status = 500  # if the handler raises
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            # The route template, not the path: job ids and 404 probes must not multiply series.
            # A request the edge refused never reached the router: match its route here.
            matched: Any = request.scope.get("route") or next(
                (r for r in request.app.router.routes if r.matches(request.scope)[0] is Match.FULL), None
            )
            route = getattr(matched, "path", "<unmatched>")
            self.requests_total.labels(request.method, route, str(status)).inc()
            self.request_seconds.labels(request.method, route).observe(time.perf_counter() - start)


class HealthProbe:
    """Checks of one app's dependencies, each in a thread of its own, one at most per dependency: a
    check stuck on a dead server (a black-holed PostgreSQL waits for the TCP timeout) is abandoned
    after HEALTH_TIMEOUT_S, and the next one reports it still waiting instead of piling up threads."""

    def __init__(self, names: tuple[str, ...] = ("redis", "ledger")) -> None:
        self.threads = anyio.CapacityLimiter(len(names))
        self.checking = {name: threading.Lock() for name in names}

    async def probe(self, what: str, call: Callable[[], Any], problems: list[str]) -> Any:
        """`call()`'s answer, or None with the reason appended to `problems`."""
        lock = self.checking[what]

        def check() -> Any:
            if not lock.acquire(blocking=False):
                raise RuntimeError("the previous check has not answered yet")
            try:
                return call()
            finally:
                lock.release()

        try:
            with anyio.fail_after(HEALTH_TIMEOUT_S):
                return await anyio.to_thread.run_sync(check, limiter=self.threads, abandon_on_cancel=True)
        except TimeoutError:
            problems.append(f"{what}: no answer within {HEALTH_TIMEOUT_S} s")
        except Exception as exc:  # any failure of the dependency is the answer, not a 500
            problems.append(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")
        return None

    async def check_all(self, calls: dict[str, Callable[[], Any]]) -> tuple[dict[str, Any], list[str]]:
        """Run the checks concurrently: (answer by name, None where it failed; the problems)."""
        problems: list[str] = []
        results: dict[str, Any] = {}

        async def run(what: str, call: Callable[[], Any]) -> None:
            results[what] = await self.probe(what, call, problems)

        async with anyio.create_task_group() as tg:
            for what, call in calls.items():
                tg.start_soon(run, what, call)
        return results, problems
