"""Consumer groups: reading new and pending entries, reclaiming those a dead consumer left idle
(XAUTOCLAIM after `claim_idle_ms`), keeping one's own entries from being reclaimed (`touch`),
acking, and trimming what the group has acked."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from redis.exceptions import ResponseError

from shared.schema import DecodeError, EvalRound, PromptGroup, Rollout, Scored

from .connection import batch
from .dead_letters import DeadLetters
from .entries import Consumer, Delivery, Entry, M, text
from .keys import JobKeys
from .reads import Reads
from .scripts import TOUCH, Scripts
from .wakeups import Wakeups

log = logging.getLogger(__name__)


class Groups:
    """The consumer groups of one job's streams."""

    def __init__(
        self,
        client: Any,
        keys: JobKeys,
        scripts: Scripts,
        reads: Reads,
        dead: DeadLetters,
        wakeups: Wakeups,
        *,
        claim_idle_ms: int,
        cluster: bool,
    ):
        self.r = client
        self.keys = keys
        self.scripts = scripts
        self.reads = reads
        self.dead = dead
        self.wakeups = wakeups
        self.claim_idle_ms = claim_idle_ms
        self.cluster = cluster
        # Per (stream, group): when the last reclaim pass over its PEL began, and where it stands.
        self.last_claim: dict[tuple[str, str], float] = {}
        self._claim_cursor: dict[tuple[str, str], str] = {}

    # -- set-up -------------------------------------------------------------------------------
    def ensure_group(self, stream: str, group: str, start_id: str = "0") -> None:
        """Create the consumer group (and the stream) if missing; idempotent."""
        try:
            self.r.xgroup_create(self.keys.key(stream), group, id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- consume --------------------------------------------------------------------------------
    def consume(self, c: Consumer[M], *, count: int = 64, block_ms: int | None = 1000) -> list[Delivery[M]]:
        """Read up to `count` entries for consumer `c`: first reclaim idle ones, then new ones,
        waiting up to `block_ms` for one to arrive (None or 0: no wait).

        Entries that fail to decode, that are oversized, or that were delivered too often, are
        dead-lettered and acked here; the caller only ever sees valid messages. A read returns at
        most `max_read_bytes` (+ one entry) of payload, so it may return fewer than `count`
        entries with more waiting. A vanished stream or group is recreated.
        """
        out = self._reclaim(c, count)
        if len(out) >= count:
            return out
        deadline = time.monotonic() + block_ms / 1000 if block_ms else None
        waits = 0
        while True:
            read = self._group_read(c, "new", count - len(out))
            if read is None:
                return out
            _, rows = read
            out += self.dead.deliver(c.stream, c.group, rows, c.expected)
            now = time.monotonic()
            if rows or out or deadline is None or now >= deadline:
                return out
            # Scripts cannot block: a wait is for the producers' wake-up (or a poll, see
            # Wakeups.wait).
            self.wakeups.wait(c.stream, waits, deadline - now)
            waits += 1

    def consume_own_pending(self, c: Consumer[M], *, count: int = 64) -> list[Delivery[M]]:
        """Entries already delivered to consumer `c` and not acked: what a restarted consumer of
        the same name left in flight (XREADGROUP with id 0). Call it at start-up, until it returns
        nothing, before reading new entries; each read counts one delivery. A consumer whose
        predecessor may have died of one of them passes `count=1`: each suspect is then handled
        alone, and only the one that kills it again accumulates deliveries."""
        read = self._group_read(c, "pending", count, start="0")
        out = self.dead.deliver(c.stream, c.group, read[1], c.expected) if read else []
        if out:
            log.warning("resuming %d entries %s left pending on %s", len(out), c.name, self.keys.key(c.stream))
        return out

    def claim_all(self, c: Consumer[M]) -> list[Delivery[M]]:
        """Claim every entry pending in `c`'s group, whoever holds it and however briefly idle
        (each claim counts one delivery), in reads bounded like `consume`'s. Only for a consumer
        that is alone in its group by design, at start-up (trainer_svc.checkpoint.take_over)."""
        out: list[Delivery[M]] = []
        cursor = "0-0"
        while True:
            read = self._group_read(c, "claim", 1024, start=cursor)
            if read is None:
                return out
            cursor, rows = read
            out += self.dead.deliver(c.stream, c.group, rows, c.expected)
            if cursor == "0-0":
                return out

    def touch(self, c: Consumer, entry_ids: list[str]) -> list[bool]:
        """Reset the idle time of the entries consumer `c` still holds (XCLAIM by their owner with
        JUSTID: the delivery count is kept), so that no other consumer reclaims work `c` is still
        doing; returns which entries `c` held. An entry acked or taken over meanwhile is left
        alone, never taken back.

        For work that can outlast `claim_idle_ms` (a batch of multi-turn episodes): call it more
        often than that while the work makes progress; a consumer that dies (or hangs) stops
        calling it, and its entries are reclaimed as before. A group that vanished (Redis came
        back empty) holds nothing: all False.
        """
        if not entry_ids:
            return []
        try:
            return self._touch(c, entry_ids)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return [False] * len(entry_ids)  # the group vanished (Redis lost it): nothing is held

    def _touch(self, c: Consumer, entry_ids: list[str]) -> list[bool]:
        held = self.scripts.run(TOUCH, [self.keys.key(c.stream)], [c.group, c.name, *entry_ids])
        if held is not None:
            return [bool(x) for x in held]
        # Without scripts the check and the claim are two steps: an entry taken over in between
        # would be taken back (its new holder's publish_if_owned then publishes nothing).
        out = []
        for eid in entry_ids:
            held = self.r.xpending_range(
                self.keys.key(c.stream), c.group, min=eid, max=eid, count=1, consumername=c.name
            )
            if held:
                self.r.xclaim(self.keys.key(c.stream), c.group, c.name, 0, [eid], justid=True)
            out.append(bool(held))
        return out

    def ack(self, stream: str, group: str, entry_ids: list[str]) -> int:
        if not entry_ids:
            return 0
        return int(self.r.xack(self.keys.key(stream), group, *entry_ids))

    def pending_count(self, stream: str, group: str) -> int:
        try:
            return int(self.r.xpending(self.keys.key(stream), group)["pending"])
        except ResponseError:
            return 0

    def _group_read(
        self, c: Consumer, mode: str, count: int, *, start: str = "", min_idle_ms: int = 0
    ) -> tuple[str, list[Entry]] | None:
        """One bounded read of `c`'s group (`Reads.read`); None when the stream or the group
        vanished (both are recreated: the next read finds them)."""
        try:
            return self.reads.read(
                c.stream, mode, group=c.group, consumer=c.name, count=count, start=start, min_idle_ms=min_idle_ms
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("stream %s or group %s vanished; recreating", self.keys.key(c.stream), c.group)
            self.ensure_group(c.stream, c.group)
            return None

    def _reclaim(self, c: Consumer[M], count: int) -> list[Delivery[M]]:
        now = time.monotonic()
        k = (c.stream, c.group)
        cursor = self._claim_cursor.get(k, "0-0")
        if cursor == "0-0":
            # A full pass over the PEL once per half idle period is enough; a pass cut short by
            # `count` or the read budget goes on from its cursor at the next read.
            if now - self.last_claim.get(k, 0.0) < self.claim_idle_ms / 2000.0:
                return []
            self.last_claim[k] = now
        read = self._group_read(c, "claim", count, start=cursor, min_idle_ms=self.claim_idle_ms)
        if read is None:
            self._claim_cursor.pop(k, None)
            return []
        cursor, rows = read
        self._claim_cursor[k] = cursor
        out = self.dead.deliver(c.stream, c.group, rows, c.expected)
        if out:
            log.warning("reclaimed %d idle entries from %s", len(out), self.keys.key(c.stream))
        return out

    # -- what the groups leave behind -------------------------------------------------------------
    def trim_acked_many(self, pairs: Iterable[tuple[str, str]]) -> int:
        """Trim each (stream, group) with MINID at the oldest pending entry (or the group's last
        delivered id), in two round trips (what to keep, then the trims); returns the entries
        trimmed. A stream or group that does not exist is left alone.

        Never MAXLEN: that could drop entries nobody has acked yet.
        """
        keys = [(self.keys.key(stream), group) for stream, group in pairs]
        calls: list[tuple[str, tuple, dict]] = []
        for key, group in keys:
            calls += [("xpending", (key, group), {}), ("xinfo_groups", (key,), {})]
        answers = batch(self.r, calls, cluster=self.cluster)
        trims = []
        for (key, group), pend, groups in zip(keys, answers[::2], answers[1::2], strict=True):
            if isinstance(pend, ResponseError) or isinstance(groups, ResponseError):
                continue  # no such stream or group
            if pend["pending"]:
                min_id = pend["min"]
            else:
                g = next((g for g in groups if g["name"] in (group, group.encode())), None)
                if g is None:
                    continue
                # Keep the last delivered entry itself; trim what precedes it.
                min_id = g["last-delivered-id"]
            min_id = min_id.decode() if isinstance(min_id, bytes) else min_id
            if min_id not in ("0-0", "0"):
                trims.append((key, min_id))
        if not trims:
            return 0
        xtrims = [("xtrim", (key,), {"minid": min_id, "approximate": False}) for key, min_id in trims]
        return sum(int(n) for n in batch(self.r, xtrims, cluster=self.cluster, raise_on_error=True))

    def group_ids(self, stream: str, *, undelivered_to: str | None = None, page: int = 256) -> set[str]:
        """The group ids of the message entries `stream` holds (read in bounded pages, undelivered,
        pending and acked-not-yet-trimmed alike), or with `undelivered_to`, only those consumer
        group `undelivered_to` has not been delivered yet; entries that are not this job's
        messages are skipped (their consumers dead-letter them)."""
        out: set[str] = set()
        start = "-"
        if undelivered_to is not None:
            try:
                groups = self.r.xinfo_groups(self.keys.key(stream))
            except ResponseError:  # no such stream: nothing in it
                return out
            names = (undelivered_to, undelivered_to.encode())
            g = next((g for g in groups if g["name"] in names), None)
            if g is not None:
                start = "(" + text(g["last-delivered-id"])
        while True:
            start, rows = self.reads.read(stream, "range", count=page, start=start)
            for e in rows:
                try:
                    msg = self.dead.decode(stream, e, (PromptGroup, EvalRound, Rollout, Scored))
                    out.add(msg.group_id)
                except DecodeError:
                    continue
            # A page may end early at the read's byte budget: only an empty one is the end.
            if not rows:
                return out
