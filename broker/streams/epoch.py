"""A job's epoch key: how a service knows Redis lost the job's state.

The trainer writes a token of its own to `{job}:epoch` when it starts serving the job. Redis
restarted without persistence (or its keys flushed) loses that key with every stream of the job:
the trainer's policy announcement, the consumer groups, what was in flight. A key that is gone
(or holds another token) is the sign; the trainer then writes a new token and re-announces
(trainer_svc/redis_state.py). Nothing else reads it: consumer groups recreate themselves on
NOGROUP (`Groups._group_read`) and broadcast readers read on from where they were.
"""

from __future__ import annotations

from typing import Any

from .keys import EPOCH, JobKeys


class Epoch:
    """The epoch key of one job: a plain string, no expiry."""

    def __init__(self, client: Any, keys: JobKeys):
        self.r = client
        self.key = keys.key(EPOCH)

    def stamp(self, token: str) -> None:
        """Write `token` as the job's epoch."""
        self.r.set(self.key, token)

    def read(self) -> str | None:
        """The job's epoch token; None when Redis holds none (never stamped, or lost)."""
        v = self.r.get(self.key)
        return v.decode() if isinstance(v, bytes) else v
