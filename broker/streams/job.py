"""`JobStreams`: every stream of one job behind one object, each concern in a part of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import redis
from redis.cluster import RedisCluster

from shared.schema import DEFAULT_MAX_MESSAGE_BYTES, DeadLetter, Message

from .broadcast import Broadcast, Heartbeats
from .dead_letters import DeadLetters
from .entries import Consumer, Delivery, M
from .epoch import Epoch
from .groups import Groups
from .keys import JOB_KEYS, JobKeys, adopt_legacy_keys
from .publishing import Batches, Publisher
from .reads import Reads
from .scripts import Scripts
from .wakeups import Wakeups


class JobStreams:
    """All streams of one job: `{prefix}{{job_id}}:{name}` (the braces are Redis Cluster's hash
    tag: every key of a job in one slot, see `key`).

    Memory: every read is sized before anything crosses the wire (the READ script): a reply
    holds at most `max_read_bytes + max_message_bytes` of entry payload (default 3 x 8 MiB), and an
    entry over `max_message_bytes` is dead-lettered from its size and its first 64 KiB alone, never
    transferred whole. A client without the `@scripting` ACL category falls back to plain
    XREADGROUP / XAUTOCLAIM / XRANGE, sizes checked after the transfer (bounded per entry only by
    the server's proto-max-bulk-len); it logs a warning saying so.

    A facade: the work is done by its parts, each method below names the one it hands to. Key
    names (`JobKeys`), the Lua scripts (`Scripts`), bounded reads (`Reads`), decoding and dead
    letters (`DeadLetters`), the readers' wake-ups (`Wakeups`), producing (`Publisher`), consumer
    groups (`Groups`), broadcast streams (`Broadcast`), generator heartbeats (`Heartbeats`) and the
    epoch key (`Epoch`).
    """

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        job_id: str,
        *,
        prefix: str = "rl:",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        claim_idle_ms: int = 60_000,
        max_deliveries: int = 5,
        max_read_bytes: int | None = None,
    ):
        # redis-py's annotations mix its sync and async return types; responses are handled
        # dynamically here, byte keys and all.
        self.r: Any = client
        # A cluster client: no MULTI/EXEC with PUBLISH, no pipelines (see OutageCluster).
        self.cluster = isinstance(client, RedisCluster)
        keys = self._keys = JobKeys(prefix, job_id)
        scripts = self._scripts = Scripts(client)
        wakeups = Wakeups(client, keys)
        # Payload one read returns (plus at most one more entry): two full-size messages by default.
        if max_read_bytes is None:
            max_read_bytes = 2 * max_message_bytes
        reads = self._reads = Reads(
            client, keys, scripts, max_message_bytes=max_message_bytes, max_read_bytes=max_read_bytes
        )
        self._dead = DeadLetters(client, keys, reads, max_deliveries=max_deliveries)
        self._publisher = Publisher(client, keys, scripts, wakeups, cluster=self.cluster)
        self._groups = Groups(
            client, keys, scripts, reads, self._dead, wakeups, claim_idle_ms=claim_idle_ms, cluster=self.cluster
        )
        self._broadcast = Broadcast(client, keys, reads, self._dead, wakeups)
        self._heartbeats = Heartbeats(client, keys)
        self._epoch = Epoch(client, keys)

    # -- the job and its limits (read-only: the parts hold them) -----------------------------
    @property
    def job_id(self) -> str:
        return self._keys.job_id

    @property
    def prefix(self) -> str:
        return self._keys.prefix

    @property
    def max_message_bytes(self) -> int:
        return self._reads.max_message_bytes

    @property
    def max_read_bytes(self) -> int:
        return self._reads.max_read_bytes

    @property
    def claim_idle_ms(self) -> int:
        return self._groups.claim_idle_ms

    @property
    def max_deliveries(self) -> int:
        return self._dead.max_deliveries

    @property
    def on_dead_letter(self) -> Callable[[str, str], None] | None:
        """Called with (stream, code) for every dead-lettered entry: services count them in their
        metrics (shared.metrics *.dead_letter). Set by the service after construction."""
        return self._dead.on_dead_letter

    @on_dead_letter.setter
    def on_dead_letter(self, callback: Callable[[str, str], None] | None) -> None:
        self._dead.on_dead_letter = callback

    # -- keys (JobKeys) ----------------------------------------------------------------------
    def key(self, stream: str) -> str:
        """`{prefix}{{job_id}}:{stream}`: every key of the job in one cluster slot
        (`JobKeys.key`)."""
        return self._keys.key(stream)

    def legacy_key(self, stream: str) -> str:
        """The key's name before hash tags (`JobKeys.legacy_key`)."""
        return self._keys.legacy_key(stream)

    def adopt_legacy_keys(self) -> list[str]:
        """Rename the job's keys from before hash tags to their current names; returns those
        renamed (`keys.adopt_legacy_keys`). Every service calls it when it opens its job."""
        return adopt_legacy_keys(self.r, self._keys, cluster=self.cluster)

    def length(self, stream: str) -> int:
        return int(self.r.xlen(self.key(stream)))

    def delete_all(self) -> None:
        self.r.delete(*[self.key(s) for s in JOB_KEYS])

    # -- produce (Publisher) -----------------------------------------------------------------
    def publish(self, stream: str, msg: Message) -> str:
        return self._publisher.publish_many(stream, [msg])[0]

    def publish_many(self, stream: str, msgs: Iterable[Message]) -> list[str]:
        """XADD the messages as one transaction, then wake the stream's readers; returns the
        entry ids (`Publisher.publish_many`)."""
        return self._publisher.publish_many(stream, msgs)

    def publish_raw(self, stream: str, fields: dict) -> str:
        """XADD arbitrary fields (tests use it to inject malformed entries)."""
        return self._publisher.publish_raw(stream, fields)

    def publish_if_owned(self, c: Consumer, stream: str, batches: Batches) -> list[bool]:
        """Publish each entry's outputs and ack it, atomically, if `c` still holds it
        (`Publisher.publish_if_owned`); returns which entries were published."""
        return self._publisher.publish_if_owned(c, stream, batches)

    # -- consumer groups (Groups) ------------------------------------------------------------
    def ensure_group(self, stream: str, group: str, start_id: str = "0") -> None:
        """Create the consumer group (and the stream) if missing; idempotent."""
        self._groups.ensure_group(stream, group, start_id)

    def consume(self, c: Consumer[M], *, count: int = 64, block_ms: int | None = 1000) -> list[Delivery[M]]:
        """Up to `count` valid messages for `c`, idle ones reclaimed first (`Groups.consume`)."""
        return self._groups.consume(c, count=count, block_ms=block_ms)

    def consume_own_pending(self, c: Consumer[M], *, count: int = 64) -> list[Delivery[M]]:
        """What a predecessor of the same name left pending (`Groups.consume_own_pending`)."""
        return self._groups.consume_own_pending(c, count=count)

    def claim_all(self, c: Consumer[M]) -> list[Delivery[M]]:
        """Claim every entry pending in `c`'s group, at start-up (`Groups.claim_all`)."""
        return self._groups.claim_all(c)

    def touch(self, c: Consumer, entry_ids: list[str]) -> list[bool]:
        """Keep entries `c` still works on from being reclaimed (`Groups.touch`)."""
        return self._groups.touch(c, entry_ids)

    def ack(self, stream: str, group: str, entry_ids: list[str]) -> int:
        return self._groups.ack(stream, group, entry_ids)

    def pending_count(self, stream: str, group: str) -> int:
        return self._groups.pending_count(stream, group)

    def trim_acked(self, stream: str, group: str) -> int:
        """Trim with MINID at the oldest pending entry (or the group's last delivered id).

        Never MAXLEN: that could drop entries nobody has acked yet.
        """
        return self._groups.trim_acked_many([(stream, group)])

    def trim_acked_many(self, pairs: Iterable[tuple[str, str]]) -> int:
        """`trim_acked` of each (stream, group) in two round trips (`Groups.trim_acked_many`)."""
        return self._groups.trim_acked_many(pairs)

    def group_ids(self, stream: str, *, undelivered_to: str | None = None, page: int = 256) -> set[str]:
        """The group ids of the entries `stream` holds, or those not yet delivered to group
        `undelivered_to` (`Groups.group_ids`)."""
        return self._groups.group_ids(stream, undelivered_to=undelivered_to, page=page)

    # -- dead letters (DeadLetters) ----------------------------------------------------------
    def dead_letter(
        self,
        stream: str,
        group: str | None,
        entry_id: str,
        reason: str,
        raw: bytes = b"",
        *,
        code: str = "rejected",
        message: Message | None = None,
    ) -> None:
        """Move one entry to `{job}:dead` with the reason, then ack it so it is not redelivered
        (`DeadLetters.dead_letter`)."""
        self._dead.dead_letter(stream, group, entry_id, reason, raw, code=code, message=message)

    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        """The oldest `count` dead letters (`DeadLetters.oldest`)."""
        return self._dead.oldest(count)

    # -- broadcast streams (Broadcast) and heartbeats (Heartbeats) ---------------------------
    def read_broadcast(
        self,
        stream: str,
        last_id: str,
        expected: type[M],
        *,
        block_ms: int | None = None,
        count: int = 100,
    ) -> tuple[str, list[M]]:
        """Messages after `last_id`, waiting up to `block_ms` for one (`Broadcast.read`)."""
        return self._broadcast.read(stream, last_id, expected, block_ms=block_ms, count=count)

    def latest(self, stream: str, expected: type[M]) -> tuple[str, M] | None:
        """The newest valid message of a broadcast stream (`Broadcast.latest`)."""
        return self._broadcast.latest(stream, expected)

    def trim_broadcast(self, stream: str, keep: int) -> int:
        """Keep the newest `keep` entries of a broadcast stream (`Broadcast.trim`)."""
        return self._broadcast.trim(stream, keep)

    def heartbeat(self, worker_id: str, fields: dict) -> None:
        self._heartbeats.beat(worker_id, fields)

    def heartbeats(self) -> dict[str, dict]:
        return self._heartbeats.all()

    # -- the epoch key (Epoch) ------------------------------------------------------------------
    def stamp_epoch(self, token: str) -> None:
        """Write the job's epoch token (`Epoch.stamp`): its absence later means Redis lost the
        job's state."""
        self._epoch.stamp(token)

    def epoch(self) -> str | None:
        """The job's epoch token, None when Redis holds none (`Epoch.read`)."""
        return self._epoch.read()

    # -- what tests look at -----------------------------------------------------------------
    @property
    def _scripted(self) -> bool:
        return self._scripts.enabled

    def _wake_channel(self, stream: str) -> str:
        return self._keys.wake_channel(stream)

    @property
    def _last_claim(self) -> dict[tuple[str, str], float]:
        return self._groups.last_claim
