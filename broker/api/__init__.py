"""The job API (FastAPI; OpenAPI at /docs): submit, list, inspect and stop jobs.

Errors are JSON objects with an `error` message that says what to do; an invalid job spec is a 422
listing each offending field.

Auth: every `/jobs` route needs `Authorization: Bearer <token>` once any token is configured
(`BROKER_TOKENS`, `BROKER_READ_ONLY_TOKENS`, `BROKER_TOKEN_FILE`); a read-only token may only
read (GET). With no token configured the API is open and says so in a start-up warning.
`/health` and `/metrics` (Prometheus) are always open.

The edge (`broker.api.edge`) checks the token, the URL and the body size before a byte of the body
is read: 401/403, 400 (a control character in the path or query), 413 (over BROKER_MAX_BODY_BYTES).
A 422 lists at most MAX_ERRORS_LISTED fields. Redis or the ledger unreachable is a 503, quickly:
request paths use a Redis client with short socket timeouts and no retries.

Layout: `app.create_app` assembles `main.api_router` (one router per resource in `routes/`), the
dependencies of `deps` (the app's `ApiContext`, the caller), the error handlers of `errors` and
the middleware (`edge`, `observe`); `models` holds the response bodies.
"""

from broker.api.app import create_app
from broker.api.auth import Role, TokenChecker, configured_tokens, load_token_file
from broker.api.crud import TERMINAL_STATES, storable
from broker.api.deps import request_redis
from broker.api.errors import MAX_ERRORS_LISTED, ErrorBody, ValidationErrorBody

__all__ = [
    "MAX_ERRORS_LISTED",
    "TERMINAL_STATES",
    "ErrorBody",
    "Role",
    "TokenChecker",
    "ValidationErrorBody",
    "configured_tokens",
    "create_app",
    "load_token_file",
    "request_redis",
    "storable",
]
