"""Watchers that ride out an outage of the job API (or of the Redis and ledger behind it): the
demo's and the CLI's progress loops poll through `get_json`, which retries connection errors and
5xx answers with back-off (tenacity) for up to `outage_s` seconds, instead of dying on the first
500 or parsing an error page as JSON."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

log = logging.getLogger(__name__)

DEFAULT_OUTAGE_S = 600.0


class ApiUnavailable(RuntimeError):
    """The API answered 5xx (or not at all) for longer than the outage budget."""


class _Transient(Exception):
    def __init__(self, response: httpx.Response):
        super().__init__(f"HTTP {response.status_code}: {response.text[:200]}")
        self.response = response


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, httpx.TransportError | _Transient)


def _note(state: RetryCallState) -> None:
    if state.attempt_number == 1 and state.outcome is not None:
        log.warning("job API unavailable (%s); retrying", state.outcome.exception())


def get_json(get: Callable[..., httpx.Response], url: str, *, outage_s: float = DEFAULT_OUTAGE_S, **kwargs: Any) -> Any:
    """`get(url, **kwargs)`'s JSON body; connection errors and 5xx answers are retried for up to
    `outage_s` seconds. A 4xx answer is returned to the caller as it is (its JSON, or
    `{"error": text}` when it has none) with `"status_code"` added when it is an error.

    Raises:
        ApiUnavailable: the outage lasted longer than `outage_s`.
    """

    def once() -> httpx.Response:
        r = get(url, **kwargs)
        if r.status_code >= 500:
            raise _Transient(r)
        return r

    try:
        r = Retrying(
            retry=retry_if_exception(_transient),
            stop=stop_after_delay(outage_s),
            wait=wait_exponential(multiplier=0.2, max=5.0),
            after=_note,
            reraise=True,
        )(once)
    except (httpx.TransportError, _Transient) as exc:
        raise ApiUnavailable(f"{url}: the job API stayed unavailable for {outage_s:.0f} s ({exc})") from exc
    try:
        body = r.json()
    except ValueError:
        body = {"error": r.text[:500]}
    if r.is_error and isinstance(body, dict):
        body.setdefault("status_code", r.status_code)
    return body
