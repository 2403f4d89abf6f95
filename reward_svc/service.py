"""Reward service: rollouts -> scored completions.

The loop is broker.service.ServiceLoop; `Scoring` is its handler. Each batch: rollouts (consumer
group `rewarders`) -> ledger rows of the batch (inserted if the generator died before writing
them; keyed by msg_id) -> score the batch with the job's reward (shared.rewards: every sample
concurrently, each within its time budget; a rollout of an evaluation set that names its own
reward is scored with that one) -> ledger (status `scored`, with the reward status and its
components or reason) -> publish to `{job}:scored` -> ack. A restarted service of the same
REWARD_CONSUMER_ID first scores what its predecessor left pending; SIGTERM finishes the batch.

A sample whose reward timed out or failed (raised, bad return value, endpoint down) follows the
reward's `on_failure`: "zero" publishes reward 0.0 with reward_status and reward_reason, "drop"
dead-letters it (code reward_timeout / reward_error), which makes the trainer drop its group. A
reward (or a named component of it) that is not a number within the job's `reward_limits.bounds`
(1e308, inf, NaN) is such a failure too: status error, the value in the reason. A rollout with no
completion tokens goes to the dead-letter stream with the reason; every dead letter is counted by
reason in the metrics. A plug-in that does not import fails its job with the reason (broker.fleet),
and so does one whose import exits, crashes the interpreter or hangs (imported in a child process
first, shared.rewards.pool `probe_import`); with JOB_ID the service then exits 0 (nothing left to
serve). A reward's named components are bounded (shared.rewards.base MAX_COMPONENTS: more is the
sample's reward error), and a scored message over the stream's MAX_MESSAGE_BYTES is dead-lettered
(`oversized`), never published.

One bad entry never costs good work. The stream boundary (broker.streams, shared.schema) refuses
what does not validate; a rollout that validates but that the ledger refuses (a value some column
cannot hold) is found by splitting the batch (broker.ledger.write_isolating) and dead-lettered
alone with the database's reason, code `ledger_rejected`; the rest of the batch is written, scored
and acked as usual. Entries a dead predecessor left pending are resumed one at a time, so only the
one that killed it (if any) piles up deliveries. A second entry with a msg_id that is already
scored from another entry is dead-lettered as `duplicate_msg_id` (the trainer ignores that code:
the first copy is alive) and never published again; the ledger records which entry scored a
sample, so a redelivery of that same entry (its predecessor died between the ledger write and the
publish) is published. Publish and ack are one atomic step (JobStreams.publish_if_owned), so each
scored sample reaches the trainer's stream once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from broker.fleet import Fleet, fail_everywhere
from broker.ledger import RewardLedger, write_isolating
from broker.runtime import ControlWatcher, JobContext, sample_row
from broker.service import ServiceLoop
from broker.streams import GROUP_REWARDERS, ROLLOUTS, SCORED, Consumer, Delivery, JobStreams
from shared.entry import JobEnded, JobOver
from shared.jobspec import JobSpec
from shared.metrics import RewardMetrics, job_registry, serve_metrics
from shared.rewards import RewardInput, RewardResult, RewardScorer, build_scorer
from shared.rewards.base import MAX_REASON, RewardLimits, bounded
from shared.schema import Rollout, Scored, clean_text, encode
from shared.settings import RewardSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


def run_on(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], ended: Callable[[], bool] = lambda: False
) -> T:
    """Run `coro` on `loop` and return its result: on the loop's own thread when the loop runs
    there (`LoopThread`: every job's thread scores on the one loop, concurrently), else here.
    On the loop's thread, `ended` is asked every half second: once the job ended (cancelled),
    the batch is abandoned (JobEnded) rather than waited out, however long its rewards hang."""
    if not loop.is_running():
        return loop.run_until_complete(coro)
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    while True:
        try:
            return future.result(timeout=0.5)
        except concurrent.futures.TimeoutError:
            if ended():
                future.cancel()
                raise JobEnded("the job ended while its batch was being scored") from None


class LoopThread:
    """The service's one event loop, running in a thread of its own: every scorer lives in it
    (its HTTP clients, its pool's futures), and the job threads submit their batches to it, so
    one job's slow or hung reward costs that job's batch its time budget, never another job's."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="reward-loop", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


async def score(
    scorers: dict[str, RewardScorer], rollouts: Sequence[Rollout]
) -> list[tuple[RewardScorer, RewardResult]]:
    """Each rollout's result and the scorer (and so the failure policy) that gave it; the rollouts
    of different rewards are scored concurrently."""
    keys = [r.eval_set if r.eval_set in scorers else "" for r in rollouts]
    groups = {k: [i for i, key in enumerate(keys) if key == k] for k in dict.fromkeys(keys)}
    done = await asyncio.gather(
        *(
            scorers[k].score(
                [
                    RewardInput(
                        prompt=rollouts[i].prompt,
                        completion=rollouts[i].completion,
                        answer=rollouts[i].answer,
                        metadata=rollouts[i].metadata,
                        finish_reason=rollouts[i].finish_reason,
                        episode=rollouts[i].env_metrics,
                        completion_ids=rollouts[i].completion_array().tolist(),
                    )
                    for i in idx
                ]
            )
            for k, idx in groups.items()
        )
    )
    out: dict[int, tuple[RewardScorer, RewardResult]] = {}
    for (k, idx), results in zip(groups.items(), done, strict=True):
        out.update({i: (scorers[k], res) for i, res in zip(idx, results, strict=True)})
    return [out[i] for i in range(len(rollouts))]


DUPLICATE = "duplicate_msg_id"  # trainer_svc.feeder ignores dead letters with this code


def record_generated(
    streams: JobStreams, ledger: RewardLedger, deliveries: list[Delivery[Rollout]]
) -> list[Delivery[Rollout]]:
    """Write the batch's ledger rows (status `generated`, msg_id keyed: a no-op for rows the
    generator wrote). A rollout whose row the database refuses is dead-lettered with the database's
    reason; returns the others."""
    _, refused = write_isolating(ledger.record_generated, [sample_row(d.message) for d in deliveries])
    for i, why in refused.items():
        d = deliveries[i]
        streams.dead_letter(
            ROLLOUTS,
            GROUP_REWARDERS,
            d.entry_id,
            f"the ledger refused the sample: {why}",
            code="ledger_rejected",
            message=d.message,
        )
    return [d for i, d in enumerate(deliveries) if i not in refused]


def record_scored(
    streams: JobStreams, ledger: RewardLedger, batch: list[tuple[Delivery[Rollout], Scored]]
) -> list[tuple[Delivery[Rollout], Scored]]:
    """Record the rewards; returns the (entry, message) pairs to publish. Dead-lettered instead: a
    sample the database refuses (its reason), and a second entry of a msg_id already scored."""
    # "entry": the source of the reward, so a retry of this entry (its publish lost to a crash)
    # counts as this entry's scoring, and another entry with the msg_id does not.
    rows = [
        (
            s.msg_id,
            s.reward,
            s.reward_status,
            {"components": dict(s.details), "reason": s.reward_reason, "entry": f"{ROLLOUTS}/{d.entry_id}"},
        )
        for d, s in batch
    ]
    done, refused = write_isolating(ledger.record_scored_ids, rows)
    mine = set().union(*done)
    out = []
    for i, (d, s) in enumerate(batch):
        if i in refused:
            streams.dead_letter(
                ROLLOUTS,
                GROUP_REWARDERS,
                d.entry_id,
                f"the ledger refused the reward: {refused[i]}",
                code="ledger_rejected",
                message=d.message,
            )
        elif s.msg_id in mine:
            out.append((d, s))
        else:
            streams.dead_letter(
                ROLLOUTS,
                GROUP_REWARDERS,
                d.entry_id,
                f"msg_id {s.msg_id} is already scored: another entry carried it first",
                code=DUPLICATE,
                message=d.message,
            )
    return out


def scorer_key(reward: object) -> str:
    """What a kept scorer (its worker processes) must share with the next job's reward: the reward
    spec as JSON, and the bytes of any Python file it names (an edited file is another plug-in)."""
    import hashlib
    import re
    from pathlib import Path

    from pydantic import TypeAdapter

    from shared.rewards import RewardSpec

    text = TypeAdapter(RewardSpec).dump_json(reward).decode()  # type: ignore[arg-type]
    h = hashlib.sha256(text.encode())
    for path in sorted(set(re.findall(r'"([^":]+\.py):[^"]*"', text))):
        f = Path(path)
        h.update(f.read_bytes() if f.is_file() else b"missing")
    return h.hexdigest()[:16]


class Scorers:
    """The reward service's scorers (their worker pools), kept from job to job: a job whose reward
    (or an evaluation set's) is the same plug-in as one left idle by an ended job reuses its
    workers; the others are built for it. A scorer serves one job at a time (a tenant's plug-in
    runs in worker processes of its own: two jobs at once never share a pool), and goes back to
    the idle ones when its job ends (`release`); idle ones the next job does not use are closed."""

    def __init__(self, workers: int, limits: RewardLimits | None = None):
        self.workers = workers
        self.limits = limits or RewardLimits()
        self.idle: dict[str, RewardScorer] = {}
        self.busy: dict[str, dict[str, RewardScorer]] = {}  # job id -> its scorers by key
        self._lock = threading.Lock()

    @property
    def held(self) -> dict[str, RewardScorer]:
        """Every scorer built and not closed (idle or serving a job)."""
        with self._lock:
            return {**self.idle, **{f"{j}:{k}": s for j, mine in self.busy.items() for k, s in mine.items()}}

    def for_job(self, spec: JobSpec, job_id: str = "") -> dict[str, RewardScorer]:
        """The job's reward under "", and under its name each evaluation set's own where it sets one.
        Raises what build_scorer raises (a plug-in that does not import): the job's own fault."""
        wanted = {"": spec.reward, **{es.name: es.reward for es in spec.eval_sets if es.reward is not None}}
        keys = {name: scorer_key(r) for name, r in wanted.items()}
        with self._lock:
            mine = {k: self.idle.pop(k) for k in set(keys.values()) if k in self.idle}
            unused = [self.idle.pop(k) for k in list(self.idle)]  # plug-ins no job uses now: their workers go
            self.busy[job_id] = mine
        for scorer in unused:
            scorer.close()
        for name, r in wanted.items():
            if keys[name] not in mine:
                mine[keys[name]] = build_scorer(r, workers=self.workers, limits=self.limits)
        return {name: mine[keys[name]] for name in wanted}

    def release(self, job_id: str) -> None:
        """The job is over here: its scorers wait idle for a next job with the same plug-in."""
        with self._lock:
            self.idle.update(self.busy.pop(job_id, {}))

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            scorers = [*self.idle.values(), *(s for mine in self.busy.values() for s in mine.values())]
            self.idle.clear()
            self.busy.clear()
        for s in scorers:
            run_on(loop, s.aclose())


class RewardUnusable(RuntimeError):
    """The job's reward cannot be built (its plug-in does not import): the job's own fault."""


def run(settings: RewardSettings) -> None:
    """Score jobs (broker.fleet: JOB_ID's one job, else the fleet's queue) with kept worker pools."""
    registry = serve_metrics(settings.metrics_port, "reward")
    fleet = Fleet(settings, "reward", settings.consumer_id)
    scorers = Scorers(settings.workers, RewardLimits(settings.http_max_bytes, settings.import_timeout_s))
    loop = LoopThread()  # every scorer is used from this one loop (its HTTP clients live in it)
    try:
        # every running job at once, each in its own thread (broker/fleet.py `serve_all`)
        fleet.serve_all(
            lambda ctx: serve_job(settings, ctx, scorers, loop.loop, registry),
            job_faults=(RewardUnusable,),
            max_jobs=settings.max_jobs,
        )
    finally:
        scorers.close(loop.loop)
        loop.close()
        fleet.close()


def serve_job(
    settings: RewardSettings, ctx: JobContext, scorers: Scorers, loop: asyncio.AbstractEventLoop, registry
) -> str:
    """Score one job's rollouts until it ends; returns the final control state (ServiceLoop.run)."""
    with job_registry(registry) as reg:
        metrics = RewardMetrics(reg, ctx.job_id)
        try:
            job_scorers = scorers.for_job(ctx.spec, ctx.job_id)
        except Exception as exc:
            scorers.release(ctx.job_id)
            reason = f"the job's reward cannot be built: {exc}"
            if settings.job_id:  # the one job this service serves: it fails, and nothing is left to serve
                fail_everywhere(ctx.ledger, ctx.streams, ctx.job_id, f"reward: {reason}")
                raise JobOver(f"job {ctx.job_id} failed: {reason}") from exc
            raise RewardUnusable(reason) from exc
        consumer = Consumer(ROLLOUTS, GROUP_REWARDERS, settings.consumer_id, Rollout)
        handler = Scoring(
            ctx.streams, ctx.ledger, consumer, job_scorers, loop, metrics, settings.batch, ctx.spec.reward_limits.bounds
        )
        # a user's stop is the trainer's to finish: only its drain (or a cancel) ends this service
        service = ServiceLoop(
            ctx.streams,
            consumer,
            handler,
            block_ms=settings.block_ms,
            exit_on=("drain",),
            on_dead_letter=metrics.dead_letter,
            phases=metrics.phases,
        )  # malformed, oversized, too often delivered
        handler.ended = service.ended
        main = job_scorers[""]
        log.info(
            "reward %s ready (%s, on_failure %s, %d workers%s)",
            consumer.name,
            main.description,
            main.on_failure,
            settings.workers,
            "".join(f"; eval set {k}: {s.description}" for k, s in job_scorers.items() if k),
        )
        try:
            state = service.run()
        finally:
            scorers.release(ctx.job_id)
        log.info("reward %s stopping (%s)", consumer.name, state)
        return state


class Scoring:
    """The reward service's handler (broker.service.Handler): scores a batch of rollouts at once,
    a slow or hung sample costing its own time budget, not the others'."""

    def __init__(
        self,
        streams: JobStreams,
        ledger: RewardLedger,
        consumer: Consumer,
        scorers: dict[str, RewardScorer],
        loop: asyncio.AbstractEventLoop,
        metrics: RewardMetrics,
        batch: int,
        bounds: tuple[float, float] = (-1e6, 1e6),
    ):
        self.streams, self.ledger, self.consumer = streams, ledger, consumer
        self.scorers, self.loop, self.metrics, self.batch = scorers, loop, metrics, batch
        self.bounds = bounds  # the job's reward_limits.bounds: a reward outside is the sample's error
        # set by the service loop: whether the job ended (a batch being scored is then abandoned)
        self.ended: Callable[[], bool] = lambda: False

    def batch_size(self, control: ControlWatcher) -> int:
        return self.batch

    def more(self, deliveries: list[Delivery[Rollout]]) -> int:
        return 0  # score what one read returned

    def idle(self) -> None:
        pass

    def tick(self) -> None:
        pass

    def handle(self, deliveries: list[Delivery[Rollout]]) -> None:
        t0, phases = time.perf_counter(), self.metrics.phases
        # Before any dead letter: the trainer settles a group once a member is dead-lettered, and
        # its rows must exist by then (a generator killed after publishing never wrote them).
        with phases.span("ledger_generated"):
            todo = self._scorable(record_generated(self.streams, self.ledger, deliveries))
        # score: the whole batch at once
        with phases.span("score"):
            results = [
                (scorer, bounded(res, *self.bounds))
                for scorer, res in run_on(self.loop, score(self.scorers, [d.message for d in todo]), self.ended)
            ]
            batch = [
                (d, s)
                for d, (scorer, res) in zip(todo, results, strict=True)
                if (s := self._scored(d, scorer, res)) is not None
            ]
        # ledger + publish + ack: publish and ack as one atomic step, only while this consumer still
        # holds the entry (a replica that reclaimed it meanwhile publishes its own copy)
        with phases.span("ledger"):
            batch = record_scored(self.streams, self.ledger, batch)
        with phases.span("publish"):
            done = self.streams.publish_if_owned(self.consumer, SCORED, [(d.entry_id, [s]) for d, s in batch])
        batch = [b for b, ok in zip(batch, done, strict=True) if ok]
        self.metrics.scored([s.reward for _, s in batch])
        self.metrics.statuses(Counter(res.status for _, res in results))
        log.debug("scored %d in %.3fs", len(batch), time.perf_counter() - t0)

    def _scorable(self, deliveries: list[Delivery[Rollout]]) -> list[Delivery[Rollout]]:
        """The deliveries to score; dead-lettered instead: an empty completion, and a msg_id seen
        twice in one read."""
        todo, seen = [], set()
        for d in deliveries:
            r = d.message
            if not r.completion_ids:
                # No token to carry a gradient, and a zero-length sequence divides by zero in the
                # per-sequence loss aggregations.
                self._dead(d, "empty completion: the rollout has no completion tokens", "empty_completion")
            elif r.msg_id in seen:
                self._dead(d, f"msg_id {r.msg_id} appears twice in one read", DUPLICATE)
            else:
                seen.add(r.msg_id)
                todo.append(d)
        return todo

    def _scored(self, d: Delivery[Rollout], scorer: RewardScorer, res: RewardResult) -> Scored | None:
        """The scored message of one rollout, or None when it is dead-lettered instead: a failed
        reward under on_failure "drop" (the trainer drops the group). `res` is within the job's
        bounds or failed (`bounded`), so the reward and components published are finite."""
        r = d.message
        reward = scorer.reward_for(res)
        if reward is None:
            self._dead(d, f"reward {res.status}: {res.reason}", f"reward_{res.status}")
            return None
        details = {clean_text(str(k))[:256]: float(v) for k, v in res.components.items()}
        if not res.ok:
            log.warning(
                "reward %s on %s: %s (reward %s under on_failure %s)",
                res.status,
                r.msg_id,
                res.reason,
                reward,
                scorer.on_failure,
            )
        scored = Scored(
            job_id=r.job_id,
            msg_id=r.msg_id,
            group_id=r.group_id,
            policy_version=r.policy_version,
            rollout=r,
            reward=reward,
            details=details,
            reward_status=res.status,
            reward_reason=clean_text(res.reason)[:MAX_REASON],
        )
        # What the trainer would refuse to read (and a 40 MiB entry it would have to skip) is never published.
        size, limit = len(encode(scored)), self.streams.max_message_bytes
        if size > limit:
            self._dead(d, f"the scored message is {size} bytes, over MAX_MESSAGE_BYTES ({limit})", "oversized")
            return None
        return scored

    def _dead(self, d: Delivery[Rollout], reason: str, code: str) -> None:
        self.streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id, reason, code=code, message=d.message)
