"""Redis Streams plumbing: the only module in the project that issues stream commands.

Semantics (DESIGN.md, data flow): consumers read with XREADGROUP, handle, write the ledger, publish
downstream, then XACK. Entries left pending by a dead consumer are reclaimed with XAUTOCLAIM after
`claim_idle_ms`; an entry delivered more than `max_deliveries` times, or one that fails decoding or
validation, goes to `{job}:dead` with the reason and is acked so the consumer keeps going.

Works against Redis 7.0 and the embedded 6.2 server (no newer commands).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker.redis_retry import OutageRetry
from shared.schema import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DeadLetter,
    DecodeError,
    Message,
    decode,
    encode,
)
from shared.settings import CommonSettings

M = TypeVar("M", bound=Message)
R = TypeVar("R")
# The message kind(s) a consumer accepts on a stream: anything else is dead-lettered.
Expected = type[Message] | tuple[type[Message], ...]

log = logging.getLogger(__name__)

FIELD = b"d"  # each entry carries one field holding the msgpack body

PROMPTS, ROLLOUTS, SCORED, POLICY, CONTROL, DEAD = "prompts", "rollouts", "scored", "policy", "control", "dead"
GROUP_GENERATORS, GROUP_REWARDERS, GROUP_TRAINERS = "generators", "rewarders", "trainers"


# publish_if_owned: KEYS = (source stream, output stream); ARGV = group, consumer, field name, then
# per source entry: its id, the number of messages n, n encoded messages.
_PUBLISH_IF_OWNED = """
local out = {}
local i = 4
while i <= #ARGV do
  local eid, n = ARGV[i], tonumber(ARGV[i + 1])
  local held = redis.call('XPENDING', KEYS[1], ARGV[1], eid, eid, 1, ARGV[2])
  if #held == 1 then
    for j = 1, n do
      redis.call('XADD', KEYS[2], '*', ARGV[3], ARGV[i + 1 + j])
    end
    redis.call('XACK', KEYS[1], ARGV[1], eid)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
  i = i + 2 + n
end
return out
"""


def connect(url: str, *, outage_s: float | None = None, socket_timeout_s: float | None = None) -> redis.Redis:
    """A client whose commands ride out a Redis outage: connection and timeout errors are retried
    with back-off for up to `outage_s` seconds (default: the REDIS_OUTAGE_S setting, 600;
    broker.redis_retry).
    A request path that must answer fast passes a small `outage_s` and a `socket_timeout_s`.

    `url` is any redis-py URL: `redis://[[user]:password@]host:port/db` for AUTH (a user name
    means an ACL user, none the `default` user / requirepass), `rediss://...` for TLS with the
    certificate options as query parameters, e.g.
    `rediss://host:6380/0?ssl_ca_certs=/etc/ca.pem&ssl_certfile=c.pem&ssl_keyfile=k.pem`
    (`ssl_cert_reqs=none` turns verification off; `ssl_check_hostname=false` skips the name
    check only). Wrong credentials raise redis.exceptions.AuthenticationError on the first
    command, without retries.
    """
    timeouts = {} if socket_timeout_s is None else {"socket_timeout": socket_timeout_s,
                                                       "socket_connect_timeout": socket_timeout_s}
    return redis.Redis.from_url(
        url,
        retry=OutageRetry(CommonSettings().redis_outage_s if outage_s is None else outage_s),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=30,
        socket_keepalive=True,
        **timeouts,
    )


@dataclass(frozen=True)
class Delivery:
    """One decoded stream entry handed to a consumer; ack it with `JobStreams.ack(stream, group, [entry_id])`."""

    entry_id: str
    message: Message
    deliveries: int = 1


class JobStreams:
    """All streams of one job: `{prefix}{job_id}:{name}`."""

    def __init__(
        self,
        client: redis.Redis,
        job_id: str,
        *,
        prefix: str = "rl:",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        claim_idle_ms: int = 60_000,
        max_deliveries: int = 5,
    ):
        # redis-py's annotations mix its sync and async return types; responses are handled
        # dynamically here, byte keys and all.
        self.r: Any = client
        self.job_id = job_id
        self.prefix = prefix
        self.max_message_bytes = max_message_bytes
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        # Called with (stream, code) for every dead-lettered entry: services count them in their
        # metrics (shared.metrics *.dead_letter). Set by the service after construction.
        self.on_dead_letter: Callable[[str, str], None] | None = None
        self._last_claim: dict[tuple[str, str], float] = {}
        self._publish_script: Any = None

    def key(self, stream: str) -> str:
        return f"{self.prefix}{self.job_id}:{stream}"

    # -- set-up -------------------------------------------------------------------------------
    def ensure_group(self, stream: str, group: str, start_id: str = "0") -> None:
        """Create the consumer group (and the stream) if missing; idempotent."""
        try:
            self.r.xgroup_create(self.key(stream), group, id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- produce ------------------------------------------------------------------------------
    def publish(self, stream: str, msg: Message) -> str:
        return self.publish_many(stream, [msg])[0]

    def publish_many(self, stream: str, msgs: Iterable[Message]) -> list[str]:
        """XADD each message in one round trip, as one MULTI/EXEC transaction; returns the entry
        ids. Atomic on purpose: without it a reader blocked on the stream is woken by the first XADD
        and takes one entry of a batch the feeder published together (a generate call of 1 group,
        then one of the other 7), and small generate calls cost generator throughput."""
        pipe = self.r.pipeline(transaction=True)
        key = self.key(stream)
        n = 0
        for m in msgs:
            pipe.xadd(key, {FIELD: encode(m)})
            n += 1
        if n == 0:
            return []
        return [i.decode() if isinstance(i, bytes) else i for i in pipe.execute()]

    def publish_raw(self, stream: str, fields: dict) -> str:
        """XADD arbitrary fields (tests use it to inject malformed entries)."""
        eid = self.r.xadd(self.key(stream), fields)
        return eid.decode() if isinstance(eid, bytes) else eid

    # -- consume (consumer groups) -----------------------------------------------------------
    def consume(
        self,
        stream: str,
        group: str,
        consumer: str,
        expected: Expected,
        *,
        count: int = 64,
        block_ms: int | None = 1000,
    ) -> list[Delivery]:
        """Read up to `count` entries for this consumer: first reclaim idle ones, then new ones.

        Entries that fail to decode, or that were delivered too often, are dead-lettered and acked
        here; the caller only ever sees valid messages. A vanished stream or group is recreated.
        """
        out = self._reclaim(stream, group, consumer, expected, count)
        if len(out) >= count:
            return out
        try:
            resp = self.r.xreadgroup(
                group, consumer, {self.key(stream): ">"}, count=count - len(out), block=block_ms
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("stream %s or group %s vanished; recreating", self.key(stream), group)
            self.ensure_group(stream, group)
            return out
        for _key, entries in resp or []:
            for eid, fields in entries:
                d = self._decode_entry(stream, group, eid, fields, expected, deliveries=1)
                if d is not None:
                    out.append(d)
        return out

    def consume_own_pending(
        self, stream: str, group: str, consumer: str, expected: Expected, *, count: int = 64
    ) -> list[Delivery]:
        """Entries already delivered to `consumer` and not acked: what a restarted consumer of the
        same name left in flight (XREADGROUP with id 0). Call it at start-up, until it returns
        nothing, before reading new entries; each read counts one delivery."""
        key = self.key(stream)
        try:
            resp = self.r.xreadgroup(group, consumer, {key: "0"}, count=count)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group(stream, group)
            return []
        entries = [(eid, fields) for _key, es in resp or [] for eid, fields in es]
        gone = [eid for eid, fields in entries if not fields]  # deleted while pending: nothing to redo
        if gone:
            self.ack(stream, group, [e.decode() if isinstance(e, bytes) else e for e in gone])
        entries = [(eid, fields) for eid, fields in entries if fields]
        out = self._decode_redelivered(key, stream, group, entries, expected)
        if out:
            log.warning("resuming %d entries %s left pending on %s", len(out), consumer, key)
        return out

    def publish_if_owned(
        self, stream: str, batches: list[tuple[str, list[Message]]], source: str, group: str, consumer: str
    ) -> list[bool]:
        """For each (entry id of `source`, messages): if `consumer` still holds the entry pending in
        `group`, XADD the messages to `stream` and XACK the entry, all in one atomic script;
        returns which entries were published.

        A consumer whose entry was reclaimed meanwhile (it looked dead: idle past claim_idle_ms),
        or that was acked already, publishes nothing: the claimer's copy is the only one, so a
        redelivered input never yields two different outputs. Atomic, so a crash leaves either
        both the outputs and the ack or neither (AOF logs a script's effects as one MULTI/EXEC).
        """
        if not batches:
            return []
        args: list[Any] = [group, consumer, FIELD]
        for entry_id, msgs in batches:
            args += [entry_id, len(msgs), *(encode(m) for m in msgs)]
        if self._publish_script is None:
            self._publish_script = self.r.register_script(_PUBLISH_IF_OWNED)
        done = self._publish_script(keys=[self.key(source), self.key(stream)], args=args)
        return [bool(x) for x in done]

    def _reclaim(self, stream: str, group: str, consumer: str, expected: Expected, count: int) -> list[Delivery]:
        now = time.monotonic()
        # XAUTOCLAIM scans the PEL; once per idle period per stream is enough.
        if now - self._last_claim.get((stream, group), 0.0) < self.claim_idle_ms / 2000.0:
            return []
        self._last_claim[(stream, group)] = now
        key = self.key(stream)
        try:
            resp = self.r.xautoclaim(key, group, consumer, min_idle_time=self.claim_idle_ms, start_id="0-0", count=count)
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                self.ensure_group(stream, group)
                return []
            raise
        claimed = resp[1] if resp else []
        if not claimed:
            return []
        if any(fields is None for _, fields in claimed):
            # Deleted while pending: Redis 6.2 answers nil without the id and moves the entry to
            # our PEL (7.0 drops it itself); ack it there so it does not pin trim_acked's MINID.
            for p in self.r.xpending_range(key, group, min="-", max="+", count=1000, consumername=consumer):
                if not self.r.xrange(key, min=p["message_id"], max=p["message_id"], count=1):
                    self.ack(stream, group, [p["message_id"]])
            claimed = [(eid, fields) for eid, fields in claimed if fields is not None]
        out = self._decode_redelivered(key, stream, group, claimed, expected)
        if out:
            log.warning("reclaimed %d idle entries from %s", len(out), key)
        return out

    def _decode_redelivered(
        self, key: str, stream: str, group: str, entries: list, expected: Expected
    ) -> list[Delivery]:
        """Decode entries delivered before (own pending or reclaimed), each with its delivery count."""
        counts = self._delivery_counts(key, group, [eid for eid, _ in entries])
        out = []
        for eid, fields in entries:
            eid_s = eid.decode() if isinstance(eid, bytes) else eid
            d = self._decode_entry(stream, group, eid, fields, expected, deliveries=counts.get(eid_s, 1))
            if d is not None:
                out.append(d)
        return out

    def _delivery_counts(self, key: str, group: str, ids: list) -> dict[str, int]:
        res: dict[str, int] = {}
        for eid in ids:
            for p in self.r.xpending_range(key, group, min=eid, max=eid, count=1):
                mid = p["message_id"]
                res[mid.decode() if isinstance(mid, bytes) else mid] = int(p["times_delivered"])
        return res

    def _decode_entry(
        self, stream: str, group: str, eid, fields: dict, expected: Expected, *, deliveries: int
    ) -> Delivery | None:
        eid_s = eid.decode() if isinstance(eid, bytes) else eid
        raw = fields.get(FIELD) if fields else None
        if raw is None and fields:
            raw = fields.get(FIELD.decode())
        try:
            if raw is None:
                raise DecodeError(
                    f"entry has no '{FIELD.decode()}' field (fields: {sorted(map(str, fields or {}))})", "malformed"
                )
            msg = decode(raw, expected, max_bytes=self.max_message_bytes)
            if msg.job_id != self.job_id:
                raise DecodeError(f"message for job '{msg.job_id}' on a stream of job '{self.job_id}'", "wrong_job")
        except DecodeError as exc:
            self.dead_letter(stream, group, eid_s, exc.reason, raw if isinstance(raw, bytes) else b"", code=exc.code)
            return None
        if deliveries > self.max_deliveries:
            self.dead_letter(
                stream, group, eid_s, f"delivered {deliveries} times (limit {self.max_deliveries})", raw,
                code="max_deliveries",
            )
            return None
        return Delivery(eid_s, msg, deliveries)

    def dead_letter(
        self, stream: str, group: str | None, entry_id: str, reason: str, raw: bytes = b"", *, code: str = "rejected"
    ) -> None:
        """Move one entry to `{job}:dead` with the reason, then ack it so it is not redelivered.

        `code` is a short fixed word for metrics (shared.schema.REJECT_CODES or the consumer's own).
        """
        log.error("dead-lettering %s %s (%s): %s", self.key(stream), entry_id, code, reason)
        dl = DeadLetter(
            job_id=self.job_id,
            msg_id=f"{stream}/{entry_id}",
            policy_version=0,
            stream=stream,
            entry_id=entry_id,
            reason=reason,
            code=code,
            raw=raw[: min(len(raw), 64 * 1024)],
        )
        self.r.xadd(self.key(DEAD), {FIELD: encode(dl), b"reason": reason.encode()[:1024]})
        if group is not None:
            self.ack(stream, group, [entry_id])
        if self.on_dead_letter is not None:
            self.on_dead_letter(stream, code)

    def ack(self, stream: str, group: str, entry_ids: list[str]) -> int:
        if not entry_ids:
            return 0
        return int(self.r.xack(self.key(stream), group, *entry_ids))

    def pending_count(self, stream: str, group: str) -> int:
        try:
            return int(self.r.xpending(self.key(stream), group)["pending"])
        except ResponseError:
            return 0

    def trim_acked(self, stream: str, group: str) -> int:
        """Trim with MINID at the oldest pending entry (or the group's last delivered id).

        Never MAXLEN: that could drop entries nobody has acked yet.
        """
        key = self.key(stream)
        try:
            pend = self.r.xpending(key, group)
        except ResponseError:
            return 0
        if pend["pending"]:
            min_id = pend["min"]
        else:
            groups = {g["name"]: g for g in self.r.xinfo_groups(key)}
            g = groups.get(group.encode()) or groups.get(group)
            if g is None:
                return 0
            min_id = g["last-delivered-id"]
            # Keep the last delivered entry itself; trim only what precedes it.
        min_id = min_id.decode() if isinstance(min_id, bytes) else min_id
        if min_id in ("0-0", "0"):
            return 0
        return int(self.r.xtrim(key, minid=min_id, approximate=False))

    def trim_broadcast(self, stream: str, keep: int) -> int:
        """Keep the newest `keep` entries of a broadcast stream (no group, so nothing is pending;
        late joiners start from the newest entry)."""
        return int(self.r.xtrim(self.key(stream), maxlen=keep, approximate=False))

    # -- broadcast streams (policy, control): plain XREAD, every reader sees everything -----------
    def read_broadcast(
        self, stream: str, last_id: str, expected: type[M], *, block_ms: int | None = None, count: int = 100
    ) -> tuple[str, list[M]]:
        """Messages after `last_id`; returns (new last_id, messages). Invalid entries are skipped
        (dead-lettered once, by id, without a group)."""
        resp = self.r.xread({self.key(stream): last_id}, count=count, block=block_ms)
        msgs: list[M] = []
        for _key, entries in resp or []:
            for eid, fields in entries:
                last_id = eid.decode() if isinstance(eid, bytes) else eid
                raw = fields.get(FIELD)
                try:
                    if raw is None:
                        raise DecodeError("entry has no 'd' field", "malformed")
                    msg = decode(raw, expected, max_bytes=self.max_message_bytes)
                    if msg.job_id != self.job_id:
                        raise DecodeError(
                            f"message for job '{msg.job_id}' on a stream of job '{self.job_id}'", "wrong_job"
                        )
                    msgs.append(msg)
                except DecodeError as exc:
                    self.dead_letter(stream, None, last_id, exc.reason, raw or b"", code=exc.code)
        return last_id, msgs

    def latest(self, stream: str, expected: type[M]) -> tuple[str, M] | None:
        """The newest valid message on a broadcast stream (a late joiner's starting point)."""
        for eid, fields in self.r.xrevrange(self.key(stream), count=20):
            try:
                msg = decode(fields.get(FIELD, b""), expected, max_bytes=self.max_message_bytes)
            except DecodeError:
                continue
            if msg.job_id != self.job_id:  # as read_broadcast: never another job's message
                continue
            return (eid.decode() if isinstance(eid, bytes) else eid), msg
        return None

    # -- generator heartbeats (a hash, not a stream; kept here so Redis access stays in one place) --
    def heartbeat(self, worker_id: str, fields: dict) -> None:
        body = dict(fields, ts=time.time())
        self.r.hset(self.key("generators"), worker_id, json.dumps(body))

    def heartbeats(self) -> dict[str, dict]:
        raw = self.r.hgetall(self.key("generators"))
        return {(k.decode() if isinstance(k, bytes) else k): json.loads(v) for k, v in raw.items()}

    def length(self, stream: str) -> int:
        return int(self.r.xlen(self.key(stream)))

    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        out = []
        for _eid, fields in self.r.xrange(self.key(DEAD), count=count):
            out.append(decode(fields[FIELD], DeadLetter))
        return out

    def delete_all(self) -> None:
        self.r.delete(*[self.key(s) for s in (PROMPTS, ROLLOUTS, SCORED, POLICY, CONTROL, DEAD, "generators")])
