"""Bounded reads: every read of a stream is sized on the server before anything is transferred
(the READ script), whatever the mode (a group's new entries, its pending ones, a claim, a range)."""

from __future__ import annotations

from typing import Any

from shared.schema import DEAD_RAW_BYTES

from .entries import Entry, entry_from_row, text
from .keys import DEAD, FIELD, JobKeys
from .scripts import READ, Scripts

# A stream entry carries one field (FIELD); dead letters two (FIELD, "reason"). More is not ours.
MAX_FIELDS = 8
# A dead letter holds up to DEAD_RAW_BYTES of the entry plus its reason (twice): the dead stream
# admits that much whatever MAX_MESSAGE_BYTES is.
DEAD_ENTRY_BYTES = DEAD_RAW_BYTES + 32 * 1024


class Reads:
    """One bounded read of a job's stream: at most `max_read_bytes` (+ one entry) of payload per
    read, and an entry over `max_message_bytes` (or with more than MAX_FIELDS fields) comes back
    refused unread, its size and first DEAD_RAW_BYTES only. Without scripts (no `@scripting`)
    the same answers come from plain XREADGROUP / XAUTOCLAIM / XRANGE, sized after the transfer."""

    def __init__(self, client: Any, keys: JobKeys, scripts: Scripts, *, max_message_bytes: int, max_read_bytes: int):
        self.r = client
        self.keys = keys
        self.scripts = scripts
        self.max_message_bytes = max_message_bytes
        self.max_read_bytes = max_read_bytes

    def max_entry(self, stream: str) -> int:
        if stream == DEAD:
            return max(self.max_message_bytes, DEAD_ENTRY_BYTES)
        return self.max_message_bytes

    def read(
        self,
        stream: str,
        mode: str,
        *,
        group: str = "",
        consumer: str = "",
        count: int,
        start: str = "",
        min_idle_ms: int = 0,
    ) -> tuple[str, list[Entry]]:
        """One bounded read (see the READ script for the modes); returns (next start or cursor,
        entries)."""
        key = self.keys.key(stream)
        max_entry = self.max_entry(stream)
        reply = self.scripts.run(
            READ,
            [key],
            [
                mode,
                group,
                consumer,
                count,
                max_entry,
                self.max_read_bytes,
                start,
                min_idle_ms,
                FIELD,
                DEAD_RAW_BYTES,
                MAX_FIELDS,
            ],
        )
        if reply is not None:
            nxt, rows = reply
            return text(nxt), [entry_from_row(r) for r in rows]
        return self._read_plain(key, mode, group, consumer, count, start, min_idle_ms, max_entry)

    def _read_plain(
        self, key: str, mode: str, group: str, consumer: str, count: int, start: str, min_idle_ms: int, max_entry: int
    ) -> tuple[str, list[Entry]]:
        """`read` without a script: the same answers, sized after the transfer."""
        nxt = start
        entries: list[tuple[Any, Any]]
        if mode in ("new", "pending"):
            resp = self.r.xreadgroup(group, consumer, {key: ">" if mode == "new" else start}, count=count)
            entries = [(eid, fields) for _k, es in resp or [] for eid, fields in es]
            if mode == "pending":
                gone = [text(eid) for eid, fields in entries if not fields]  # deleted while pending
                if gone:
                    self.r.xack(key, group, *gone)
                entries = [(eid, fields) for eid, fields in entries if fields]
        elif mode == "claim":
            resp = self.r.xautoclaim(key, group, consumer, min_idle_time=min_idle_ms, start_id=start, count=count)
            nxt = text(resp[0])
            entries = resp[1] or []
            if any(fields is None for _, fields in entries):  # as in READ: 6.2's deleted entries
                for p in self.r.xpending_range(key, group, min="-", max="+", count=1000, consumername=consumer):
                    if not self.r.xrange(key, min=p["message_id"], max=p["message_id"], count=1):
                        self.r.xack(key, group, p["message_id"])
                entries = [(eid, fields) for eid, fields in entries if fields is not None]
        elif mode == "range":
            entries = self.r.xrange(key, min=start, max="+", count=count)
        else:
            entries = self.r.xrevrange(key, max=start, min="-", count=count)
        if entries and mode in ("range", "revrange"):
            nxt = f"({text(entries[-1][0])}"
        out = []
        for eid, fields in entries:
            n = 1
            if mode in ("pending", "claim"):
                n = next(
                    (int(p["times_delivered"]) for p in self.r.xpending_range(key, group, min=eid, max=eid, count=1)), 1
                )
            size = sum(len(k) + len(v) for k, v in fields.items())
            if len(fields) > MAX_FIELDS:
                out.append(Entry(text(eid), None, "fields", len(fields), n))
            elif size > max_entry:
                prefix = bytes(fields.get(FIELD, b""))[:DEAD_RAW_BYTES]
                out.append(Entry(text(eid), None, "big", size, n, prefix))
            else:
                out.append(Entry(text(eid), fields, deliveries=n))
        return nxt, out
