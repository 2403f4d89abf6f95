"""Structured logging: every line carries the service, job and (when known) policy version.

One record is one line: user-provided text (job names, paths, request lines) cannot forge a
record or send terminal escape codes. `escape_control` escapes every control character of such
text where it is logged; the formatter also escapes, in every message, the controls that never
belong in one (all but newline and tab: a message the code writes may span lines, e.g. the
launcher's tail of a failed service's log).
"""

from __future__ import annotations

import faulthandler
import logging
import re
import signal
import sys
import threading

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_CONTROL_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def escape_control(text: str) -> str:
    """`text` with every control character written as an escape (`\\n`, `\\x1b`, `\\u2028`)."""
    return _CONTROL.sub(_escape, text)


class _Context(logging.Filter):
    """The fields shown on each line: the process's (set from the main thread) and, over them, the
    fields a worker thread set for itself (a service serving several jobs at once serves each in
    its own thread, each with its job_id)."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[str, object] = {}
        self._local = threading.local()

    def mine(self) -> dict[str, object]:
        """The calling thread's own fields (the process's, from the main thread)."""
        if threading.current_thread() is threading.main_thread():
            return self.fields
        if not hasattr(self._local, "fields"):
            self._local.fields = {}
        return self._local.fields  # type: ignore[no-any-return]

    def filter(self, record: logging.LogRecord) -> bool:
        own = self.mine()
        fields = own if own is self.fields else {**self.fields, **own}
        record.ctx = escape_control(" ".join(f"{k}={v}" for k, v in fields.items() if v is not None))
        return True


class _OneRecordFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = _CONTROL_BUT_LINES.sub(_escape, record.message)
        return super().formatMessage(record)


_ctx = _Context()


def setup_logging(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ctx)
    handler.setFormatter(
        _OneRecordFormatter(
            "%(asctime)s %(levelname)s service=%(service)s %(ctx)s %(name)s: %(message)s", defaults={"service": service}
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Alembic's INFO is a line per migration plugin and per migration context on every start (a
    # ledger already at head too); the ledger logs its own line when it migrates (broker/ledger).
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # `kill -USR1 <pid>`: every thread's stack to stderr (the service's log), where a stuck service
    # is stuck; the process goes on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def set_context(**fields: object) -> None:
    """Add or update fields (job_id, policy_version, ...) shown on every following log line."""
    _ctx.mine().update(fields)
