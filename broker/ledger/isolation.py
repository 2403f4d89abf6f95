"""Poison isolation: write a batch, and when the database refuses it for one item's values,
write every other item anyway."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from sqlalchemy import exc as sa_exc

from shared.schema import clean_text

__all__ = ["row_error", "write_isolating"]

log = logging.getLogger(__name__)


T = TypeVar("T")
R = TypeVar("R")


def row_error(exc: BaseException) -> str | None:
    """Why the database refused the *values* written (an out-of-range integer, a NUL in a text
    column, a constraint), as short text; None when `exc` says nothing about them (connection lost,
    lock or statement timeout, deadlock, disk full, an SQL bug): that must propagate, not be pinned
    on a row. The text is the driver's message only: SQLAlchemy's own rendering repeats the
    statement and its parameters, which may be megabytes of completion."""
    if isinstance(exc, (sa_exc.DataError, sa_exc.IntegrityError)):
        text = str(exc.orig)
    elif isinstance(exc, sa_exc.DBAPIError):
        return None  # OperationalError, InterfaceError, ProgrammingError, InternalError, ...
    elif isinstance(exc, sa_exc.StatementError):  # a value a column type could not bind
        text = str(exc.orig) if exc.orig is not None else str(exc)
    elif isinstance(exc, (OverflowError, ValueError, TypeError)):
        # raised while binding: sqlite3 on an integer beyond int64, json_safe on a non-JSON value,
        # check_one_of on an unknown kind or status
        text = str(exc)
    else:
        return None
    return clean_text(f"{type(getattr(exc, 'orig', None) or exc).__name__}: {text}".strip())[:1000]


def write_isolating(write: Callable[[Sequence[T]], R], items: Sequence[T]) -> tuple[list[R], dict[int, str]]:
    """Write `items` with `write` (a `Ledger.record_*` method: one transaction per call); when the
    database refuses the batch for its values (`row_error`), bisect it and write the halves, down
    to single items. Returns the results of the writes that committed, and {index in `items`: the
    database's reason} for each item refused on its own.

    One poisoned item costs about 2 log2(len(items)) extra transactions and nothing else: the
    others are written. Errors that are not about values propagate unchanged.
    """
    results: list[R] = []
    rejected: dict[int, str] = {}

    def attempt(lo: int, hi: int) -> None:
        try:
            results.append(write(items[lo:hi]))
        except Exception as exc:
            reason = row_error(exc)
            if reason is None:
                raise
            if hi - lo == 1:
                rejected[lo] = reason
                return
            log.warning("ledger refused a batch of %d (%s); splitting it", hi - lo, reason)
            mid = (lo + hi) // 2
            attempt(lo, mid)
            attempt(mid, hi)

    if items:
        attempt(0, len(items))
    return results, rejected
