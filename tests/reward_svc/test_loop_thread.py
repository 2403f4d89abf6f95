"""The reward service's one event loop in its own thread (reward_svc/service.py `LoopThread`,
`run_on`): jobs' batches scored on it at once, and a batch of an ended job abandoned."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from reward_svc.service import LoopThread, run_on
from shared.entry import JobEnded


def test_two_jobs_batches_score_at_once_on_the_one_loop() -> None:
    loop = LoopThread()
    try:
        started: set[str] = set()
        results: dict[str, object] = {}

        async def batch(name: str) -> str:
            started.add(name)
            for _ in range(500):  # each batch waits until the other one started too: one after
                if started == {"a", "b"}:  # the other, the first would never see it
                    return name
                await asyncio.sleep(0.01)
            return "alone"

        def job(name: str) -> None:
            results[name] = run_on(loop.loop, batch(name))

        threads = [threading.Thread(target=job, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == {"a": "a", "b": "b"}
    finally:
        loop.close()


def test_a_batch_whose_job_ended_is_abandoned_not_waited_out() -> None:
    loop = LoopThread()
    try:
        cancelled = threading.Event()

        async def hangs() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        t0 = time.monotonic()
        with pytest.raises(JobEnded):
            run_on(loop.loop, hangs(), ended=lambda: time.monotonic() - t0 > 0.6)
        assert time.monotonic() - t0 < 5
        assert cancelled.wait(5)
    finally:
        loop.close()
