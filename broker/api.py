"""The job API (FastAPI; OpenAPI at /docs): submit, list, inspect and stop jobs.

Errors are JSON objects with an `error` message that says what to do; an invalid job spec is a 422
listing each offending field.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from broker.streams import CONTROL, JobStreams, connect
from shared.jobspec import JobSpec, format_validation_error
from shared.schema import Control
from shared.settings import BrokerSettings


def create_app(settings: BrokerSettings | None = None, ledger: Ledger | None = None) -> FastAPI:
    settings = settings or BrokerSettings()
    ledger = ledger or Ledger(settings.database_url)
    redis_url, _ = resolve_redis_url(settings.redis_url)
    redis_client = connect(redis_url)
    app = FastAPI(title="asyncrl job API", version="0.1.0")

    def streams(job_id: str) -> JobStreams:
        return JobStreams(redis_client, job_id, prefix=settings.stream_prefix)

    def job_or_404(job_id: str) -> dict[str, Any]:
        job = ledger.get_job(job_id)
        if job is None:
            raise HTTPException(404, f"no job '{job_id}'; GET /jobs lists the known ones")
        return job

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        fields = format_validation_error(exc)
        summary = "; ".join(f"{f['field'] or 'body'}: {f['message']}" for f in fields)
        return JSONResponse(status_code=422, content={"error": f"invalid job spec: {summary}", "fields": fields})

    @app.exception_handler(HTTPException)
    async def _http(_req: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"error": exc.detail})

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "redis": bool(redis_client.ping()), "ledger_revision": ledger.current_revision()}

    @app.post("/jobs", status_code=201)
    def submit(spec: JobSpec) -> dict[str, Any]:
        job_id = uuid.uuid4().hex[:12]
        ledger.create_job(job_id, spec.name, spec.model_dump(mode="json"))
        return {"id": job_id, "state": "submitted", "spec": spec.model_dump(mode="json")}

    @app.get("/jobs")
    def list_jobs(limit: int = 100) -> list[dict[str, Any]]:
        return [
            {k: j[k] for k in ("id", "name", "state", "step", "created_at", "updated_at")}
            for j in ledger.list_jobs(limit=limit)
        ]

    @app.get("/jobs/{job_id}")
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
            "spec": job["spec"],
            "last_metrics": steps[-1]["metrics"] if steps else None,
            "evals": ledger.evals(job_id),
            "samples": ledger.status_counts(job_id),
            "staleness": ledger.staleness_histogram(job_id),
            "generators": generators,
        }

    @app.post("/jobs/{job_id}/stop", status_code=202)
    def stop(job_id: str) -> dict[str, Any]:
        job = job_or_404(job_id)
        if job["state"] in ("finished", "stopped", "failed", "cancelled"):
            raise HTTPException(409, f"job '{job_id}' is already {job['state']}; nothing to stop")
        streams(job_id).publish(
            CONTROL, Control(job_id=job_id, msg_id=f"stop-{uuid.uuid4().hex[:8]}", policy_version=0, command="stop")
        )
        ledger.set_job_state(job_id, "stopping")
        return {"id": job_id, "state": "stopping"}

    return app

