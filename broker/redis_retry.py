"""Riding out a Redis outage: every Redis command of a service retries for as long as the outage
budget allows, so a restarted Redis (from its AOF) costs a pause, not a service.

A command that fails with a connection or timeout error is retried with exponential back-off
(capped at 2 s) until it succeeds or the failures have lasted `outage_s` seconds without a
success in between; then the last error is raised. The work a service holds (a generated batch, a
scored batch, a training step's rollouts) stays in its hands meanwhile, because the command that
would hand it on simply has not returned yet. Every outage is logged when it starts and when it
ends (with its length) and counted in `redis_outages_total` / `redis_outage_seconds_total`.

Authentication failures and TLS certificate failures are never retried: a credential or a
certificate that is wrong stays wrong.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import Counter
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError
from redis.retry import Retry

log = logging.getLogger(__name__)
R = TypeVar("R")

# Services: long enough for a Redis restart from an AOF (REDIS_OUTAGE_S, shared.settings);
# request paths pass a budget of their own.
DEFAULT_OUTAGE_S = 600.0

OUTAGES = Counter("redis_outages", "Redis outages this process rode out or gave up on")
OUTAGE_SECONDS = Counter("redis_outage_seconds", "Seconds of Redis commands failing before they succeeded")


def permanent(error: BaseException) -> bool:
    """A connection error that waiting cannot fix: wrong credentials, an untrusted certificate."""
    if isinstance(error, AuthenticationError):
        return True
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or "certificate verify failed" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class OutageRetry(Retry):
    """redis-py's Retry bounded by time (`outage_s` of continuous failure) rather than a count,
    logging and counting each outage; a `permanent` error is raised at once."""

    def __init__(self, outage_s: float = DEFAULT_OUTAGE_S, *, cap_s: float = 2.0, base_s: float = 0.05):
        super().__init__(ExponentialBackoff(cap=cap_s, base=base_s), retries=-1)
        self.outage_s = outage_s

    def call_with_retry(
        self,
        do: Callable[[], R],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> R:
        self._backoff.reset()
        failures, started = 0, None
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if permanent(error) or (is_retryable is not None and not is_retryable(error)):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                now = time.monotonic()
                if started is None:
                    started = now
                    OUTAGES.inc()
                    if self.outage_s > 0:
                        log.warning("redis unreachable (%s); retrying for up to %.0f s", error, self.outage_s)
                if now - started >= self.outage_s:
                    OUTAGE_SECONDS.inc(now - started)
                    if self.outage_s > 0:
                        log.error(
                            "redis unreachable for %.1f s (budget %.0f s): giving up", now - started, self.outage_s
                        )
                    raise
                time.sleep(min(self._backoff.compute(failures), max(0.0, started + self.outage_s - now)))
                continue
            if started is not None:
                lasted = time.monotonic() - started
                OUTAGE_SECONDS.inc(lasted)
                log.warning("redis reachable again after %.1f s (%d failed attempts)", lasted, failures)
            return result
