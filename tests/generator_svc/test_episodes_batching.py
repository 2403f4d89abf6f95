"""generator_svc.episodes with a stand-in engine: sync tool calls of many episodes run at once,
turns coming back one by one go into one engine call, and a slow episode is not waited for."""

from __future__ import annotations

import asyncio
import threading
import time

from generator_svc.engine import Sample
from generator_svc.episodes import TurnBatcher, run_groups
from shared.environments.base import StepResult
from shared.environments.episode import PlainCodec
from shared.environments.spec import EpisodeLimits
from shared.schema import PromptGroup, SamplingParams

TURNS = 3


class FakeEngine:
    """Every call takes `call_s` and answers each context with 4 ids, finished "stop"."""

    def __init__(self, call_s: float) -> None:
        self.call_s = call_s
        self.sizes: list[int] = []

    def generate(self, prompts: list, params: list, n: list[int]) -> list[list[Sample]]:
        time.sleep(self.call_s)
        self.sizes.append(len(prompts))
        return [[Sample(list(p), [5, 6, 7, 8], [-0.5] * 4, "abcd", "stop")] for p in prompts]


class Sleepy:
    """A tool that sleeps `sleep_s` per call; counts the calls in flight at once."""

    lock = threading.Lock()
    running = 0
    peak = 0

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s, self.steps = sleep_s, 0

    def start(self, row):  # type: ignore[no-untyped-def]
        return row["prompt"]

    def step(self, turn):  # type: ignore[no-untyped-def]
        cls = type(self)
        with cls.lock:
            cls.running += 1
            cls.peak = max(cls.peak, cls.running)
        time.sleep(self.sleep_s)
        with cls.lock:
            cls.running -= 1
        self.steps += 1
        return StepResult(text="ok", done=self.steps >= TURNS)


CODEC = PlainCodec(tokenize=lambda t: [ord(c) % 100 + 4 for c in t], decode=lambda ids: "x" * len(ids))


def groups(k: int, n: int) -> list[PromptGroup]:
    return [
        PromptGroup(
            job_id="j",
            msg_id=f"j/g{g}",
            group_id=f"j/g{g}",
            policy_version=0,
            prompt_index=g,
            prompt=f"p{g}",
            answer="",
            n=n,
            sampling=SamplingParams(max_tokens=4),
        )
        for g in range(k)
    ]


def test_sync_tool_calls_of_every_episode_run_at_once() -> None:
    Sleepy.peak = 0
    engine = FakeEngine(call_s=0.02)
    played = run_groups(engine, lambda: Sleepy(0.1), EpisodeLimits(max_turns=TURNS), CODEC, groups(4, 8))  # type: ignore[arg-type]
    samples = [s for per in played.samples for s in per]  # type: ignore[union-attr]
    assert len(samples) == 32 and all(s.turns == TURNS for s in samples)
    # asyncio's default pool (min(32, cores + 4) threads) would cap this at 6 on 2 cores
    assert Sleepy.peak >= 16, Sleepy.peak
    assert sum(engine.sizes) == 32 * TURNS


def _ask_once(engine: FakeEngine, delays: list[float], **batcher: float) -> list[int]:
    """Episodes that each ask for one turn `delay` seconds in; the engine calls' sizes."""
    b = TurnBatcher(engine, active=len(delays), **batcher)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=4)

    async def episode(delay: float) -> None:
        await asyncio.sleep(delay)
        await b.generate([1, 2], params)
        b.ended()

    async def main() -> None:
        episodes = asyncio.gather(*(episode(d) for d in delays))
        await b.serve()
        await episodes

    asyncio.run(main())
    return engine.sizes


def test_a_call_waits_while_turns_keep_coming_and_not_past_a_gap() -> None:
    # turns 10 ms apart are gathered into one call (launching at the second would split them);
    # one 300 ms later is not waited for
    assert _ask_once(FakeEngine(0.0), [0.0, 0.01, 0.02, 0.3], gather_s=0.05, max_gather_s=1.0) == [3, 1]
    # a steady trickle is cut at max_gather_s
    assert _ask_once(FakeEngine(0.0), [0.0, 0.03, 0.06, 0.09], gather_s=0.05, max_gather_s=0.075)[0] == 3


def test_a_slow_episode_is_not_waited_for() -> None:
    """One episode's tool takes 0.5 s per call: the others' turns go on without it."""
    engine = FakeEngine(call_s=0.0)
    made = iter(range(100))

    def factory() -> Sleepy:
        return Sleepy(0.5 if next(made) == 0 else 0.0)

    t0 = time.perf_counter()
    played = run_groups(engine, factory, EpisodeLimits(max_turns=TURNS), CODEC, groups(1, 4))  # type: ignore[arg-type]
    assert played.turns == 4 * TURNS
    assert time.perf_counter() - t0 < 3 * 0.5 + 1.0
    assert engine.sizes[0] == 4 and 1 in engine.sizes  # the slow one's later turns ran alone
