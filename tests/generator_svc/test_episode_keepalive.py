"""generator_svc.episodes.run_groups keeps its batch's prompt entries claimed while episodes play
(`keepalive`): often enough, never queued behind the environments' steps, only while the episodes'
loop turns, and never failing the batch. A fake engine: no vLLM here."""

from __future__ import annotations

import logging
import time

import pytest

from generator_svc.engine import Sample
from generator_svc.episodes import run_groups
from shared.environments.base import StepResult
from shared.environments.episode import PlainCodec
from shared.environments.spec import EpisodeLimits
from shared.schema import PromptGroup, SamplingParams

CODEC = PlainCodec(
    tokenize=lambda t: [ord(c) for c in t],
    decode=lambda ids: "".join(map(chr, ids)),
    tokenize_prompt=lambda t: [1, *(ord(c) for c in t)],
)
LIMITS = EpisodeLimits(max_turns=8, max_total_tokens=500, step_timeout_s=10.0)


class FakeEngine:
    """Every turn is the one token "x", finish "stop"; each call takes `delay_s` (blocking, as
    vLLM's call blocks the episodes' loop) and its window is recorded."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.calls: list[tuple[float, float]] = []

    def generate(self, prompts, params, ns):
        t0 = time.monotonic()
        time.sleep(self.delay_s)
        self.calls.append((t0, time.monotonic()))
        return [[Sample(list(p), [ord("x")], [-0.5], "x", "stop")] for p in prompts]


def slow_steps(sleep_s: float, turns: int):
    class SlowSteps:
        def start(self, row):
            return row["prompt"]

        def step(self, turn):
            time.sleep(sleep_s)  # a tool that takes a while, in the default executor's threads
            return StepResult(text="1", done=turn.index + 1 >= turns)

    return SlowSteps


def groups(k: int, n: int) -> list[PromptGroup]:
    return [
        PromptGroup(
            job_id="j",
            msg_id=f"j/g{i}",
            group_id=f"j/g{i}",
            policy_version=0,
            prompt_index=i,
            prompt="1+1=",
            answer="2",
            n=n,
            sampling=SamplingParams(max_tokens=4),
        )
        for i in range(k)
    ]


def test_entries_are_touched_while_the_episodes_play_and_not_after():
    touches: list[float] = []
    t0 = time.monotonic()
    played = run_groups(
        FakeEngine(),
        slow_steps(0.1, 3),
        LIMITS,
        CODEC,
        groups(2, 2),
        keepalive=lambda: touches.append(time.monotonic()),
        keepalive_s=0.05,
    )
    took = time.monotonic() - t0
    assert all(isinstance(s, list) and len(s) == 2 and all(x.turns == 3 for x in s) for s in played.samples)
    assert touches and touches[0] - t0 < 0.05  # at once: the batch may have waited for its weights
    assert len(touches) >= took / 0.05 / 2, (len(touches), took)
    n = len(touches)
    time.sleep(0.2)
    assert len(touches) == n  # nothing touched once the batch is played


def test_touches_are_not_queued_behind_the_environments_steps():
    """More episodes in their steps than the default executor has threads: a touch queued there
    would wait for rounds of steps; in its own thread it keeps its pace."""
    touches: list[float] = []
    engine = FakeEngine()
    played = run_groups(
        engine,
        slow_steps(0.1, 2),
        LIMITS,
        CODEC,
        groups(4, 8),
        keepalive=lambda: touches.append(time.monotonic()),
        keepalive_s=0.05,
    )
    assert all(isinstance(s, list) and len(s) == 8 for s in played.samples)
    gaps = [b - a for a, b in zip(touches, touches[1:], strict=False)]
    # 32 episodes' steps of 0.1 s on the default executor's min(32, cores + 4) threads: behind them a
    # touch would wait 0.5 s on 2 cores
    assert max(gaps) < 0.3, max(gaps)


def test_a_blocked_loop_does_not_touch():
    """Touching is the episodes' loop's sign of life: while an engine call blocks the loop (a
    wedged engine would block it for good), no touch is made, so a wedged generator's entries
    go idle and are reclaimed as before."""
    touches: list[float] = []
    engine = FakeEngine(delay_s=0.4)
    run_groups(
        engine,
        slow_steps(0.01, 2),
        LIMITS,
        CODEC,
        groups(1, 2),
        keepalive=lambda: touches.append(time.monotonic()),
        keepalive_s=0.05,
    )
    for start, end in engine.calls:
        assert not [t for t in touches if start + 0.05 < t < end], (engine.calls, touches)


def test_a_failing_touch_does_not_fail_the_batch(caplog: pytest.LogCaptureFixture):
    def broken() -> None:
        raise ConnectionError("redis went away")

    with caplog.at_level(logging.WARNING, logger="generator_svc.episodes"):
        played = run_groups(
            FakeEngine(), slow_steps(0.05, 3), LIMITS, CODEC, groups(1, 2), keepalive=broken, keepalive_s=0.02
        )
    assert all(isinstance(s, list) and len(s) == 2 for s in played.samples)
    assert "redis went away" in caplog.text


def test_without_keepalive_nothing_changes():
    played = run_groups(FakeEngine(), slow_steps(0.0, 2), LIMITS, CODEC, groups(1, 3))
    assert [len(s) for s in played.samples] == [3]
