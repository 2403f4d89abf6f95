"""Error answers: every error is a JSON object with an `error` message that says what to do.

An invalid request is a 422 listing each offending field (at most MAX_ERRORS_LISTED, each text cut
short); Redis or the ledger unreachable is a 503.
"""

from __future__ import annotations

from typing import Any

import redis
import sqlalchemy.exc
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from shared.jobspec import format_validation_error

# A 422 lists this many invalid fields, then counts the rest; each text is cut to these lengths.
MAX_ERRORS_LISTED = 20
MAX_FIELD_CHARS = 200
MAX_MESSAGE_CHARS = 500


class ErrorBody(BaseModel):
    error: str = Field(..., description="What went wrong and what to do.")


class FieldError(BaseModel):
    field: str = Field(..., description="Dotted location of the field ('' for the body as a whole).")
    message: str


class ValidationErrorBody(ErrorBody):
    fields: list[FieldError] | None = Field(
        None,
        description=f"The first {MAX_ERRORS_LISTED} invalid fields; absent when the request is refused as a "
        "whole (an unknown filter value, nothing to change).",
    )
    more_errors: int | None = Field(None, description="Invalid fields not listed (present only when some are not).")


_TEXTS = {
    400: "A control character (NUL included) in the path or query.",
    401: "Missing or invalid bearer token.",
    403: "A read-only token asked to write.",
    404: "No such job, checkpoint or task.",
    409: "The job's state does not allow this.",
    413: "The request body is over BROKER_MAX_BODY_BYTES.",
    422: "Invalid input; `fields` names each offending field.",
    503: "Redis, the ledger or the admin task queue is unreachable; retry later.",
}
_CHALLENGE = {"WWW-Authenticate": {"description": "The bearer challenge (RFC 6750).", "schema": {"type": "string"}}}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers a route gives."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        entry: dict[str, Any] = {
            "model": ValidationErrorBody if code == 422 else ErrorBody,
            "description": _TEXTS[code],
        }
        if code in (401, 403):
            entry["headers"] = _CHALLENGE
        out[code] = entry
    return out


def errors_body(what: str, fields: list[dict]) -> dict[str, Any]:
    """A 422 body: at most MAX_ERRORS_LISTED fields, each text cut short, and the rest counted."""
    listed = [
        {"field": f["field"][:MAX_FIELD_CHARS], "message": f["message"][:MAX_MESSAGE_CHARS]}
        for f in fields[:MAX_ERRORS_LISTED]
    ]
    summary = "; ".join(f"{f['field'] or 'body'}: {f['message']}" for f in listed)
    body: dict[str, Any] = {"error": f"{what}: {summary}", "fields": listed}
    if len(fields) > len(listed):
        body["more_errors"] = len(fields) - len(listed)
        body["error"] += f"; and {body['more_errors']} more"
    return body


async def _invalid(req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    fields = format_validation_error(exc)
    in_body = any(e.get("loc", ("",))[0] == "body" for e in exc.errors())
    what = ("invalid job spec" if req.url.path == "/jobs" else "invalid request body") if in_body else "invalid request"
    return JSONResponse(status_code=422, content=errors_body(what, fields))


async def _redis_down(_req: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(status_code=503, content={"error": f"Redis is unreachable ({type(exc).__name__}); retry later"})


async def _ledger_down(_req: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(
        status_code=503,
        content={"error": f"the ledger database is unreachable or busy ({type(exc).__name__}); retry later"},
    )


async def _unstorable(_req: Request, _exc: Exception) -> JSONResponse:
    # The edge and the models refuse what the ledger cannot store; this is the backstop.
    return JSONResponse(
        status_code=422, content={"error": "a value in the request cannot be stored in the ledger", "fields": []}
    )


async def _http(_req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return JSONResponse(status_code=exc.status_code, content={"error": exc.detail}, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation errors, HTTP errors and Redis or ledger outages in the API's JSON shape."""
    app.add_exception_handler(RequestValidationError, _invalid)
    for redis_down in (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        app.add_exception_handler(redis_down, _redis_down)
    for ledger_down in (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, sqlalchemy.exc.TimeoutError):
        app.add_exception_handler(ledger_down, _ledger_down)
    app.add_exception_handler(sqlalchemy.exc.DataError, _unstorable)
    app.add_exception_handler(HTTPException, _http)
