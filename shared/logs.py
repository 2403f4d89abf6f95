"""Structured logging: every line carries the service, job and (when known) policy version."""

from __future__ import annotations

import logging
import sys


class _Context(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[str, object] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        record.ctx = " ".join(f"{k}={v}" for k, v in self.fields.items() if v is not None)
        return True


_ctx = _Context()


def setup_logging(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ctx)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s service=%(service)s %(ctx)s %(name)s: %(message)s",
                          defaults={"service": service})
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def set_context(**fields: object) -> None:
    """Add or update fields (job_id, policy_version, ...) shown on every following log line."""
    _ctx.fields.update(fields)
