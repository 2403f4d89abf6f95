"""The generator's half of co-located alternation (`placement: colocated`, ARCHITECTURE.md).

On a GPU the engine sleeps at level 1 (weights to host memory, KV cache freed) as soon as a batch
is generated, before its rollouts are published, so the device is free by the time the trainer
can have the batch; it wakes when the next prompts arrive, before it pulls the new weights. On
CPU (`shared.placement.takes_turns` is false) nothing moves: the phases only share cores.
"""

from __future__ import annotations

import logging
import time

from generator_svc.engine import Engine
from generator_svc.tenants import EngineView

log = logging.getLogger(__name__)


class Turns:
    """Sleeps and wakes `engine` around each batch when `on`; a no-op otherwise."""

    def __init__(self, engine: Engine | EngineView, on: bool):
        self.engine, self.on = engine, on
        self.asleep = False
        self.sleep_s = self.wake_s = 0.0  # the last transition's cost

    def wake(self) -> None:
        """Before a batch (and before a weight swap: the swap writes into device memory)."""
        if self.on and self.asleep:
            t0 = time.perf_counter()
            self.engine.wake_up()
            self.asleep, self.wake_s = False, time.perf_counter() - t0

    def rest(self) -> None:
        """After a batch: hand the device to the trainer."""
        if self.on and not self.asleep:
            t0 = time.perf_counter()
            self.engine.sleep()
            self.asleep, self.sleep_s = True, time.perf_counter() - t0
            log.debug("engine asleep in %.3fs (woke in %.3fs)", self.sleep_s, self.wake_s)
