"""The job API's edge: what a request must pass before the app reads its body, and what of it
reaches the access log.

`EdgeGuard` is pure ASGI (nothing is parsed); in order:

1. the path and the query hold no control character, NUL included (400): they would reach the
   ledger (PostgreSQL text cannot hold NUL) and the logs;
2. `gate(scope)`, the API's bearer-token check for the routes that need one, answers 401/403
   before a byte of the body is read;
3. the body is at most `max_body_bytes`: a larger Content-Length is a 413 at once, and a body
   sent without one (chunked) is counted as it arrives and refused with a 413 at the cap.

The app then gets the body whole, as one message (it is at most the cap). A request refused
before its body was read is answered with `Connection: close`, so the server reads no more of it.

`AccessLogFilter` keeps credential values in the query (the status page's `?token=`, under any
encoding of the key) and control characters out of uvicorn's access log.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, unquote_plus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.logs import escape_control
from shared.spectypes import CONTROL_CHARS

Rejection = tuple[int, str, dict[str, str]]
"""An answer instead of the app's: status, `error` text, extra headers."""

# A query key that names a credential, once decoded (the status page's `token`, and any other
# key a client might put a secret under: access_token, api_key, password, ...).
_CREDENTIAL_KEY = re.compile(r"token|secret|passw|pwd|key|auth|credential|signature|session", re.IGNORECASE)
_QUERY = re.compile(r"\?([^\s#]*)")


def control_in_target(scope: Scope) -> str | None:
    """Why the request's path or query is refused (a control character in it), or None."""
    query = unquote(scope.get("query_string", b"").decode("latin-1"), errors="replace")
    for where, text in (("path", scope.get("path", "")), ("query", query)):
        m = CONTROL_CHARS.search(text)
        if m is not None:
            return (
                f"the URL's {where} holds the control character {escape_control(m.group())} "
                f"(%{ord(m.group()):02X} when percent-encoded); remove it"
            )
    return None


class EdgeGuard:
    """ASGI middleware: refuse bad targets, unauthorized requests and oversized bodies before
    the app reads a byte of the body (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, gate: Callable[[Scope], Rejection | None]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        why = control_in_target(scope)
        rejection: Rejection | None = (400, why, {}) if why else self.gate(scope)
        if rejection is None:
            declared = _header(scope, b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                rejection = self._too_large(f"declares {int(declared)} bytes")
        if rejection is not None:
            await _answer(send, *rejection, close=_has_body(scope))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _answer(send, *self._too_large(f"passed {self.max_body_bytes} bytes"), close=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self, what: str) -> Rejection:
        return (413, f"the request body {what}; the limit is {self.max_body_bytes} bytes (BROKER_MAX_BODY_BYTES)", {})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1").strip()
    return None


def _has_body(scope: Scope) -> bool:
    declared = _header(scope, b"content-length")
    return (declared is not None and declared != "0") or _header(scope, b"transfer-encoding") is not None


async def _answer(send: Send, status: int, error: str, headers: dict[str, str], *, close: bool) -> None:
    body = json.dumps({"error": error}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    if close:
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive channel that yields `body` as one message, then whatever the client sends next
    (its disconnect)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _decoded_key(raw: str) -> str:
    """A query key as the app could read it: percent- and plus-decoded, as often as that changes
    it (a bounded number of times), so `tok%65n` and `tok%2565n` both read `token`."""
    key = raw
    for _ in range(4):
        decoded = unquote_plus(key, errors="replace")
        if decoded == key:
            break
        key = decoded
    return key.strip()


def _redact_query(query: str) -> str:
    parts = re.split(r"([&;])", query)  # separators kept: the line is otherwise unchanged
    for k in range(0, len(parts), 2):
        key, eq, _value = parts[k].partition("=")
        if eq and _CREDENTIAL_KEY.search(_decoded_key(key)):
            parts[k] = f"{key}=***"
        elif not eq and _CREDENTIAL_KEY.search(_decoded_key(key).partition("=")[0]):
            parts[k] = "***"  # `token%3Dsecret`: the app reads no token, but the secret is still one
    return "".join(parts)


def clean_log_text(text: str) -> str:
    """`text` with the values of credential-like query keys (`token=`, however the key is
    encoded: `tok%65n=`, `TOKEN=`, `+token=`) replaced by `***`, and control characters escaped."""
    if "?" in text:
        text = _QUERY.sub(lambda m: "?" + _redact_query(m.group(1)), text)
    elif "=" in text and not any(c.isspace() for c in text):  # a bare query string
        text = _redact_query(text)
    return escape_control(text)


class AccessLogFilter(logging.Filter):
    """For uvicorn's access logger: its request line arguments (path and query) cleaned by
    `clean_log_text`, so neither a status-page token nor a forged line reaches the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args: Any = record.args
        if isinstance(args, tuple):
            record.args = tuple(clean_log_text(a) if isinstance(a, str) else a for a in args)
        elif isinstance(record.msg, str):
            record.msg = clean_log_text(record.msg)
        return True


def install_access_log_filter(logger_name: str = "uvicorn.access") -> None:
    """Add `AccessLogFilter` to the logger once (uvicorn's logging set-up keeps logger filters)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, AccessLogFilter) for f in logger.filters):
        logger.addFilter(AccessLogFilter())
