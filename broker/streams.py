"""Redis Streams plumbing: the only module in the project that issues stream commands.

Semantics: consumers read with XREADGROUP, handle, write the ledger, publish downstream, then
XACK. Entries left pending by a dead consumer are reclaimed with XAUTOCLAIM after
`claim_idle_ms` (a live consumer whose work outlasts that keeps its entries with `touch`); an entry delivered more than `max_deliveries` times, or one that fails decoding or
validation, goes to `{job}:dead` with the reason and is acked so the consumer keeps going.

Bounded memory: every read is sized on the server before anything is transferred (the `_READ`
script): a consumer holds at most `max_read_bytes + max_message_bytes` of entry payload per read,
and an entry over `max_message_bytes` is dead-lettered from its size alone (see `JobStreams`).

Works against Redis 7.0 and the embedded 6.2 server (no newer commands).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    ClusterDownError,
    NoPermissionError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from broker.redis_retry import OutageRetry
from shared.ids import dead_letter_id
from shared.schema import (
    DEAD_RAW_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DeadLetter,
    DecodeError,
    EvalRound,
    Message,
    PromptGroup,
    Rollout,
    Scored,
    clean_text,
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


# publish_if_owned: KEYS = (source stream, output stream); ARGV = group, consumer, field name, the
# output stream's wake-up channel, then per source entry: its id, the number of messages n, n
# encoded messages. Publishes one wake-up (JobStreams._wait) when it added anything.
_PUBLISH_IF_OWNED = """
local out = {}
local added = false
local i = 5
while i <= #ARGV do
  local eid, n = ARGV[i], tonumber(ARGV[i + 1])
  local held = redis.call('XPENDING', KEYS[1], ARGV[1], eid, eid, 1, ARGV[2])
  if #held == 1 then
    for j = 1, n do
      redis.call('XADD', KEYS[2], '*', ARGV[3], ARGV[i + 1 + j])
      added = true
    end
    redis.call('XACK', KEYS[1], ARGV[1], eid)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
  i = i + 2 + n
end
-- pcall: a user without PUBLISH rights (no @pubsub in its ACL) still publishes; readers poll
if added then redis.pcall('PUBLISH', ARGV[4], '') end
return out
"""


# publish_many on a cluster (whose client refuses PUBLISH inside MULTI/EXEC): KEYS = (stream,);
# ARGV = field name, wake-up channel ('' for none), encoded messages. XADDs them all, then wakes.
_PUBLISH_MANY = """
local ids = {}
for i = 3, #ARGV do ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[i]) end
if ARGV[2] ~= '' then redis.pcall('PUBLISH', ARGV[2], '') end
return ids
"""


# touch: KEYS = (stream,); ARGV = group, consumer, entry ids. Each entry still pending for the
# consumer is XCLAIMed by it again with JUSTID: its idle time starts over, its delivery count is
# kept. Returns 1 per entry held, 0 per entry acked or taken over (left alone).
_TOUCH = """
local out = {}
for i = 3, #ARGV do
  local held = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #held == 1 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

# -- bounded reads -----------------------------------------------------------------------------
# _READ: one script for every read, so a consumer never receives an entry it has not sized.
# KEYS = (stream,); ARGV = mode, group, consumer, count, max entry bytes, max read bytes, start,
# min idle ms (claim), field name, bytes kept of an oversized entry, max fields per entry.
# Modes: "new" (XREADGROUP >), "pending" (XREADGROUP from `start` in the consumer's own PEL),
# "claim" (XAUTOCLAIM from cursor `start`), "range"/"revrange" (XRANGE / XREVRANGE from `start`).
# Entries are taken one at a time until `count` or until the bytes returned reach max read bytes:
# the reply holds at most max read bytes + max entry bytes of payload. An entry over max entry
# bytes (or with too many fields) comes back as its id, its size and the first bytes of its
# payload only, and is still delivered (pending), so the caller can dead-letter and ack it.
# Returns {next start / cursor, {{id, status, payload or size, deliveries, prefix}, ...}}.
_READ = """
local key, mode, group, consumer = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local count, max_entry, budget = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local start, min_idle, field = ARGV[7], ARGV[8], ARGV[9]
local keep, max_fields = tonumber(ARGV[10]), tonumber(ARGV[11])
local out, total = {}, 0

local function times_delivered(id)
  local p = redis.call('XPENDING', key, group, id, id, 1)
  if #p == 1 then return p[1][4] end
  return 1
end

local function take(id, fields, n)
  if #fields > 2 * max_fields then
    out[#out + 1] = {id, 'fields', #fields / 2, n, ''}
    return
  end
  local size = 0
  for i = 1, #fields do size = size + #fields[i] end
  if size > max_entry then
    local prefix = ''
    for i = 1, #fields - 1, 2 do
      if fields[i] == field then prefix = string.sub(fields[i + 1], 1, keep) end
    end
    out[#out + 1] = {id, 'big', size, n, prefix}
    return
  end
  out[#out + 1] = {id, 'ok', fields, n, ''}
  total = total + size
end

if mode == 'new' then
  while #out < count and total < budget do
    local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', key, '>')
    if not r then break end
    local e = r[1][2][1]
    take(e[1], e[2], 1)
  end
  return {'', out}
elseif mode == 'pending' then
  while #out < count and total < budget do
    local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', key, start)
    local es = r and r[1][2] or {}
    if #es == 0 then break end
    local e = es[1]
    start = e[1]
    if e[2] then
      take(start, e[2], times_delivered(start))
    else
      redis.call('XACK', key, group, start)  -- deleted while pending: nothing to redo
    end
  end
  return {start, out}
elseif mode == 'claim' then
  local calls, gone = 0, false
  while #out < count and total < budget and calls < count do
    calls = calls + 1
    local r = redis.call('XAUTOCLAIM', key, group, consumer, min_idle, start, 'COUNT', 1)
    start = r[1]
    for _, e in ipairs(r[2]) do
      if type(e) == 'table' and e[2] then
        take(e[1], e[2], times_delivered(e[1]))
      else
        gone = true
      end
    end
    if start == '0-0' then break end
  end
  if gone then
    -- Deleted while pending: Redis 6.2 answers nil and moves the entry to our PEL (7.0 drops it
    -- itself); ack it there so it does not pin trim_acked's MINID.
    for _, p in ipairs(redis.call('XPENDING', key, group, '-', '+', 1000, consumer)) do
      if #redis.call('XRANGE', key, p[1], p[1]) == 0 then redis.call('XACK', key, group, p[1]) end
    end
  end
  return {start, out}
else
  local cmd, stop = 'XRANGE', '+'
  if mode == 'revrange' then cmd, stop = 'XREVRANGE', '-' end
  while #out < count and total < budget do
    local es = redis.call(cmd, key, start, stop, 'COUNT', 1)
    if #es == 0 then break end
    local e = es[1]
    start = '(' .. e[1]
    take(e[1], e[2], 0)
  end
  return {start, out}
end
"""

# A stream entry carries one field (FIELD); dead letters two (FIELD, "reason"). More is not ours.
_MAX_FIELDS = 8
# A dead letter holds up to DEAD_RAW_BYTES of the entry plus its reason (twice): the dead stream
# admits that much whatever MAX_MESSAGE_BYTES is.
_DEAD_ENTRY_BYTES = DEAD_RAW_BYTES + 32 * 1024
# The wait of a blocking read (scripts cannot block): 2 ms, doubling to 50 ms while idle. Used
# where the wake-up channel is not available (JobStreams._wait).
_IDLE_POLL = ExponentialBackoff(cap=0.05, base=0.002)
# With the wake-up channel subscribed, the longest wait between two reads: a lost wake-up (the
# subscription itself is racing the first entry) costs at most this.
_WAKE_POLL_S = 0.1

# A Redis Cluster is named by its URL's scheme: `redis+cluster://host:port` (`rediss+cluster://`
# for TLS), any one node as the seed; the rest of the URL is as for a single server.
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def is_cluster_url(url: str) -> bool:
    return url.lower().startswith(CLUSTER_SCHEMES)


def plain_url(url: str) -> str:
    """`url` with the `+cluster` of its scheme removed: what redis-py parses."""
    if not is_cluster_url(url):
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme[: -len('+cluster')]}://{rest}"


# A cluster client's own retries (each refreshes the slot map) before OutageCluster backs off.
_CLUSTER_TRIES = 3


class OutageCluster(RedisCluster):
    """redis-py's cluster client riding out outages like `connect`'s single-server client.

    redis-py retries a cluster command a fixed number of times, refreshing its slot map in
    between but without waiting, so a primary that died takes the command down with it before
    its replica is promoted (cluster-node-timeout plus an election, seconds). Here each command is
    wrapped in the same time-bounded OutageRetry: it waits out the failover and goes to the new
    primary. Pipelines are not wrapped (JobStreams issues none to a cluster, see `JobStreams.cluster`).
    """

    def __init__(self, *, outage: OutageRetry, **kwargs: Any):
        self.outage = outage  # first: the constructor already runs commands (COMMAND, CLUSTER SLOTS)
        self.outage.update_supported_errors([ClusterDownError, SlotNotCoveredError, TryAgainError, RedisClusterException])
        super().__init__(retry=Retry(NoBackoff(), _CLUSTER_TRIES), **kwargs)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        call = super().execute_command
        return self.outage.call_with_retry(lambda: call(*args, **kwargs), lambda _error: None, _transient)


def _transient(error: Exception) -> bool:
    """Whether a cluster command's error may pass with time: a connection or cluster-state error,
    or redis-py's topology refresh finding no node to ask (it raises RedisClusterException then,
    which otherwise means a misuse, such as keys of two slots in one command)."""
    if isinstance(error, RedisClusterException) and not isinstance(error, (ClusterDownError, SlotNotCoveredError)):
        return "cannot be connected" in str(error)
    return True


def connect(url: str, *, outage_s: float | None = None, socket_timeout_s: float | None = None) -> Any:
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

    `redis+cluster://host:port` (or `rediss+cluster://`) selects a Redis Cluster: redis-py's
    RedisCluster (`OutageCluster`), seeded by that node, db 0 only. Every key of a job shares one
    hash slot (`JobStreams.key`), so the job's scripts and transactions run on one shard; jobs
    spread over the shards by their ids.
    """
    timeouts = {} if socket_timeout_s is None else {"socket_timeout": socket_timeout_s,
                                                       "socket_connect_timeout": socket_timeout_s}
    outage = OutageRetry(CommonSettings().redis_outage_s if outage_s is None else outage_s)
    if is_cluster_url(url):
        return OutageCluster(url=plain_url(url), outage=outage, health_check_interval=30, socket_keepalive=True,
                             **timeouts)
    return redis.Redis.from_url(
        url,
        retry=outage,
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=30,
        socket_keepalive=True,
        **timeouts,
    )


@dataclass(frozen=True)
class Consumer:
    """One reader of a consumer group: the stream it reads, its group, its name in the group (a
    restarted process of the same name resumes what its predecessor left pending), and the message
    kind(s) it accepts; anything else on the stream is dead-lettered."""

    stream: str
    group: str
    name: str
    expected: Expected


@dataclass(frozen=True)
class Delivery:
    """One decoded stream entry handed to a consumer; ack it with
    `JobStreams.ack(consumer.stream, consumer.group, [entry_id])`."""

    entry_id: str
    message: Message
    deliveries: int = 1


@dataclass(frozen=True)
class _Entry:
    """One entry as a read returns it: its fields, or (refused unread) why not and its size."""

    entry_id: str
    fields: dict | None
    refusal: str = ""  # "big" (over max_message_bytes) or "fields" (more than _MAX_FIELDS fields)
    size: int = 0
    deliveries: int = 1
    prefix: bytes = b""  # an oversized entry's first DEAD_RAW_BYTES, for its dead letter


def _identity(msg: Message) -> Message:
    """`msg` without its bulk: who it is (ids, group, sample index), not what it says."""
    if isinstance(msg, Rollout):
        return msg.model_copy(update={"prompt_ids": b"", "completion_ids": b"", "logprobs": b"", "completion": "",
                                      "answer": "", "prompt": "", "metadata": {}})
    if isinstance(msg, Scored):
        return msg.model_copy(update={"rollout": _identity(msg.rollout), "details": {}, "reward_reason": ""})
    if isinstance(msg, PromptGroup):
        return msg.model_copy(update={"prompt": "-", "prompt_ids": b"", "answer": "", "metadata": {}})
    return msg


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _field(fields: dict | None) -> Any:
    """The message field of an entry's fields (byte keys, or str keys from a decoding client)."""
    if not fields:
        return None
    raw = fields.get(FIELD)
    return fields.get(FIELD.decode()) if raw is None else raw


def _payload(e: _Entry) -> bytes:
    """What a dead letter of `e` keeps of it: the bytes of its message field, or of an oversized
    entry its first DEAD_RAW_BYTES."""
    if e.fields is None:
        return e.prefix
    raw = _field(e.fields)
    return raw if isinstance(raw, bytes) else b""


def _entry(row: list) -> _Entry:
    eid, status, payload, n, prefix = row
    status = _s(status)
    if status == "ok":
        it = iter(payload)
        return _Entry(_s(eid), dict(zip(it, it, strict=True)), deliveries=int(n))
    return _Entry(_s(eid), None, status, int(payload), int(n), bytes(prefix or b""))


# Every key of a job, by its name after the job id: what `adopt_legacy_keys` renames.
JOB_KEYS = (PROMPTS, ROLLOUTS, SCORED, POLICY, CONTROL, DEAD, "generators")


class JobStreams:
    """All streams of one job: `{prefix}{{job_id}}:{name}` (the braces are Redis Cluster's hash
    tag: every key of a job in one slot, see `key`).

    Memory: every read is sized before anything crosses the wire (the `_READ` script): a reply
    holds at most `max_read_bytes + max_message_bytes` of entry payload (default 3 x 8 MiB), and an
    entry over `max_message_bytes` is dead-lettered from its size and its first 64 KiB alone, never
    transferred whole. A client without the `@scripting` ACL category falls back to plain
    XREADGROUP / XAUTOCLAIM / XRANGE, sizes checked after the transfer (bounded per entry only by
    the server's proto-max-bulk-len); it logs a warning saying so.
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
        self.job_id = job_id
        self.prefix = prefix
        self.max_message_bytes = max_message_bytes
        # Payload one read returns (plus at most one more entry): two full-size messages by default.
        self.max_read_bytes = max_read_bytes if max_read_bytes is not None else 2 * max_message_bytes
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        # Called with (stream, code) for every dead-lettered entry: services count them in their
        # metrics (shared.metrics *.dead_letter). Set by the service after construction.
        self.on_dead_letter: Callable[[str, str], None] | None = None
        self._last_claim: dict[tuple[str, str], float] = {}
        self._claim_cursor: dict[tuple[str, str], str] = {}
        self._publish_script: Any = None
        self._read_script: Any = None
        self._touch_script: Any = None
        self._publish_many_script: Any = None
        self._scripted = True  # False once the server refused EVALSHA (no @scripting): plain reads
        self._wakeups: dict[str, Any] = {}  # stream -> its subscribed wake-up channel (redis PubSub)
        self._no_wakeups = False  # True once subscribing failed (no @pubsub in the ACL): plain polling

    def key(self, stream: str) -> str:
        """`{prefix}{{job_id}}:{stream}`: the job id in braces is the key's hash tag, so a Redis
        Cluster puts every key of the job in one slot (the slot of the job id) and the scripts
        and transactions that touch several of them run there; different jobs land in different
        slots, hence on different shards."""
        return f"{self.prefix}{{{self.job_id}}}:{stream}"

    def legacy_key(self, stream: str) -> str:
        """The key's name before hash tags (`{prefix}{job_id}:{stream}`): see `adopt_legacy_keys`."""
        return f"{self.prefix}{self.job_id}:{stream}"

    def adopt_legacy_keys(self) -> list[str]:
        """Rename the keys of a job started before keys had hash tags to their current names;
        returns the key names renamed. Every service calls it when it opens its job
        (broker.runtime.open_job), so a job that was running goes on where it was after an
        upgrade (stop its services, upgrade, start them again).

        RENAMENX per key: a key already present under its new name is left alone, as is its old
        twin (logged: a service of the old version is still writing to the job). Idempotent and
        safe when several services start at once. Nothing on a cluster: untagged keys of one job
        lie in different slots, and a cluster deployment starts with tagged keys.
        """
        if self.cluster:
            return []
        renamed = []
        for name in JOB_KEYS:
            old, new = self.legacy_key(name), self.key(name)
            try:
                if self.r.renamenx(old, new):
                    renamed.append(old)
                else:
                    log.warning("both %s and %s exist: left as they are (a service of an older version "
                                "still serves job %s?)", old, new, self.job_id)
            except ResponseError as exc:
                if "no such key" not in str(exc).lower():
                    raise
        if renamed:
            log.warning("job %s: renamed its keys from before hash tags: %s", self.job_id, ", ".join(renamed))
        return renamed

    def _wake_channel(self, stream: str) -> str:
        """The pub/sub channel a producer of `stream` publishes on after adding entries: a reader
        waiting for an entry wakes at once instead of at its next poll."""
        return f"{self.key(stream)}:wake"

    def _wait(self, stream: str, waits: int, seconds: float) -> None:
        """Wait up to `seconds` for an entry on `stream`, the `waits`-th wait of one read.

        Woken by the producers' wake-up (publish_many, publish_if_owned); the read that follows
        decides, so a lost or spurious wake-up costs only latency. The first wait of a stream
        subscribes and returns at once (the caller reads again, catching an entry added before the
        subscription). Without pub/sub (an ACL without @pubsub, an error on the channel) it
        sleeps the idle-poll back-off instead."""
        sub = self._wakeups.get(stream)
        if sub is None and not self._no_wakeups:
            try:
                sub = self.r.pubsub(ignore_subscribe_messages=True)
                sub.subscribe(self._wake_channel(stream))
                self._wakeups[stream] = sub
                return
            except redis.RedisError as exc:
                log.warning("no wake-up channel for %s (%s): waiting reads poll", self.key(stream), exc)
                self._no_wakeups = True
                sub = None
        if sub is None:
            time.sleep(min(_IDLE_POLL.compute(waits), seconds))
            return
        try:
            if sub.get_message(timeout=min(seconds, _WAKE_POLL_S)) is not None:
                while sub.get_message(timeout=0.0) is not None:  # wake-ups that queued meanwhile
                    pass
        except redis.RedisError as exc:  # the channel's connection broke: resubscribe at the next wait
            log.warning("wake-up channel of %s lost (%s)", self.key(stream), exc)
            self._wakeups.pop(stream, None)
            if isinstance(exc, redis.exceptions.NoPermissionError):  # SUBSCRIBE refused by the ACL: poll
                self._no_wakeups = True
            with suppress(redis.RedisError):
                sub.close()
            time.sleep(min(_IDLE_POLL.compute(waits), seconds))

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
        """XADD each message in one round trip, as one MULTI/EXEC transaction, then wake the
        stream's waiting readers; returns the entry ids. Atomic on purpose: without it a reader
        blocked on the stream is woken by the first XADD and takes one entry of a batch the feeder
        published together (a generate call of 1 group, then one of the other 7), and small
        generate calls cost generator throughput. On a cluster the same is one script (redis-py's
        cluster client refuses PUBLISH inside MULTI/EXEC)."""
        key = self.key(stream)
        msgs = list(msgs)
        if self.cluster and msgs:
            return self._publish_many_cluster(stream, msgs)
        pipe = self.r.pipeline(transaction=True)
        for m in msgs:
            pipe.xadd(key, {FIELD: encode(m)})
        n = len(msgs)
        if n == 0:
            return []
        if not self._no_wakeups:
            pipe.publish(self._wake_channel(stream), b"")
        try:
            ids = pipe.execute()[:n]
        except redis.exceptions.NoPermissionError as exc:
            if self._no_wakeups or "publish" not in str(exc).lower():
                raise
            # The ACL refuses PUBLISH (no @pubsub): the transaction was aborted whole, so nothing
            # was added; publish without the wake-up from now on (waiting readers poll).
            log.warning("no PUBLISH rights (%s): readers of %s poll instead of waking", exc, key)
            self._no_wakeups = True
            return self.publish_many(stream, msgs)
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    def _publish_many_cluster(self, stream: str, msgs: list[Message]) -> list[str]:
        key = self.key(stream)
        wake = "" if self._no_wakeups else self._wake_channel(stream)
        if self._scripted:
            if self._publish_many_script is None:
                self._publish_many_script = self.r.register_script(_PUBLISH_MANY)
            try:
                ids = self._publish_many_script(keys=[key], args=[FIELD, wake, *(encode(m) for m in msgs)])
                return [_s(i) for i in ids]
            except NoPermissionError as exc:
                self._no_scripts(exc)
        # No scripts: the XADDs in MULTI/EXEC (one slot), the wake-up after it.
        pipe = self.r.pipeline(transaction=True)
        for m in msgs:
            pipe.xadd(key, {FIELD: encode(m)})
        ids = pipe.execute()
        if wake:
            with suppress(redis.RedisError):
                self.r.publish(wake, b"")
        return [_s(i) for i in ids]

    def publish_raw(self, stream: str, fields: dict) -> str:
        """XADD arbitrary fields (tests use it to inject malformed entries)."""
        eid = self.r.xadd(self.key(stream), fields)
        return eid.decode() if isinstance(eid, bytes) else eid

    # -- consume (consumer groups) -----------------------------------------------------------
    def consume(
        self, c: Consumer, *, count: int = 64, block_ms: int | None = 1000
    ) -> list[Delivery]:
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
            out += self._deliver(c.stream, c.group, rows, c.expected)
            now = time.monotonic()
            if rows or out or deadline is None or now >= deadline:
                return out
            # Scripts cannot block: a wait is for the producers' wake-up (or a poll, see _wait).
            self._wait(c.stream, waits, deadline - now)
            waits += 1

    def consume_own_pending(self, c: Consumer, *, count: int = 64) -> list[Delivery]:
        """Entries already delivered to consumer `c` and not acked: what a restarted consumer of
        the same name left in flight (XREADGROUP with id 0). Call it at start-up, until it returns
        nothing, before reading new entries; each read counts one delivery. A consumer whose
        predecessor may have died of one of them passes `count=1`: each suspect is then handled
        alone, and only the one that kills it again accumulates deliveries."""
        read = self._group_read(c, "pending", count, start="0")
        out = self._deliver(c.stream, c.group, read[1], c.expected) if read else []
        if out:
            log.warning("resuming %d entries %s left pending on %s", len(out), c.name, self.key(c.stream))
        return out

    def claim_all(self, c: Consumer) -> list[Delivery]:
        """Claim every entry pending in `c`'s group, whoever holds it and however briefly idle
        (each claim counts one delivery), in reads bounded like `consume`'s. Only for a consumer
        that is alone in its group by design, at start-up (trainer_svc.checkpoint.take_over)."""
        out: list[Delivery] = []
        cursor = "0-0"
        while True:
            read = self._group_read(c, "claim", 1024, start=cursor)
            if read is None:
                return out
            cursor, rows = read
            out += self._deliver(c.stream, c.group, rows, c.expected)
            if cursor == "0-0":
                return out

    def publish_if_owned(self, c: Consumer, stream: str, batches: list[tuple[str, list[Message]]]) -> list[bool]:
        """For each (entry id of `c.stream`, messages) in
        `batches`: if consumer `c` still holds the entry pending, XADD the messages to `stream` and
        XACK the entry, all in one atomic script; returns which entries were published.

        A consumer whose entry was reclaimed meanwhile (it looked dead: idle past claim_idle_ms),
        or that was acked already, publishes nothing: the claimer's copy is the only one, so a
        redelivered input never yields two different outputs. Atomic, so a crash leaves either
        both the outputs and the ack or neither (AOF logs a script's effects as one MULTI/EXEC).
        """
        if not batches:
            return []
        if self._scripted:
            if self._publish_script is None:
                self._publish_script = self.r.register_script(_PUBLISH_IF_OWNED)
            argv: list[Any] = [c.group, c.name, FIELD, self._wake_channel(stream)]
            for entry_id, msgs in batches:
                argv += [entry_id, len(msgs), *(encode(m) for m in msgs)]
            try:
                done = self._publish_script(keys=[self.key(c.stream), self.key(stream)], args=argv)
                return [bool(x) for x in done]
            except NoPermissionError as exc:
                self._no_scripts(exc)
        return self._publish_if_owned_plain(c, stream, batches)

    def _publish_if_owned_plain(self, c: Consumer, stream: str, batches: list[tuple[str, list[Message]]]) -> list[bool]:
        """`publish_if_owned` without scripts: the ownership check and the publish are two steps,
        so a reclaim in between can still yield two copies (the trainer collapses them by msg_id)."""
        owned = []
        for entry_id, msgs in batches:
            held = self.r.xpending_range(self.key(c.stream), c.group, min=entry_id, max=entry_id, count=1,
                                         consumername=c.name)
            owned.append(bool(held))
            if held:
                pipe = self.r.pipeline(transaction=True)
                for m in msgs:
                    pipe.xadd(self.key(stream), {FIELD: encode(m)})
                pipe.xack(self.key(c.stream), c.group, entry_id)
                if not self.cluster:  # a cluster's MULTI/EXEC refuses PUBLISH: woken after it
                    pipe.publish(self._wake_channel(stream), b"")
                pipe.execute()
                if self.cluster:
                    with suppress(redis.RedisError):
                        self.r.publish(self._wake_channel(stream), b"")
        return owned

    def touch(self, c: Consumer, entry_ids: list[str]) -> list[bool]:
        """Reset the idle time of the entries consumer `c` still holds (XCLAIM by their owner with
        JUSTID: the delivery count is kept), so that no other consumer reclaims work `c` is still
        doing; returns which entries `c` held. An entry acked or taken over meanwhile is left
        alone, never taken back.

        For work that can outlast `claim_idle_ms` (a batch of multi-turn episodes): call it more
        often than that while the work makes progress; a consumer that dies (or hangs) stops
        calling it, and its entries are reclaimed as before.
        """
        if not entry_ids:
            return []
        if self._scripted:
            if self._touch_script is None:
                self._touch_script = self.r.register_script(_TOUCH)
            try:
                held = self._touch_script(keys=[self.key(c.stream)], args=[c.group, c.name, *entry_ids])
                return [bool(x) for x in held]
            except NoPermissionError as exc:
                self._no_scripts(exc)
        # Without scripts the check and the claim are two steps: an entry taken over in between
        # would be taken back (its new holder's publish_if_owned then publishes nothing).
        out = []
        for eid in entry_ids:
            held = self.r.xpending_range(self.key(c.stream), c.group, min=eid, max=eid, count=1, consumername=c.name)
            if held:
                self.r.xclaim(self.key(c.stream), c.group, c.name, 0, [eid], justid=True)
            out.append(bool(held))
        return out

    def _group_read(self, c: Consumer, mode: str, count: int, *, start: str = "",
                    min_idle_ms: int = 0) -> tuple[str, list[_Entry]] | None:
        """One bounded read of `c`'s group (`_read`); None when the stream or the group vanished
        (both are recreated: the next read finds them)."""
        try:
            return self._read(c.stream, mode, group=c.group, consumer=c.name, count=count, start=start,
                              min_idle_ms=min_idle_ms)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("stream %s or group %s vanished; recreating", self.key(c.stream), c.group)
            self.ensure_group(c.stream, c.group)
            return None

    def _no_scripts(self, exc: NoPermissionError) -> None:
        """Fall back to plain commands when the server refuses scripts (no ACL +@scripting);
        re-raise any other permission error (a key outside the user's patterns)."""
        if "'eval" not in str(exc).lower() and "'script" not in str(exc).lower():
            raise exc
        log.warning("Redis user may not run scripts (ACL +@scripting): stream reads are sized after the "
                    "transfer, so one oversized entry costs its size in memory, and publish-if-owned is not "
                    "atomic (%s)", exc)
        self._scripted = False

    def _reclaim(self, c: Consumer, count: int) -> list[Delivery]:
        now = time.monotonic()
        k = (c.stream, c.group)
        cursor = self._claim_cursor.get(k, "0-0")
        if cursor == "0-0":
            # A full pass over the PEL once per half idle period is enough; a pass cut short by
            # `count` or the read budget goes on from its cursor at the next read.
            if now - self._last_claim.get(k, 0.0) < self.claim_idle_ms / 2000.0:
                return []
            self._last_claim[k] = now
        read = self._group_read(c, "claim", count, start=cursor, min_idle_ms=self.claim_idle_ms)
        if read is None:
            self._claim_cursor.pop(k, None)
            return []
        cursor, rows = read
        self._claim_cursor[k] = cursor
        out = self._deliver(c.stream, c.group, rows, c.expected)
        if out:
            log.warning("reclaimed %d idle entries from %s", len(out), self.key(c.stream))
        return out

    def _read(self, stream: str, mode: str, *, group: str = "", consumer: str = "", count: int, start: str = "",
              min_idle_ms: int = 0) -> tuple[str, list[_Entry]]:
        """One bounded read (see `_READ` for the modes); returns (next start or cursor, entries)."""
        key = self.key(stream)
        if self._scripted:
            if self._read_script is None:
                self._read_script = self.r.register_script(_READ)
            try:
                nxt, rows = self._read_script(keys=[key], args=[
                    mode, group, consumer, count, self._max_entry(stream), self.max_read_bytes, start, min_idle_ms,
                    FIELD, DEAD_RAW_BYTES, _MAX_FIELDS])
                return _s(nxt), [_entry(r) for r in rows]
            except NoPermissionError as exc:
                self._no_scripts(exc)
        return self._read_plain(key, mode, group, consumer, count, start, min_idle_ms, self._max_entry(stream))

    def _max_entry(self, stream: str) -> int:
        return max(self.max_message_bytes, _DEAD_ENTRY_BYTES) if stream == DEAD else self.max_message_bytes

    def _read_plain(self, key: str, mode: str, group: str, consumer: str, count: int, start: str,
                    min_idle_ms: int, max_entry: int) -> tuple[str, list[_Entry]]:
        """`_read` without a script: the same answers, sized after the transfer."""
        nxt = start
        entries: list[tuple[Any, Any]]
        if mode in ("new", "pending"):
            resp = self.r.xreadgroup(group, consumer, {key: ">" if mode == "new" else start}, count=count)
            entries = [(eid, fields) for _k, es in resp or [] for eid, fields in es]
            if mode == "pending":
                gone = [_s(eid) for eid, fields in entries if not fields]  # deleted while pending
                if gone:
                    self.r.xack(key, group, *gone)
                entries = [(eid, fields) for eid, fields in entries if fields]
        elif mode == "claim":
            resp = self.r.xautoclaim(key, group, consumer, min_idle_time=min_idle_ms, start_id=start, count=count)
            nxt = _s(resp[0])
            entries = resp[1] or []
            if any(fields is None for _, fields in entries):  # as in _READ: Redis 6.2's deleted entries
                for p in self.r.xpending_range(key, group, min="-", max="+", count=1000, consumername=consumer):
                    if not self.r.xrange(key, min=p["message_id"], max=p["message_id"], count=1):
                        self.r.xack(key, group, p["message_id"])
                entries = [(eid, fields) for eid, fields in entries if fields is not None]
        elif mode == "range":
            entries = self.r.xrange(key, min=start, max="+", count=count)
        else:
            entries = self.r.xrevrange(key, max=start, min="-", count=count)
        if entries and mode in ("range", "revrange"):
            nxt = f"({_s(entries[-1][0])}"
        out = []
        for eid, fields in entries:
            n = 1
            if mode in ("pending", "claim"):
                n = next((int(p["times_delivered"]) for p in self.r.xpending_range(key, group, min=eid, max=eid, count=1)), 1)
            size = sum(len(k) + len(v) for k, v in fields.items())
            if len(fields) > _MAX_FIELDS:
                out.append(_Entry(_s(eid), None, "fields", len(fields), n))
            elif size > max_entry:
                out.append(_Entry(_s(eid), None, "big", size, n, bytes(fields.get(FIELD, b""))[:DEAD_RAW_BYTES]))
            else:
                out.append(_Entry(_s(eid), fields, deliveries=n))
        return nxt, out

    def _deliver(self, stream: str, group: str | None, rows: list[_Entry], expected: Expected) -> list[Delivery]:
        """Decode what a read returned; dead-letter (and ack, with a `group`) what cannot be used."""
        out = []
        for e in rows:
            try:
                msg = self._decode(stream, e, expected)
            except DecodeError as exc:
                self.dead_letter(stream, group, e.entry_id, exc.reason, _payload(e), code=exc.code)
                continue
            if group is not None and e.deliveries > self.max_deliveries:
                self.dead_letter(stream, group, e.entry_id,
                                 f"delivered {e.deliveries} times (limit {self.max_deliveries})", _payload(e),
                                 code="max_deliveries")
                continue
            out.append(Delivery(e.entry_id, msg, e.deliveries))
        return out

    def _decode(self, stream: str, e: _Entry, expected: Expected) -> Message:
        """The one message entry `e` carries, of the `expected` kind and of this job.

        Raises:
            DecodeError: refused unread (oversized, too many fields), no message field, not a
                valid message of that kind, or another job's.
        """
        if e.refusal == "big":
            raise DecodeError(f"entry of {e.size} bytes exceeds the limit of {self._max_entry(stream)} bytes "
                              "(MAX_MESSAGE_BYTES); refused without reading it", "oversized")
        if e.refusal:
            raise DecodeError(f"entry has {e.size} fields; a stream entry carries one ('{FIELD.decode()}')",
                              "malformed")
        raw = _field(e.fields)
        if raw is None:
            raise DecodeError(
                f"entry has no '{FIELD.decode()}' field (fields: {sorted(map(str, e.fields or {}))})"[:500], "malformed")
        msg = decode(raw, expected, max_bytes=self._max_entry(stream))
        if msg.job_id != self.job_id:
            raise DecodeError(f"message for job '{msg.job_id}' on a stream of job '{self.job_id}'", "wrong_job")
        return msg

    def dead_letter(
        self, stream: str, group: str | None, entry_id: str, reason: str, raw: bytes = b"", *, code: str = "rejected",
        message: Message | None = None,
    ) -> None:
        """Move one entry to `{job}:dead` with the reason, then ack it so it is not redelivered.

        `code` is a short fixed word for metrics (shared.schema.REJECT_CODES or the consumer's own).
        `reason` may be anyone's text (a database's error, a decoder's): control characters are
        replaced and it is cut at 4000 characters; `raw` is cut at DEAD_RAW_BYTES. `message`, the
        decoded entry when the consumer has it, stands in for `raw`: encoded whole when it fits,
        else with its bulk (text, token ids, metadata) emptied, so the dead letter still names the
        group member it was (trainer_svc.feeder.dead_members) however long the completion.
        """
        if message is not None:
            raw = encode(message)
            if len(raw) > DEAD_RAW_BYTES:
                raw = encode(_identity(message))
        reason = clean_text(reason)[:4000]
        log.error("dead-lettering %s %s (%s): %s", self.key(stream), entry_id, code, reason[:1000])
        dl = DeadLetter(
            job_id=self.job_id,
            msg_id=dead_letter_id(stream, entry_id),
            policy_version=0,
            stream=stream,
            entry_id=entry_id,
            reason=reason,
            code=code,
            raw=bytes(raw[:DEAD_RAW_BYTES]),
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
        return self.trim_acked_many([(stream, group)])

    def trim_acked_many(self, pairs: Iterable[tuple[str, str]]) -> int:
        """`trim_acked` of each (stream, group) in two round trips (what to keep, then the trims);
        returns the entries trimmed. A stream or group that does not exist is left alone."""
        keys = [(self.key(stream), group) for stream, group in pairs]
        calls: list[tuple[str, tuple, dict]] = []
        for key, group in keys:
            calls += [("xpending", (key, group), {}), ("xinfo_groups", (key,), {})]
        answers = self._batch(calls)
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
                min_id = g["last-delivered-id"]  # keep the last delivered entry itself; trim what precedes it
            min_id = min_id.decode() if isinstance(min_id, bytes) else min_id
            if min_id not in ("0-0", "0"):
                trims.append((key, min_id))
        if not trims:
            return 0
        return sum(int(n) for n in self._batch([("xtrim", (key,), {"minid": min_id, "approximate": False})
                                                 for key, min_id in trims], raise_on_error=True))

    def _batch(self, calls: list[tuple[str, tuple, dict]], *, raise_on_error: bool = False) -> list[Any]:
        """Run (client method name, args, kwargs) calls in one pipelined round trip on a single
        server; one by one on a cluster, where each command rides out a failover (OutageCluster)
        and a pipeline would not. Errors come back in place unless `raise_on_error`."""
        if not self.cluster:
            pipe = self.r.pipeline(transaction=False)
            for name, args, kwargs in calls:
                getattr(pipe, name)(*args, **kwargs)
            return pipe.execute(raise_on_error=raise_on_error)
        out: list[Any] = []
        for name, args, kwargs in calls:
            try:
                out.append(getattr(self.r, name)(*args, **kwargs))
            except ResponseError as exc:
                if raise_on_error:
                    raise
                out.append(exc)
        return out

    def trim_broadcast(self, stream: str, keep: int) -> int:
        """Keep the newest `keep` entries of a broadcast stream (no group, so nothing is pending;
        late joiners start from the newest entry)."""
        return int(self.r.xtrim(self.key(stream), maxlen=keep, approximate=False))

    # -- broadcast streams (policy, control): plain XREAD, every reader sees everything -----------
    def read_broadcast(
        self, stream: str, last_id: str, expected: type[M], *, block_ms: int | None = None, count: int = 100
    ) -> tuple[str, list[M]]:
        """Messages after `last_id` ("0": from the start), waiting up to `block_ms` for one; returns
        (new last_id, messages). Invalid or oversized entries are skipped (dead-lettered once, by
        id, without a group). Bounded like `consume`: at most `max_read_bytes` (+ one entry)."""
        start = "-" if last_id in ("0", "0-0") else f"({last_id}"
        deadline = time.monotonic() + block_ms / 1000 if block_ms else None
        waits = 0
        while True:
            _, rows = self._read(stream, "range", count=count, start=start)
            now = time.monotonic()
            if rows or deadline is None or now >= deadline:
                break
            self._wait(stream, waits, deadline - now)
            waits += 1
        msgs: list[M] = []
        for e in rows:
            last_id = e.entry_id
            msgs += [d.message for d in self._deliver(stream, None, [e], expected)]  # type: ignore[misc]
        return last_id, msgs

    def latest(self, stream: str, expected: type[M]) -> tuple[str, M] | None:
        """The newest valid message among the last 20 entries of a broadcast stream (a late
        joiner's starting point); invalid and oversized entries (those unread) are skipped."""
        _, rows = self._read(stream, "revrange", count=20, start="+")
        for e in rows:
            try:
                return e.entry_id, self._decode(stream, e, expected)  # type: ignore[return-value]
            except DecodeError:
                continue
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

    def group_ids(self, stream: str, *, undelivered_to: str | None = None, page: int = 256) -> set[str]:
        """The group ids of the message entries `stream` holds (read in bounded pages, undelivered,
        pending and acked-not-yet-trimmed alike), or with `undelivered_to`, only those consumer
        group `undelivered_to` has not been delivered yet; entries that are not this job's
        messages are skipped (their consumers dead-letter them)."""
        out: set[str] = set()
        start = "-"
        if undelivered_to is not None:
            try:
                groups = self.r.xinfo_groups(self.key(stream))
            except ResponseError:  # no such stream: nothing in it
                return out
            g = next((g for g in groups if g["name"] in (undelivered_to, undelivered_to.encode())), None)
            if g is not None:
                start = "(" + _s(g["last-delivered-id"])
        while True:
            start, rows = self._read(stream, "range", count=page, start=start)
            for e in rows:
                try:
                    out.add(self._decode(stream, e, (PromptGroup, EvalRound, Rollout, Scored)).group_id)
                except DecodeError:
                    continue
            if not rows:  # a page may end early at the read's byte budget: only an empty one is the end
                return out

    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        """The oldest `count` dead letters (read in bounded pages); entries on the dead stream that
        are not dead letters (someone else's XADD) are skipped."""
        out: list[DeadLetter] = []
        start = "-"
        while len(out) < count:
            start, rows = self._read(DEAD, "range", count=min(1000, count - len(out)), start=start)
            if not rows:
                break
            for e in rows:
                try:
                    out.append(self._decode(DEAD, e, DeadLetter))  # type: ignore[arg-type]
                except DecodeError as exc:
                    log.warning("skipping %s %s: not a dead letter (%s)", self.key(DEAD), e.entry_id, exc.reason)
        return out

    def delete_all(self) -> None:
        self.r.delete(*[self.key(s) for s in (PROMPTS, ROLLOUTS, SCORED, POLICY, CONTROL, DEAD, "generators")])
