"""Waiting for an entry: scripts cannot block, so a reader with nothing to read waits for the
producers' wake-up on the stream's pub/sub channel (or polls where pub/sub is refused)."""

from __future__ import annotations

import logging
import time
from contextlib import suppress
from typing import Any

import redis
from redis.backoff import ExponentialBackoff

from .connection import subscriber
from .keys import JobKeys

log = logging.getLogger(__name__)

# The wait of a blocking read (scripts cannot block): 2 ms, doubling to 50 ms while idle. Used
# where the wake-up channel is not available (Wakeups.wait).
_IDLE_POLL = ExponentialBackoff(cap=0.05, base=0.002)
# With the wake-up channel subscribed, the longest wait between two reads: a lost wake-up (the
# subscription itself is racing the first entry) costs at most this.
_WAKE_POLL_S = 0.1


class Wakeups:
    """The wake-up channels of one job's streams (`JobKeys.wake_channel`): readers subscribe and
    wait on them, producers publish on them (publish_many, publish_if_owned) unless `off`."""

    def __init__(self, client: Any, keys: JobKeys):
        self.r = client
        self.keys = keys
        self.off = False  # True once pub/sub was refused (no @pubsub in the ACL): plain polling
        self._subscribed: dict[str, Any] = {}  # stream -> its wake-up channel (redis PubSub)

    def channel(self, stream: str) -> str:
        return self.keys.wake_channel(stream)

    def turn_off(self) -> None:
        """Poll from now on, and publish no wake-ups: the ACL refuses pub/sub."""
        self.off = True

    def wait(self, stream: str, waits: int, seconds: float) -> None:
        """Wait up to `seconds` for an entry on `stream`, the `waits`-th wait of one read.

        Woken by the producers' wake-up (publish_many, publish_if_owned); the read that follows
        decides, so a lost or spurious wake-up costs only latency. The first wait of a stream
        subscribes and returns at once (the caller reads again, catching an entry added before the
        subscription). Without pub/sub (an ACL without @pubsub, an error on the channel) it
        sleeps the idle-poll back-off instead."""
        sub = self._subscribed.get(stream)
        if sub is None and not self.off:
            try:
                sub = subscriber(self.r, self.channel(stream))
                sub.subscribe(self.channel(stream))
                self._subscribed[stream] = sub
                return
            except redis.RedisError as exc:
                log.warning("no wake-up channel for %s (%s): waiting reads poll", self.keys.key(stream), exc)
                self.off = True
                sub = None
        if sub is None:
            time.sleep(min(_IDLE_POLL.compute(waits), seconds))
            return
        try:
            if sub.get_message(timeout=min(seconds, _WAKE_POLL_S)) is not None:
                while sub.get_message(timeout=0.0) is not None:  # wake-ups that queued meanwhile
                    pass
        except redis.RedisError as exc:  # the channel's connection broke: resubscribe next wait
            log.warning("wake-up channel of %s lost (%s)", self.keys.key(stream), exc)
            self._subscribed.pop(stream, None)
            if isinstance(exc, redis.exceptions.NoPermissionError):
                self.off = True  # SUBSCRIBE refused by the ACL: poll
            with suppress(redis.RedisError):
                sub.close()
            time.sleep(min(_IDLE_POLL.compute(waits), seconds))
