"""The consumer loop every stream service runs; the role's work is a `Handler`.

Each turn: follow the job's control stream (pause, drain, cancel; SIGTERM drains) -> read a batch
for the service's `Consumer` -> hand it to the handler. The handler does the role's work on the
batch and settles each entry: publishes and acks it (JobStreams.publish_if_owned, after its ledger
write), or dead-letters it with the reason. An entry it neither acks nor dead-letters stays pending
and comes back (redelivery, then the dead-letter stream after `max_deliveries`).

A restarted service of the same consumer name first takes what its predecessor left pending, one
entry at a time and alone in its batch (`suspect`): the predecessor may have died of one of them,
and only that one should pile up deliveries. Entries that fail to decode, are oversized or were
delivered too often never reach the handler (broker.streams dead-letters them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Protocol

from broker.runtime import ControlWatcher
from broker.streams import Consumer, Delivery, JobStreams
from shared.entry import Drained, JobEnded
from shared.metrics import Phases

log = logging.getLogger(__name__)

# The longest one idle read waits before the loop looks at the control stream again: how soon a
# service of the fleet leaves a job that ended (the trainer's drain) for the next one.
CONTROL_POLL_MS = 200


class Handler(Protocol):
    """A role's work on batches of one consumer's deliveries (generation, scoring)."""

    def batch_size(self, control: ControlWatcher) -> int:
        """Entries to ask for in one read (may follow a live knob in `control.settings`)."""
        ...

    def more(self, deliveries: list[Delivery]) -> int:
        """How many more entries to take, of those already waiting, before handling `deliveries`
        (0: the batch is full enough)."""
        ...

    def handle(self, deliveries: list[Delivery]) -> None:
        """Do the role's work on a non-empty batch; ack or dead-letter each entry that is done."""
        ...

    def idle(self) -> None:
        """Called when a read found nothing: a moment for background work."""
        ...

    def tick(self) -> None:
        """Called at the top of every turn, whatever comes next (heartbeats)."""
        ...


class ServiceLoop:
    """Reads batches for `consumer` and hands them to `handler` until the job's control stream or
    SIGTERM says stop.

    `exit_on`: the control commands that end this service (ControlWatcher); `cancel` always does.
    `block_ms`: how long one read waits for an entry, and one poll of the control stream while
    paused. `on_dead_letter`, when given, is told (stream, code) of every entry dead-lettered.
    `phases`, when given, times each read (a blocking one included) as the role's "read" phase.
    """

    def __init__(
        self,
        streams: JobStreams,
        consumer: Consumer,
        handler: Handler,
        *,
        block_ms: int,
        exit_on: tuple[str, ...] = ("drain",),
        on_dead_letter: Callable[[str, str], None] | None = None,
        phases: Phases | None = None,
    ):
        self.streams, self.consumer, self.handler, self.block_ms = streams, consumer, handler, block_ms
        self.phases = phases
        if on_dead_letter is not None:
            streams.on_dead_letter = on_dead_letter
        streams.ensure_group(consumer.stream, consumer.group)
        self.control = ControlWatcher(streams, exit_on=exit_on)
        self._resuming = True  # first the entries a predecessor of this name left pending

    def run(self) -> str:
        """Serve until stopped; returns the final control state (stopping, cancelled, terminating)."""
        while True:
            self.handler.tick()
            self.control.poll()
            if self.control.done:
                return self.control.state
            if self.control.state == "paused":
                self.control.poll(block_ms=self.block_ms)
                continue
            with self.phases.span("read") if self.phases is not None else nullcontext():
                deliveries = self.read()
            if deliveries:
                try:
                    self.handler.handle(deliveries)
                except Drained as exc:  # SIGTERM during a wait: leave them pending, exit drained
                    log.info("drained mid-batch (%s); %d entries left pending", exc, len(deliveries))
                    return "terminating"
                except JobEnded as exc:  # the job ended during a wait: its entries no longer matter
                    log.info("left the job mid-batch (%s)", exc)
                    return self.control.state
            else:
                self.handler.idle()

    def ended(self) -> bool:
        """Whether the job's control stream (or SIGTERM) says this service is done with it now:
        for a wait inside the handler (a generator waiting for a policy version)."""
        return self.control.poll() in ("stopping", "cancelled")

    def read(self) -> list[Delivery]:
        """The next batch: a predecessor's pending entry alone while there are any, else up to
        `batch_size` entries (waiting up to `block_ms`), topped up with what is already waiting
        while the handler asks for `more`."""
        if self._resuming:
            pending = self.streams.consume_own_pending(self.consumer, count=1)
            self._resuming = bool(pending)
            if pending:
                return pending  # suspect: alone in its batch
        deliveries = self.streams.consume(
            self.consumer, count=self.handler.batch_size(self.control), block_ms=min(self.block_ms, CONTROL_POLL_MS)
        )
        while deliveries and (n := self.handler.more(deliveries)) > 0:
            got = self.streams.consume(self.consumer, count=n, block_ms=None)
            if not got:
                break
            deliveries += got
        return deliveries
