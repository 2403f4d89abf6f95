"""Which inputs of a failed batch make it fail: bisection, so one poisoned group costs its own
samples and a few extra passes, not the job.

A step that raises on its batch would raise again on the same batch after a restart (the entries
stay pending and are taken over), which is a crash loop. Instead the trainer (trainer_svc/train.py)
asks `culprits` which groups raise on their own, probing halves of the batch with a pass that
changes nothing (trainer_svc/learner.py `Learner.check`), drops those with the error as their
reason, and fills the step again with the others. The same idea as the ledger's
`broker.ledger.write_isolating`, for a step instead of a write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def culprits(items: Sequence[T], probe: Callable[[Sequence[T]], None]) -> dict[int, Exception]:
    """The items that make `probe` raise on their own: {index in `items`: what it raised}.

    Bisects: a part that passes is cleared whole, a part that raises is split, down to single
    items. k culprits among n items cost at most about 2 k log2(n) probes. A failure that needs two
    items together (each half passes) names no culprit; nor does one that does not repeat.

    Args:
        items: the inputs (a batch's groups).
        probe: raises on inputs it cannot take; must change nothing either way.
    """
    found: dict[int, Exception] = {}

    def attempt(lo: int, hi: int) -> None:
        try:
            probe(items[lo:hi])
        except Exception as exc:
            if hi - lo == 1:
                found[lo] = exc
                return
            mid = (lo + hi) // 2
            attempt(lo, mid)
            attempt(mid, hi)

    if items:
        attempt(0, len(items))
    return found
