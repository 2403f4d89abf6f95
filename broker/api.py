"""The job API (FastAPI; OpenAPI at /docs): submit, list, inspect and stop jobs.

Errors are JSON objects with an `error` message that says what to do; an invalid job spec is a 422
listing each offending field.

Auth: every `/jobs` route needs `Authorization: Bearer <token>` once any token is configured
(`BROKER_TOKENS`, `BROKER_READ_ONLY_TOKENS`, `BROKER_TOKEN_FILE`); a read-only token may only
read (GET). With no token configured the API is open and says so in a start-up warning.
`/health` and `/metrics` (Prometheus) are always open.

The edge (broker.edge) checks the token, the URL and the body size before a byte of the body is
read: 401/403, 400 (a control character in the path or query), 413 (over BROKER_MAX_BODY_BYTES).
A 422 lists at most MAX_ERRORS_LISTED fields. Redis or the ledger unreachable is a 503, quickly:
request paths use a Redis client with short socket timeouts and no retries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import redis
import sqlalchemy.exc
from fastapi import APIRouter, FastAPI, HTTPException, Query, Request, Response, Security
from fastapi import Path as PathParam
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from redis.backoff import NoBackoff
from redis.retry import Retry
from starlette.routing import Match
from starlette.types import Scope

from broker.edge import EdgeGuard, Rejection, install_access_log_filter
from broker.ledger import ADMIN_TASK_KINDS, SAMPLE_KINDS, SAMPLE_STATUSES, Ledger
from broker.ledger.rows import AdminTaskRow, JobRow
from broker.redis_server import resolve_redis_url
from broker.status_page import status_router
from broker.streams import CONTROL, JobStreams
from shared.jobspec import JobPatch, JobSpec, format_validation_error
from shared.logs import escape_control
from shared.schema import Control
from shared.settings import AdminSettings, BrokerSettings
from shared.spectypes import PrintableStr, refuse_nul

log = logging.getLogger(__name__)

Role = Literal["rw", "ro"]
TERMINAL_STATES = frozenset({"finished", "stopped", "failed", "cancelled"})
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Module level: FastAPI resolves the dependency annotations below from this module's globals.
# auto_error=False: `authorize` answers a missing token itself (401, or nothing when auth is off).
bearer = HTTPBearer(
    auto_error=False,
    description="A token from BROKER_TOKENS (read-write) or BROKER_READ_ONLY_TOKENS (GET only).",
)
# /metrics: per-job gauges for at most BrokerSettings.metrics_max_jobs unfinished jobs, those a
# service works on first, then the newest submitted ones: a scrape stays small and fast however
# many jobs are submitted.
METRICS_JOB_STATES = (("running", "paused", "stopping"), ("submitted",))
# A 422 lists this many invalid fields, then counts the rest; each text is cut to these lengths.
MAX_ERRORS_LISTED = 20
MAX_FIELD_CHARS = 200
MAX_MESSAGE_CHARS = 500
# /health answers within this long, whatever Redis and the ledger do.
HEALTH_TIMEOUT_S = 0.8
# Request-path Redis calls: fail fast (503) rather than hold a request thread through an outage.
REDIS_SOCKET_TIMEOUT_S = 0.5


class ErrorBody(BaseModel):
    error: str = Field(..., description="What went wrong and what to do.")


class FieldError(BaseModel):
    field: str = Field(..., description="Dotted location of the field ('' for the body as a whole).")
    message: str


class ValidationErrorBody(ErrorBody):
    fields: list[FieldError] = Field(..., description=f"The first {MAX_ERRORS_LISTED} invalid fields.")
    more_errors: int = Field(0, description="Invalid fields not listed (present only when some are not).")


class HealthBody(BaseModel):
    ok: bool
    redis: bool
    ledger_revision: str | None
    error: str | None = Field(None, description="What is down (503 only).")


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers a route gives."""
    texts = {
        400: "A control character (NUL included) in the path or query.",
        401: "Missing or invalid bearer token.",
        403: "A read-only token asked to write.",
        404: "No such job, checkpoint or task.",
        409: "The job's state does not allow this.",
        413: "The request body is over BROKER_MAX_BODY_BYTES.",
        422: "Invalid input; `fields` names each offending field.",
        503: "Redis, the ledger or the admin task queue is unreachable; retry later.",
    }
    return {c: {"model": ValidationErrorBody if c == 422 else ErrorBody, "description": texts[c]} for c in codes}


def request_redis(url: str) -> redis.Redis:
    """A Redis client for request paths: short socket timeouts and no retries, so an outage is
    a quick 503 rather than a request thread held for seconds (services use broker.streams.connect,
    which rides outages out)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
        socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=30,
    )


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


def _errors_body(what: str, fields: list[dict]) -> dict[str, Any]:
    """A 422 body: at most MAX_ERRORS_LISTED fields, each text cut short, and the rest counted."""
    listed = [{"field": f["field"][:MAX_FIELD_CHARS], "message": f["message"][:MAX_MESSAGE_CHARS]}
              for f in fields[:MAX_ERRORS_LISTED]]
    summary = "; ".join(f"{f['field'] or 'body'}: {f['message']}" for f in listed)
    body: dict[str, Any] = {"error": f"{what}: {summary}", "fields": listed}
    if len(fields) > len(listed):
        body["more_errors"] = len(fields) - len(listed)
        body["error"] += f"; and {body['more_errors']} more"
    return body


def _needs_token(dependant: Dependant, authorize: Callable[..., Any]) -> bool:
    return dependant.call is authorize or any(_needs_token(d, authorize) for d in dependant.dependencies)


def load_token_file(path: Path) -> list[tuple[str, Role]]:
    """Parse a token file: one `TOKEN` (read-write) or `TOKEN ro` (read-only) per line.

    Blank lines and `#` comments (whole-line, or after the token) are skipped; `TOKEN rw` is also
    accepted. Errors name the line but never echo a token.

    Raises:
        OSError: the file cannot be read.
        ValueError: a line is neither `TOKEN` nor `TOKEN ro`.
    """
    entries: list[tuple[str, Role]] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        fields = line.split()
        for i, f in enumerate(fields):
            if f.startswith("#"):
                del fields[i:]
                break
        if not fields:
            continue
        if len(fields) == 1:
            entries.append((fields[0], "rw"))
        elif len(fields) == 2 and fields[1] in ("ro", "rw"):
            entries.append((fields[0], "ro" if fields[1] == "ro" else "rw"))
        elif len(fields) == 2:  # the second word is not echoed: it may be a mistyped token
            raise ValueError(f"{path}:{n}: the word after the token must be `ro` or nothing")
        else:
            raise ValueError(
                f"{path}:{n}: expected `TOKEN` (read-write) or `TOKEN ro` (read-only), "
                f"got {len(fields)} words"
            )
    return entries


def configured_tokens(settings: BrokerSettings) -> dict[str, Role]:
    """Every configured token and its role, from the settings and the token file.

    Raises:
        ValueError: the token file names no token, or a token is given both roles.
    """
    entries: list[tuple[str, Role]] = [(t, "rw") for t in settings.tokens]
    entries += [(t, "ro") for t in settings.read_only_tokens]
    if settings.token_file is not None:
        from_file = load_token_file(settings.token_file)
        if not from_file:
            # An empty file must not silently leave the API open.
            raise ValueError(
                f"token file {settings.token_file} has no token; add one or unset BROKER_TOKEN_FILE"
            )
        entries += from_file
    tokens: dict[str, Role] = {}
    for token, role in entries:
        if tokens.setdefault(token, role) != role:
            raise ValueError(
                "a token is configured both read-write and read-only; give each token one role"
            )
    return tokens


class TokenChecker:
    """Constant-time lookup of a presented bearer token's role."""

    def __init__(self, tokens: dict[str, Role]) -> None:
        # Comparing SHA-256 digests keeps every comparison the same length, so timing reveals
        # neither a configured token's length nor a prefix; bytes also accept any header text.
        self._digests = [(hashlib.sha256(t.encode()).digest(), role) for t, role in tokens.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def role(self, presented: str) -> Role | None:
        """The presented token's role, or None when it matches no configured token."""
        digest = hashlib.sha256(presented.encode()).digest()
        found: Role | None = None
        for expected, role in self._digests:  # no early exit: every token is compared
            if hmac.compare_digest(digest, expected):
                found = role
        return found


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
        step = GaugeMetricFamily(
            "asyncrl_job_step", "Last completed trainer step.", labels=["job_id"]
        )
        reward = GaugeMetricFamily(
            "asyncrl_job_reward_mean", "reward/mean of the last train step.", labels=["job_id"]
        )
        staleness = GaugeMetricFamily(
            "asyncrl_job_staleness_mean",
            "off_policy/mean of the last train step.",
            labels=["job_id"],
        )
        # A gauge: a status's count falls as samples move on (generated -> scored -> trained).
        samples = GaugeMetricFamily(
            "asyncrl_samples", "Samples in the ledger by status.", labels=["job_id", "status"]
        )
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


def _task_view(task: AdminTaskRow | None) -> dict[str, Any]:
    """An admin task as the API shows it (JSON-ready)."""
    assert task is not None
    out: dict[str, Any] = dict(task)
    for key in ("created_at", "started_at", "finished_at"):
        if out.get(key) is not None:
            out[key] = out[key].isoformat()
    return out


class ExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: PrintableStr | None = Field(
        None,
        min_length=1,
        max_length=500,
        description="Folder under the worker's ADMIN_EXPORT_DIR (relative, no '..', printable); "
        "default <job id>/step-NNNNNN.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: Any) -> Any:
        refuse_nul(cls.__name__, data)
        return data


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
    celery_app: Any = None  # built at the first admin task: most API uses never need it
    checker = TokenChecker(configured_tokens(settings))
    if not checker.enabled:
        log.warning(
            "job API is open: no bearer token configured (BROKER_TOKENS, BROKER_READ_ONLY_TOKENS, "
            "BROKER_TOKEN_FILE); anyone who can reach it can submit and stop jobs"
        )
    ledger = ledger or Ledger(settings.database_url)
    redis_url, _ = resolve_redis_url(settings.redis_url)
    redis_client = request_redis(redis_url)
    # 400 and 413 come from the edge, for any route.
    app = FastAPI(title="asyncrl job API", version="0.1.0", responses=_responses(400, 413))
    install_access_log_filter()

    def access(authorization: str | None, method: str, path: str) -> tuple[str, HTTPException | None]:
        """(the caller as the audit log names it, the 401/403 to answer or None)."""
        if not checker.enabled:
            return "anonymous", None
        scheme, token = get_authorization_scheme_param(authorization)
        if not authorization or scheme.lower() != "bearer" or not token:
            return "anonymous", HTTPException(
                401,
                "missing bearer token; send `Authorization: Bearer <token>`",
                headers={"WWW-Authenticate": "Bearer"},
            )
        role = checker.role(token)
        if role is None:
            return "anonymous", HTTPException(
                401,
                "invalid bearer token",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )
        actor = f"{role} token {hashlib.sha256(token.encode()).hexdigest()[:8]}"
        if role == "ro" and method not in READ_METHODS:
            return actor, HTTPException(
                403,
                f"this token is read-only; {method} {escape_control(path)} needs a read-write token",
                headers={"WWW-Authenticate": 'Bearer error="insufficient_scope"'},
            )
        return actor, None

    async def authorize(
        request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]
    ) -> None:
        """Raise 401 without a valid token, 403 when a read-only token asks to write. Leaves
        `request.state.actor` naming the caller for the audit log (never the token itself).
        The edge (`gate`) has already refused such a request before its body was read; this
        repeats the check where the route is, and documents the scheme in the OpenAPI."""
        actor, denied = access(request.headers.get("authorization"), request.method, request.url.path)
        request.state.actor = actor
        if denied is not None:
            raise denied

    guarded: list[APIRoute] = []  # the routes that depend on `authorize`, filled in at the end

    def gate(scope: Scope) -> Rejection | None:
        """The edge's token check, for a request to a guarded route."""
        if not checker.enabled or not any(r.matches(scope)[0] is Match.FULL for r in guarded):
            return None
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        _, denied = access(auth, scope["method"], scope["path"])
        return None if denied is None else (denied.status_code, str(denied.detail), dict(denied.headers or {}))

    app.add_middleware(EdgeGuard, max_body_bytes=settings.max_body_bytes, gate=gate)

    # Every job route authenticates; the role needed follows from the HTTP method, so a route added
    # here later cannot forget either check.
    jobs = APIRouter(dependencies=[Security(authorize)], responses=_responses(401, 503))

    registry = CollectorRegistry()  # per app: several apps in one process must not share series
    requests_total = Counter(
        "asyncrl_http_requests",
        "Job API requests.",
        ["method", "route", "status"],
        registry=registry,
    )
    request_seconds = Histogram(
        "asyncrl_http_request_duration_seconds",
        "Job API request latency.",
        ["method", "route"],
        registry=registry,
    )
    registry.register(JobCollector(ledger, settings.metrics_max_jobs))

    @app.middleware("http")
    async def _observe(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        start = time.perf_counter()
        status = 500  # if the handler raises
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            # The route template, not the path: job ids and 404 probes must not multiply series.
            # A request the edge refused never reached the router: match its route here.
            matched = request.scope.get("route") or next(
                (r for r in app.router.routes if r.matches(request.scope)[0] is Match.FULL), None)
            route = getattr(matched, "path", "<unmatched>")
            requests_total.labels(request.method, route, str(status)).inc()
            request_seconds.labels(request.method, route).observe(time.perf_counter() - start)

    def streams(job_id: str) -> JobStreams:
        return JobStreams(redis_client, job_id, prefix=settings.stream_prefix)

    def job_or_404(job_id: str) -> JobRow:
        job = ledger.get_job(job_id)
        if job is None:
            raise HTTPException(404, f"no job '{job_id}'; GET /jobs lists the known ones")
        return job

    @app.exception_handler(RequestValidationError)
    async def _invalid(req: Request, exc: RequestValidationError) -> JSONResponse:
        fields = format_validation_error(exc)
        in_body = any(e.get("loc", ("",))[0] == "body" for e in exc.errors())
        what = ("invalid job spec" if req.url.path == "/jobs" else "invalid request body") if in_body else "invalid request"
        return JSONResponse(status_code=422, content=_errors_body(what, fields))

    @app.exception_handler(redis.exceptions.ConnectionError)
    @app.exception_handler(redis.exceptions.TimeoutError)
    async def _redis_down(_req: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=503, content={
            "error": f"Redis is unreachable ({type(exc).__name__}); retry later"})

    @app.exception_handler(sqlalchemy.exc.OperationalError)
    @app.exception_handler(sqlalchemy.exc.InterfaceError)
    @app.exception_handler(sqlalchemy.exc.TimeoutError)
    async def _ledger_down(_req: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=503, content={
            "error": f"the ledger database is unreachable or busy ({type(exc).__name__}); retry later"})

    @app.exception_handler(sqlalchemy.exc.DataError)
    async def _unstorable(_req: Request, exc: Exception) -> JSONResponse:
        # The edge and the models refuse what the ledger cannot store; this is the backstop.
        return JSONResponse(status_code=422, content={
            "error": "a value in the request cannot be stored in the ledger", "fields": []})

    @app.exception_handler(HTTPException)
    async def _http(_req: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(
            status_code=exc.status_code, content={"error": exc.detail}, headers=exc.headers
        )

    # Health checks run in threads of their own, one at most per dependency: a check stuck on a
    # dead server (a black-holed PostgreSQL waits for the TCP timeout) is abandoned after
    # HEALTH_TIMEOUT_S, and the next one reports it still waiting instead of piling up threads.
    health_threads = anyio.CapacityLimiter(2)
    checking = {"redis": threading.Lock(), "ledger": threading.Lock()}

    async def _probe(what: str, call: Callable[[], Any], problems: list[str]) -> Any:
        def check() -> Any:
            if not checking[what].acquire(blocking=False):
                raise RuntimeError("the previous check has not answered yet")
            try:
                return call()
            finally:
                checking[what].release()

        try:
            with anyio.fail_after(HEALTH_TIMEOUT_S):
                return await anyio.to_thread.run_sync(check, limiter=health_threads, abandon_on_cancel=True)
        except TimeoutError:
            problems.append(f"{what}: no answer within {HEALTH_TIMEOUT_S} s")
        except Exception as exc:  # any failure of the dependency is the answer, not a 500
            problems.append(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")
        return None

    @app.get("/health", response_model=HealthBody, responses={503: {"model": HealthBody, "description": "Redis or the ledger is down."}})
    async def health() -> JSONResponse:
        """Redis and the ledger answer: 200 `{"ok": true, ...}`, else 503 `{"ok": false, "error": ...}`,
        within a second either way."""
        problems: list[str] = []
        results: dict[str, Any] = {}

        async def run(what: str, call: Callable[[], Any]) -> None:
            results[what] = await _probe(what, call, problems)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "redis", redis_client.ping)
            tg.start_soon(run, "ledger", ledger.current_revision)
        ok = not problems
        body: dict[str, Any] = {"ok": ok, "redis": bool(results.get("redis")), "ledger_revision": results.get("ledger")}
        if not ok:
            body["error"] = "; ".join(problems)
        return JSONResponse(status_code=200 if ok else 503, content=body)

    @app.get("/metrics", response_class=Response)
    def metrics() -> Response:
        """Prometheus exposition: request counts and latency, and gauges of the unfinished jobs."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @jobs.post("/jobs", status_code=201, responses=_responses(403, 422))
    def submit(spec: JobSpec, request: Request) -> dict[str, Any]:
        try:
            stored = storable(spec)
        except ValueError as exc:
            raise HTTPException(422, f"invalid job spec: {exc}") from None
        job_id = uuid.uuid4().hex[:12]
        ledger.create_job(job_id, spec.name, stored)
        log.info("job %s (%s) submitted by %s", job_id, escape_control(spec.name), request.state.actor)
        return {"id": job_id, "state": "submitted", "spec": stored}

    @jobs.get("/jobs", responses=_responses(422))
    def list_jobs(limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[dict[str, Any]]:
        # Bounded: a limit past SQLite's 64-bit INTEGER was a 500; a negative one meant "all".
        return [
            {k: j[k] for k in ("id", "name", "state", "step", "created_at", "updated_at")}
            for j in ledger.list_jobs(limit=limit)
        ]

    @jobs.get("/jobs/{job_id}", responses=_responses(404, 422))
    def job_status(job_id: str) -> dict[str, Any]:
        job = job_or_404(job_id)
        steps = ledger.train_steps(job_id)
        loads = ledger.generator_loads(job_id)
        generators: dict[str, dict[str, Any]] = {}
        for row in loads:
            g = generators.setdefault(row["generator_id"], {"versions_loaded": []})
            g["versions_loaded"].append(row["version"])
            g["last_loaded_at"] = row["loaded_at"]
        for gid, hb in streams(job_id).heartbeats().items():
            generators.setdefault(gid, {"versions_loaded": []})["heartbeat"] = hb
        return {
            "id": job["id"],
            "name": job["name"],
            "state": job["state"],
            "step": job["step"],
            "error": job["error"],
            "created_at": job["created_at"],
            # when a trainer first started it: each eval's wall_s counts from here
            "started_at": job["started_at"],
            "spec": job["spec"],
            "last_metrics": steps[-1]["metrics"] if steps else None,
            "evals": ledger.evals(job_id),
            "samples": ledger.status_counts(job_id),
            "staleness": ledger.staleness_histogram(job_id),
            "generators": generators,
        }

    def control(request: Request, job_id: str, command: str, state: str | None, **extra: Any) -> None:
        """Tell every service of the job (control stream), record who did it, move the job's state."""
        msg = Control(job_id=job_id, msg_id=f"{command}-{uuid.uuid4().hex[:8]}", policy_version=0,
                      command=command, **extra)  # type: ignore[arg-type]
        streams(job_id).publish(CONTROL, msg)
        ledger.record_change(job_id, request.state.actor, {"command": command, **extra})
        if state is not None:
            ledger.set_job_state(job_id, state)

    def live_job(job_id: str, action: str) -> JobRow:
        job = job_or_404(job_id)
        if job["state"] in TERMINAL_STATES:
            raise HTTPException(409, f"job '{job_id}' is already {job['state']}; cannot {action} it")
        return job

    @jobs.post("/jobs/{job_id}/stop", status_code=202, responses=_responses(403, 404, 409, 422))
    def stop(job_id: str, request: Request) -> dict[str, Any]:
        """Drain: the trainer finishes its current step, then every service of the job exits."""
        live_job(job_id, "stop")
        control(request, job_id, "stop", "stopping")
        return {"id": job_id, "state": "stopping"}

    @jobs.post("/jobs/{job_id}/cancel", status_code=202, responses=_responses(403, 404, 409, 422))
    def cancel(job_id: str, request: Request) -> dict[str, Any]:
        """Immediate: services exit without finishing the step or evaluating."""
        live_job(job_id, "cancel")
        control(request, job_id, "cancel", "cancelled")
        return {"id": job_id, "state": "cancelled"}

    @jobs.post("/jobs/{job_id}/pause", status_code=202, responses=_responses(403, 404, 409, 422))
    def pause(job_id: str, request: Request) -> dict[str, Any]:
        """Generation, scoring and training stop taking new work; nothing in flight is lost."""
        job = live_job(job_id, "pause")
        if job["state"] == "paused":
            raise HTTPException(409, f"job '{job_id}' is already paused; POST .../resume to continue")
        control(request, job_id, "pause", "paused")
        return {"id": job_id, "state": "paused"}

    @jobs.post("/jobs/{job_id}/resume", status_code=202, responses=_responses(403, 404, 409, 422))
    def resume(job_id: str, request: Request) -> dict[str, Any]:
        job = live_job(job_id, "resume")
        if job["state"] != "paused":
            raise HTTPException(409, f"job '{job_id}' is {job['state']}, not paused; nothing to resume")
        control(request, job_id, "resume", "running")
        return {"id": job_id, "state": "running"}

    @jobs.patch("/jobs/{job_id}", responses=_responses(403, 404, 409, 422))
    def patch(job_id: str, change: JobPatch, request: Request) -> dict[str, Any]:
        """Change live knobs (lr, max_staleness, temperature, top_p, generation_batch); services
        apply them at their next step. The stored spec is updated so a restarted service keeps them."""
        job = live_job(job_id, "change")
        changes = change.changes()
        if not changes:
            raise HTTPException(422, "nothing to change: give at least one of " + ", ".join(JobPatch.model_fields))
        try:
            spec = JobSpec.model_validate(change.apply(job["spec"]))
        except ValidationError as exc:
            body = _errors_body("the change makes the spec invalid", format_validation_error(exc))
            return JSONResponse(status_code=422, content=body)  # type: ignore[return-value]
        if "max_staleness" in changes and spec.mode == "sync":
            raise HTTPException(422, "max_staleness has no effect in sync mode (the bound is 0)")
        try:
            stored = storable(spec)
        except ValueError as exc:
            raise HTTPException(422, f"the change makes the spec invalid: {exc}") from None
        ledger.update_spec(job_id, stored)
        control(request, job_id, "set", None, settings=changes)
        return {"id": job_id, "changed": changes, "spec": stored}

    @jobs.get("/jobs/{job_id}/checkpoints", responses=_responses(404, 422))
    def checkpoints(job_id: str) -> list[dict[str, Any]]:
        """Committed HF-format checkpoints of the job (step, policy version, path)."""
        job_or_404(job_id)
        return [dict(c) for c in ledger.checkpoints(job_id)]

    @jobs.get("/jobs/{job_id}/verify", responses=_responses(404, 422))
    def verify_job(job_id: str) -> dict[str, Any]:
        """Check the ledger's invariants for the job (broker.verify): every sample in one state,
        staleness = trainer version - generation version, nothing trained twice, step counts.
        `ok` is false when any check has violations; in-flight samples are information only."""
        job_or_404(job_id)
        from broker.verify import verify

        res = verify(ledger, job_id)
        return {"ok": res.ok, **dataclasses.asdict(res)}

    @jobs.get("/jobs/{job_id}/changes", responses=_responses(404, 422))
    def changes(job_id: str) -> list[dict[str, Any]]:
        """The audit log: who changed what, when."""
        job_or_404(job_id)
        return [dict(c) for c in ledger.job_changes(job_id)]

    @jobs.get("/jobs/{job_id}/samples", responses=_responses(404, 422))
    def job_samples(
        job_id: str,
        status: Annotated[str | None, Query(description=f"One of: {', '.join(SAMPLE_STATUSES)}.")] = None,
        kind: Annotated[str | None, Query(description=f"One of: {', '.join(SAMPLE_KINDS)}.")] = None,
        # bounded: the ledger's integers are 64-bit (an unbounded int was a 500, found by schemathesis)
        min_step: Annotated[int | None, Query(ge=0, le=2**62, description="Lowest trainer_version (the step that used the sample).")] = None,
        max_step: Annotated[int | None, Query(ge=0, le=2**62, description="Highest trainer_version.")] = None,
        min_staleness: Annotated[int | None, Query(ge=0, le=2**62)] = None,
        max_staleness: Annotated[int | None, Query(ge=0, le=2**62)] = None,
        min_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
        max_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
    ) -> dict[str, Any]:
        """Browse a job's samples, oldest first. Bounds are inclusive; a bound on step, staleness
        or reward leaves out samples without that value yet. `total` counts every match."""
        job_or_404(job_id)
        fields = ("msg_id", "group_id", "sample_index", "kind", "prompt_index", "generator_id",
                  "gen_version_min", "gen_version_max", "trainer_version", "staleness", "reward",
                  "status", "completion", "num_completion_tokens", "created_at")
        for name, value, valid in (("status", status, SAMPLE_STATUSES), ("kind", kind, SAMPLE_KINDS)):
            if value is not None and value not in valid:
                raise HTTPException(422, f"unknown {name} '{value}'; valid: {', '.join(valid)}")
        filters: dict[str, Any] = {
            "status": status,
            "kind": kind,
            "min_trainer_version": min_step,
            "max_trainer_version": max_step,
            "min_staleness": min_staleness,
            "max_staleness": max_staleness,
            "min_reward": min_reward,
            "max_reward": max_reward,
        }
        rows: list[dict[str, Any]] = [dict(r) for r in ledger.samples(job_id, **filters, limit=limit, offset=offset)]
        return {
            "total": ledger.count_samples(job_id, **filters),
            "limit": limit,
            "offset": offset,
            "items": [{k: row[k] for k in fields} for row in rows],
        }

    # -- admin tasks (Celery): evaluate or export a checkpoint --------------------------------

    def submit_admin(request: Request, job_id: str, step: int, kind: str, params: dict[str, Any]) -> JSONResponse:
        """Record the task in the ledger, then enqueue it. The same request again while the first
        is queued, running or done answers that task (200) instead of starting another: client
        retries are safe. A failed task may be submitted again."""
        nonlocal celery_app
        job_or_404(job_id)
        if not any(c["step"] == step for c in ledger.checkpoints(job_id)):
            steps = [c["step"] for c in ledger.checkpoints(job_id)]
            raise HTTPException(404, f"job '{job_id}' has no checkpoint at step {step}; "
                                     f"GET /jobs/{job_id}/checkpoints lists them ({steps or 'none yet'})")
        params = {"job_id": job_id, "step": step, **params}
        for t in ledger.admin_tasks(job_id, kind=kind):
            if t["params"] == params and t["state"] != "failed":
                return JSONResponse(status_code=200, content=_task_view(t))
        from broker.admin import TASK_NAMES, make_celery  # Celery loads only when used

        if celery_app is None:
            celery_app = make_celery(admin)
        task_id = uuid.uuid4().hex
        ledger.create_admin_task(task_id, job_id, kind, params, request.state.actor)
        try:
            # A few quick retries, then answer: a request must not hang on a dead queue.
            celery_app.send_task(TASK_NAMES[kind], kwargs=params, task_id=task_id, queue=admin.queue,
                                 retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.5})
        except Exception as exc:  # the broker is down: say so, and leave no task waiting forever
            ledger.finish_admin_task(task_id, error=f"could not enqueue: {exc}")
            raise HTTPException(503, f"the admin task queue is unreachable ({type(exc).__name__}); "
                                     "check ADMIN_CELERY_BROKER_URL / REDIS_URL and retry") from exc
        return JSONResponse(status_code=202, content=_task_view(ledger.get_admin_task(task_id)))

    @jobs.post("/jobs/{job_id}/checkpoints/{step}/evaluate", status_code=202,
               responses={**_responses(403, 404, 422), 200: {"description": "The same task, submitted before (a retried request)."}})
    def evaluate_checkpoint(job_id: str, step: Annotated[int, PathParam(ge=0, le=2**62)], request: Request) -> JSONResponse:
        """Evaluate the checkpoint on the job's held-out set (greedy, the trainer's protocol) in
        the admin worker; the result lands in the ledger's evals (source `checkpoint`) and in
        GET /tasks/{task_id}."""
        return submit_admin(request, job_id, step, "evaluate", {})

    @jobs.post("/jobs/{job_id}/checkpoints/{step}/export", status_code=202,
               responses={**_responses(403, 404, 422), 200: {"description": "The same task, submitted before (a retried request)."}})
    def export_checkpoint(
        job_id: str, step: Annotated[int, PathParam(ge=0, le=2**62)], request: Request, body: ExportRequest | None = None
    ) -> JSONResponse:
        """Copy the checkpoint's HF-format files (no trainer state) to a folder under the worker's
        ADMIN_EXPORT_DIR, verified and renamed into place."""
        name = body.name if body is not None else None
        if name is not None:
            from broker.admin import export_destination

            try:
                export_destination(admin, job_id, step, name)
            except ValueError as exc:
                raise HTTPException(422, str(exc)) from None
        return submit_admin(request, job_id, step, "export", {"name": name})

    @jobs.get("/jobs/{job_id}/tasks", responses=_responses(404, 422))
    def job_tasks(
        job_id: str,
        kind: Annotated[str | None, Query(description=f"One of: {', '.join(ADMIN_TASK_KINDS)}.")] = None,
    ) -> list[dict[str, Any]]:
        """The job's admin tasks, oldest first."""
        job_or_404(job_id)
        if kind is not None and kind not in ADMIN_TASK_KINDS:
            raise HTTPException(422, f"unknown kind '{kind}'; valid: {', '.join(ADMIN_TASK_KINDS)}")
        return [_task_view(t) for t in ledger.admin_tasks(job_id, kind=kind)]

    @jobs.get("/tasks/{task_id}", responses=_responses(404, 422))
    def task_status(task_id: str) -> dict[str, Any]:
        """One admin task: queued, running, succeeded (with its result) or failed (with the error)."""
        task = ledger.get_admin_task(task_id)
        if task is None:
            raise HTTPException(404, f"no admin task '{task_id}'; GET /jobs/{{job_id}}/tasks lists a job's tasks")
        return _task_view(task)

    app.include_router(jobs)
    app.include_router(status_router(ledger, authorize))
    guarded.extend(r for r in app.router.routes if isinstance(r, APIRoute) and _needs_token(r.dependant, authorize))
    return app
