"""Broadcast streams (policy, control): plain ranges without a group, so every reader sees every
entry; and the generators' heartbeats, a hash beside the streams."""

from __future__ import annotations

import json
import time
from typing import Any

from shared.schema import DecodeError

from .dead_letters import DeadLetters
from .entries import M
from .keys import HEARTBEATS, JobKeys
from .reads import Reads
from .wakeups import Wakeups


class Broadcast:
    """The broadcast streams of one job: read from any position, no acks, trimmed by length."""

    def __init__(self, client: Any, keys: JobKeys, reads: Reads, dead: DeadLetters, wakeups: Wakeups):
        self.r = client
        self.keys = keys
        self.reads = reads
        self.dead = dead
        self.wakeups = wakeups

    def read(
        self,
        stream: str,
        last_id: str,
        expected: type[M],
        *,
        block_ms: int | None = None,
        count: int = 100,
    ) -> tuple[str, list[M]]:
        """Messages after `last_id` ("0": from the start), waiting up to `block_ms` for one; returns
        (new last_id, messages). Invalid or oversized entries are skipped (dead-lettered once, by
        id, without a group). Bounded like `consume`: at most `max_read_bytes` (+ one entry)."""
        start = "-" if last_id in ("0", "0-0") else f"({last_id}"
        deadline = time.monotonic() + block_ms / 1000 if block_ms else None
        waits = 0
        while True:
            _, rows = self.reads.read(stream, "range", count=count, start=start)
            now = time.monotonic()
            if rows or deadline is None or now >= deadline:
                break
            self.wakeups.wait(stream, waits, deadline - now)
            waits += 1
        msgs: list[M] = []
        for e in rows:
            last_id = e.entry_id
            delivered = self.dead.deliver(stream, None, [e], expected)
            msgs += [d.message for d in delivered]
        return last_id, msgs

    def latest(self, stream: str, expected: type[M]) -> tuple[str, M] | None:
        """The newest valid message among the last 20 entries of a broadcast stream (a late
        joiner's starting point); invalid and oversized entries (those unread) are skipped."""
        _, rows = self.reads.read(stream, "revrange", count=20, start="+")
        for e in rows:
            try:
                return e.entry_id, self.dead.decode(stream, e, expected)  # type: ignore[return-value]
            except DecodeError:
                continue
        return None

    def trim(self, stream: str, keep: int) -> int:
        """Keep the newest `keep` entries of a broadcast stream (no group, so nothing is pending;
        late joiners start from the newest entry)."""
        return int(self.r.xtrim(self.keys.key(stream), maxlen=keep, approximate=False))


class Heartbeats:
    """Generator heartbeats: a hash of worker id -> its latest fields and time (a hash, not a
    stream; kept here so Redis access stays in one place)."""

    def __init__(self, client: Any, keys: JobKeys):
        self.r = client
        self.key = keys.key(HEARTBEATS)

    def beat(self, worker_id: str, fields: dict) -> None:
        body = dict(fields, ts=time.time())
        self.r.hset(self.key, worker_id, json.dumps(body))

    def all(self) -> dict[str, dict]:
        raw = self.r.hgetall(self.key)
        return {(k.decode() if isinstance(k, bytes) else k): json.loads(v) for k, v in raw.items()}
