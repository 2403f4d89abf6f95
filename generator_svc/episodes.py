"""Multi-turn episodes in the generator: many episodes at once, one engine call per round of turns.

A job with an `environment` (shared/environments) turns each training prompt group into n
episodes. They run concurrently on one event loop (`run_groups`): an episode waiting for its
environment (a tool in a worker thread of its own, or an `async def` step) holds nothing, and
every model turn that is ready goes into the next engine call (`TurnBatcher`), so while one
episode's tool runs the others keep the engine busy.

Token in, token out: a model turn is the ids the engine sampled, with their logprobs; an
environment reply is tokenized once when appended (shared/environments/episode.py); the episode
is published as those ids with a per-token model mask (`Rollout.model_mask`), and nothing is
re-tokenized downstream.

One policy version per episode: the episodes of a batch all run inside one `Generation.handle`
call, and weights are swapped only between calls, so a swap waits for the episodes in flight.
Recording a version per turn would let a long episode span a swap, but then its staleness and its
importance weights would need a per-token version; one version keeps the trainer's staleness
filter and AIPO weights exactly as for single-turn samples, at the cost of a batch's wall time
being its longest episode's.

The engine call blocks the loop while it runs: sync environments' steps go on in their threads
meanwhile; an `async def` environment's awaits resume between engine calls.

Holding the batch's prompt entries. A batch of episodes can outlast the consumer group's
`claim_idle_ms` (tools that take seconds, many turns), after which another generator would take
the entries over from this live one as if it were dead: both would play the groups, only one
publish, and a pair of generators could hand a batch back and forth until its delivery count
dead-letters it. So while the episodes play, `run_groups` calls `keepalive` (the generator's
`JobStreams.touch` of the batch's entries) every `keepalive_s`, from a task on the episodes' loop
and in a thread of its own: only while the loop turns (a process wedged in an engine call or in a
blocking `async def` step stops touching, and its entries are reclaimed as before), never queued
behind the environments' steps in the default executor. A SIGKILLed generator touches nothing:
its entries go idle and are reclaimed, or re-read by its restarted self, and played from the start
(an episode lives only in this process until its batch is published).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from generator_svc.engine import Engine, Sample
from generator_svc.tenants import EngineView
from shared.environments.base import EnvironmentFactory
from shared.environments.episode import Codec, Episode, Generate, run_episode
from shared.environments.spec import EpisodeLimits
from shared.jobspec import MAX_SEED
from shared.schema import PromptGroup, SamplingParams

log = logging.getLogger(__name__)

MAX_STOP_REASON = 2000
MAX_ENV_THREADS = 256  # worker threads for sync environments' calls, per run_groups


@dataclass
class _Turn:
    context: list[int]
    params: SamplingParams
    done: asyncio.Future


@dataclass
class TurnBatcher:
    """Model turns of concurrent episodes -> engine calls, each taking every turn waiting.

    After a call, the episodes it answered go to their environments and come back one by one:
    even a tool of fixed latency answers 64 episodes over some milliseconds (each reply is
    rendered and tokenized on the loop). So a call waits while turns keep coming: until every
    active episode waits, or no new turn came for `gather_s`, or `max_gather_s` in all. Launching
    at the first turn back would run it nearly alone and leave the rest for the next call, the
    engine's time per call being mostly its steps, not its sequences. A slow environment (a
    tool that sleeps) is not waited for: a gap of `gather_s` ends the gathering.
    """

    engine: Engine | EngineView
    active: int = 0  # episodes not yet ended
    gather_s: float = 0.005  # a gap with no new turn that ends the gathering
    max_gather_s: float = 0.05  # the longest a call waits for more turns
    waiting: list[_Turn] = field(default_factory=list)
    calls: int = 0
    turns: int = 0
    _wake: asyncio.Event | None = None

    def _signal(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def generate(self, context: list[int], params: SamplingParams) -> Sample:
        turn = _Turn(list(context), params, asyncio.get_running_loop().create_future())
        self.waiting.append(turn)
        self._signal()
        return await turn.done

    def ended(self) -> None:
        self.active -= 1
        self._signal()

    async def _until_woken(self, timeout: float | None) -> bool:
        """Until a turn comes or an episode ends (True), or `timeout` passes (False)."""
        assert self._wake is not None
        woken = False
        with contextlib.suppress(TimeoutError):
            woken = await asyncio.wait_for(self._wake.wait(), timeout)
        self._wake.clear()
        return woken

    async def _gather(self) -> None:
        """While turns keep coming: until every active episode waits, no turn came for
        `gather_s`, or `max_gather_s` passed."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.max_gather_s
        while len(self.waiting) < self.active:
            left = end - loop.time()
            if left <= 0 or not await self._until_woken(min(self.gather_s, left)):
                return

    async def serve(self) -> None:
        """Run engine calls until every episode has ended."""
        self._wake = asyncio.Event()
        while self.active > 0:
            if not self.waiting:
                await self._until_woken(None)  # every active episode is with its environment
                continue
            if len(self.waiting) < self.active:
                await self._gather()  # the others may be a moment away
            batch, self.waiting = self.waiting, []
            try:
                results = self.engine.generate([t.context for t in batch], [t.params for t in batch], [1] * len(batch))
            except Exception as exc:  # the engine's failure is every waiting episode's
                for t in batch:
                    t.done.set_exception(exc)
                raise
            self.calls += 1
            self.turns += len(batch)
            for t, [s] in zip(batch, results, strict=True):
                t.done.set_result(s)


def turn_seed(seed: int | None, group_id: str, episode: int, turn: int) -> int | None:
    """A sampling seed per (group, episode, turn) from the group's: the n episodes of a group must
    not sample alike, as vLLM's n samples of one request do not (None stays None)."""
    if seed is None:
        return None
    h = hashlib.blake2b(f"{seed}/{group_id}/{episode}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % (MAX_SEED + 1)


def row_of(group: PromptGroup) -> dict:
    """What an environment's `start` gets: the dataset row as the feeder sent it."""
    return {
        "prompt": group.prompt,
        "answer": group.answer,
        "metadata": dict(group.metadata),
        "prompt_index": group.prompt_index,
    }


def as_sample(ep: Episode) -> Sample | None:
    """An episode as the engine's kind of sample, plus its mask, turns, stop reason and metrics; None for an
    episode that never reached a model turn (its environment failed to start it)."""
    if not ep.prompt_ids or not ep.ids:
        return None
    reason = " ".join((ep.stop_reason or "").split())[:MAX_STOP_REASON] or None  # one line
    return Sample(
        list(ep.prompt_ids),
        list(ep.ids),
        [float(x) for x in ep.logprobs],
        ep.final_text,
        ep.finish_reason,
        model_mask=bytes(ep.mask),
        turns=max(1, ep.num_turns),
        stop_reason=reason,
        env_metrics=ep.metrics(),
    )


def _opening_too_long(ep: Episode, limits: EpisodeLimits) -> str:
    """What to do when an episode's opening alone fills its token budget."""
    if ep.stop_reason != "max_tokens" or not ep.prompt_ids:
        return ""
    return (
        f" (the opening is {len(ep.prompt_ids)} tokens, limits.max_total_tokens {limits.max_total_tokens}: raise "
        "it, the engine's context (GEN_MAX_MODEL_LEN, which caps it) or shorten the opening; the tools "
        "environment's system prompt describes every tool offered)"
    )


@dataclass
class Played:
    """A batch of groups played as episodes: per group its samples, or why it cannot be used."""

    samples: list[list[Sample] | str]  # per group: its n samples, or the reason it failed
    calls: int  # engine calls
    turns: int  # model turns


class Player(Protocol):
    """Who plays an episode's other side instead of an environment object: an external agent
    through the OpenAI-compatible endpoint (generator_svc/agents.py)."""

    def running(self) -> contextlib.AbstractAsyncContextManager: ...

    async def play(self, group: PromptGroup, index: int, generate: Generate) -> Episode: ...


def run_groups(
    engine: Engine | EngineView,
    factory: EnvironmentFactory | None,
    limits: EpisodeLimits,
    codec: Codec,
    groups: Sequence[PromptGroup],
    keepalive: Callable[[], object] | None = None,
    keepalive_s: float = 20.0,
    player: Player | None = None,
) -> Played:
    """Every group's n episodes, concurrently. A group with an episode that never reached a model
    turn is returned as the reason (the caller dead-letters it): a group is used whole or not at all.

    Each episode runs a fresh environment from `factory` (run_episode), or, with a `player`, is
    played by it (its `running()` context held while the batch plays).

    `keepalive`, when given, is called at the start and then every `keepalive_s` while the
    episodes play (the module docstring: holding the batch's prompt entries); its errors are logged."""
    batcher = TurnBatcher(engine, active=sum(g.n for g in groups))

    async def one(g: PromptGroup, i: int) -> Episode:
        turn = 0

        async def generate(context: list[int], room: int):  # type: ignore[no-untyped-def]
            nonlocal turn
            params = g.sampling.model_copy(
                update={
                    "max_tokens": max(1, min(room, g.sampling.max_tokens)),
                    "seed": turn_seed(g.sampling.seed, g.group_id, i, turn),
                }
            )
            turn += 1
            s = await batcher.generate(context, params)
            return s.completion_ids, s.logprobs, s.finish_reason

        try:
            if player is not None:
                return await player.play(g, i, generate)
            assert factory is not None
            return await run_episode(factory(), row_of(g), generate, codec, limits)
        finally:
            batcher.ended()

    async def keep(pool: ThreadPoolExecutor) -> None:
        assert keepalive is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.run_in_executor(pool, keepalive)
            except Exception as exc:  # a missed touch is retried at the next one
                log.warning("keeping the batch's prompt entries claimed failed: %s", exc)
            await asyncio.sleep(keepalive_s)

    async def play() -> list[Episode]:
        # A worker thread per episode for sync environments' calls (run_episode's asyncio.to_thread):
        # asyncio's default pool has min(32, cores + 4), so on 2 cores 64 episodes' tool calls of
        # 50 ms ran 6 at a time, 11 rounds of 50 ms per turn. Threads start only as calls need them.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=max(1, min(batcher.active, MAX_ENV_THREADS)), thread_name_prefix="env-step")
        )
        pool = ThreadPoolExecutor(1, thread_name_prefix="keepalive") if keepalive is not None else None
        holder = None if pool is None else asyncio.create_task(keep(pool))
        try:
            async with player.running() if player is not None else contextlib.nullcontext():
                episodes = asyncio.gather(*(one(g, i) for g in groups for i in range(g.n)))
                await batcher.serve()
                return await episodes
        finally:
            if holder is not None:
                holder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await holder
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)  # a touch riding out a Redis outage is let be

    flat = iter(asyncio.run(play()))
    out: list[list[Sample] | str] = []
    for g in groups:
        eps = [next(flat) for _ in range(g.n)]
        samples = [as_sample(e) for e in eps]
        failed = next((e for e, s in zip(eps, samples, strict=True) if s is None), None)
        out.append(
            [s for s in samples if s is not None]
            if failed is None
            else f"episode {eps.index(failed)} of group {g.group_id} never reached a model turn: "
            f"{failed.stop_reason}" + _opening_too_long(failed, limits)
        )
    return Played(out, batcher.calls, batcher.turns)
