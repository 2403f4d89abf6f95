"""Bearer tokens: where they are configured, which role each has, and who may do what.

Every `/jobs` and `/tasks` route needs `Authorization: Bearer <token>` once any token is configured
(`BROKER_TOKENS`, `BROKER_READ_ONLY_TOKENS`, `BROKER_TOKEN_FILE`); a read-only token may only read
(GET). With no token configured the API is open. The audit log names a caller by its role and a
SHA-256 prefix of its token, never the token itself.

The same check runs twice: at the edge (`TokenGate`, before a byte of the body is read) and as the
routes' dependency (`broker.api.deps.authorize`, which also documents the scheme in the OpenAPI).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from fastapi import HTTPException
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from fastapi.security.utils import get_authorization_scheme_param
from starlette.routing import Match
from starlette.types import Scope

from broker.api.edge import Rejection
from shared.logs import escape_control
from shared.settings import BrokerSettings

Role = Literal["rw", "ro"]
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


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
                f"{path}:{n}: expected `TOKEN` (read-write) or `TOKEN ro` (read-only), got {len(fields)} words"
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
            raise ValueError(f"token file {settings.token_file} has no token; add one or unset BROKER_TOKEN_FILE")
        entries += from_file
    tokens: dict[str, Role] = {}
    for token, role in entries:
        if tokens.setdefault(token, role) != role:
            raise ValueError("a token is configured both read-write and read-only; give each token one role")
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


def check_access(
    checker: TokenChecker, authorization: str | None, method: str, path: str
) -> tuple[str, HTTPException | None]:
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


def needs_token(dependant: Dependant, authorize: Callable[..., Any]) -> bool:
    """Whether the route (or a dependency of it, at any depth) depends on `authorize`."""
    return dependant.call is authorize or any(needs_token(d, authorize) for d in dependant.dependencies)


class TokenGate:
    """The edge's token check (`EdgeGuard`'s `gate`), for requests to the guarded routes."""

    def __init__(self, checker: TokenChecker, guarded: list[APIRoute]) -> None:
        self.checker = checker
        self.guarded = guarded

    def __call__(self, scope: Scope) -> Rejection | None:
        if not self.checker.enabled or not any(r.matches(scope)[0] is Match.FULL for r in self.guarded):
            return None
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        _, denied = check_access(self.checker, auth, scope["method"], scope["path"])
        return None if denied is None else (denied.status_code, str(denied.detail), dict(denied.headers or {}))
