"""Where `async def` reward functions run: an event loop in a daemon thread of its own.

A user's coroutine that blocks (time.sleep, a busy loop, a sync socket read) would stall the loop
it runs in; in the reward service's own loop that stops every reward, the ledger writes and the
acks, and no time budget can fire (cancellation only lands at an `await`). Here it stalls only
this loop (and so the calls in flight in it): the service's wait for each ends at its budget. A
loop that then does not answer within `GRACE_S` is blocked: it is abandoned, like a hung thread of
shared.rewards.pool's ThreadRunner (it stops as soon as the blocking call returns, if ever), and a
fresh loop serves the next calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
GRACE_S = 2.0  # after a call's budget ran out: how long its loop may take to answer before it is abandoned


class LoopThread:
    """Runs coroutines in an event loop of a daemon thread, each under a time budget."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self.abandoned = 0  # loops given up as blocked

    def _current(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name=f"reward-async-{self._name}", daemon=True).start()
                self._loop = loop
            return self._loop

    async def run(self, make: Callable[[], Coroutine[Any, Any, T]], timeout_s: float) -> T:
        """The result of the coroutine `make()` run in the thread's loop.

        Raises:
            TimeoutError: over `timeout_s` (the coroutine is cancelled; `blocked` tells whether its
                loop was abandoned as blocked).
        """
        loop = self._current()
        fut = asyncio.run_coroutine_threadsafe(make(), loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)
        except asyncio.TimeoutError:
            fut.cancel()
            if not await self._answers(loop):
                self._abandon(loop)
                raise Blocked from None
            raise TimeoutError from None

    async def _answers(self, loop: asyncio.AbstractEventLoop) -> bool:
        ping: concurrent.futures.Future[None] = concurrent.futures.Future()
        loop.call_soon_threadsafe(ping.set_result, None)
        try:
            await asyncio.wait_for(asyncio.wrap_future(ping), GRACE_S)
        except asyncio.TimeoutError:
            return False
        return True

    def _abandon(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self._loop is loop:
                self._loop = None
                self.abandoned += 1
                log.warning(
                    "reward %s: an async call blocked its event loop past the time budget; the loop is abandoned "
                    "and replaced (an async def reward must not block: make it a plain def to run it in a worker)",
                    self._name,
                )
        loop.call_soon_threadsafe(loop.stop)  # runs once the blocking call returns, if ever

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)


class Blocked(TimeoutError):
    """A call over its budget whose event loop was blocked, and was abandoned."""
