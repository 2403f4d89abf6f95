"""Producing: XADD of encoded messages, a batch at a time, each publish waking the stream's
waiting readers; and the hand-off of a consumer's outputs with the ack of its input."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from contextlib import suppress
from typing import Any

import redis
from redis.exceptions import ResponseError

from shared.schema import Message, encode

from .entries import Consumer, text
from .keys import FIELD, JobKeys
from .scripts import PUBLISH_IF_OWNED, PUBLISH_MANY, Scripts
from .wakeups import Wakeups

log = logging.getLogger(__name__)

# What publish_if_owned hands over: (entry id of the consumer's stream, its output messages).
Batches = Sequence[tuple[str, Sequence[Message]]]


class Publisher:
    """The producers' side of one job's streams."""

    def __init__(self, client: Any, keys: JobKeys, scripts: Scripts, wakeups: Wakeups, *, cluster: bool):
        self.r = client
        self.keys = keys
        self.scripts = scripts
        self.wakeups = wakeups
        self.cluster = cluster

    def publish_many(self, stream: str, msgs: Iterable[Message]) -> list[str]:
        """XADD each message in one round trip, as one MULTI/EXEC transaction, then wake the
        stream's waiting readers; returns the entry ids. Atomic on purpose: without it a reader
        blocked on the stream is woken by the first XADD and takes one entry of a batch the feeder
        published together (a generate call of 1 group, then one of the other 7), and small
        generate calls cost generator throughput. On a cluster the same is one script (redis-py's
        cluster client refuses PUBLISH inside MULTI/EXEC)."""
        key = self.keys.key(stream)
        msgs = list(msgs)
        if not msgs:
            return []
        if self.cluster:
            return self._publish_many_cluster(stream, msgs)
        pipe = self.r.pipeline(transaction=True)
        for m in msgs:
            pipe.xadd(key, {FIELD: encode(m)})
        if not self.wakeups.off:
            pipe.publish(self.wakeups.channel(stream), b"")
        try:
            ids = pipe.execute()[: len(msgs)]
        except redis.exceptions.NoPermissionError as exc:
            if self.wakeups.off or "publish" not in str(exc).lower():
                raise
            # The ACL refuses PUBLISH (no @pubsub): the transaction was aborted whole, so nothing
            # was added; publish without the wake-up from now on (waiting readers poll).
            log.warning("no PUBLISH rights (%s): readers of %s poll instead of waking", exc, key)
            self.wakeups.turn_off()
            return self.publish_many(stream, msgs)
        return [text(i) for i in ids]

    def _publish_many_cluster(self, stream: str, msgs: list[Message]) -> list[str]:
        key = self.keys.key(stream)
        wake = "" if self.wakeups.off else self.wakeups.channel(stream)
        if self.scripts.enabled:
            ids = self.scripts.run(PUBLISH_MANY, [key], [FIELD, wake, *(encode(m) for m in msgs)])
            if ids is not None:
                return [text(i) for i in ids]
        # No scripts: the XADDs in MULTI/EXEC (one slot), the wake-up after it.
        pipe = self.r.pipeline(transaction=True)
        for m in msgs:
            pipe.xadd(key, {FIELD: encode(m)})
        ids = pipe.execute()
        if wake:
            with suppress(redis.RedisError):
                self.r.publish(wake, b"")
        return [text(i) for i in ids]

    def publish_raw(self, stream: str, fields: dict) -> str:
        """XADD arbitrary fields (tests use it to inject malformed entries)."""
        return text(self.r.xadd(self.keys.key(stream), fields))

    def publish_if_owned(self, c: Consumer, stream: str, batches: Batches) -> list[bool]:
        """For each (entry id of `c.stream`, messages) in
        `batches`: if consumer `c` still holds the entry pending, XADD the messages to `stream` and
        XACK the entry, all in one atomic script; returns which entries were published.

        A consumer whose entry was reclaimed meanwhile (it looked dead: idle past claim_idle_ms),
        or that was acked already, publishes nothing: the claimer's copy is the only one, so a
        redelivered input never yields two different outputs. Atomic, so a crash leaves either
        both the outputs and the ack or neither (AOF logs a script's effects as one MULTI/EXEC).
        A consumer group that vanished (Redis came back empty) holds nothing: nothing is published.
        """
        if not batches:
            return []
        try:
            return self._publish_if_owned(c, stream, batches)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning(
                "group %s of %s vanished (Redis lost it): %d entries read before are not published",
                c.group,
                self.keys.key(c.stream),
                len(batches),
            )
            return [False] * len(batches)

    def _publish_if_owned(self, c: Consumer, stream: str, batches: Batches) -> list[bool]:
        if self.scripts.enabled:
            argv: list[Any] = [c.group, c.name, FIELD, self.wakeups.channel(stream)]
            for entry_id, msgs in batches:
                argv += [entry_id, len(msgs), *(encode(m) for m in msgs)]
            keys = [self.keys.key(c.stream), self.keys.key(stream)]
            done = self.scripts.run(PUBLISH_IF_OWNED, keys, argv)
            if done is not None:
                return [bool(x) for x in done]
        return self._publish_if_owned_plain(c, stream, batches)

    def _publish_if_owned_plain(self, c: Consumer, stream: str, batches: Batches) -> list[bool]:
        """`publish_if_owned` without scripts: the ownership check and the publish are two steps,
        so a reclaim in between can still yield two copies (the trainer collapses them by
        msg_id)."""
        owned = []
        for entry_id, msgs in batches:
            held = self.r.xpending_range(
                self.keys.key(c.stream), c.group, min=entry_id, max=entry_id, count=1, consumername=c.name
            )
            owned.append(bool(held))
            if held:
                pipe = self.r.pipeline(transaction=True)
                for m in msgs:
                    pipe.xadd(self.keys.key(stream), {FIELD: encode(m)})
                pipe.xack(self.keys.key(c.stream), c.group, entry_id)
                if not self.cluster:  # a cluster's MULTI/EXEC refuses PUBLISH: woken after it
                    pipe.publish(self.wakeups.channel(stream), b"")
                pipe.execute()
                if self.cluster:
                    with suppress(redis.RedisError):
                        self.r.publish(self.wakeups.channel(stream), b"")
        return owned
