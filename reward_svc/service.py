"""Reward service: rollouts -> scored completions.

Loop: read rollouts (consumer group `rewarders`) -> ledger rows of the batch (inserted if the
generator died before writing them; keyed by msg_id) -> score the batch with the job's reward
(shared.rewards: every sample concurrently, each within its time budget; a rollout of an
evaluation set that names its own reward is scored with that one) -> ledger (status
`scored`, with the reward status and its components or reason) -> publish to `{job}:scored` ->
ack. A restarted service of the same REWARD_CONSUMER_ID first scores what its predecessor left
pending; SIGTERM finishes the batch.

A sample whose reward timed out or failed (raised, bad return value, endpoint down) follows the
reward's `on_failure`: "zero" publishes reward 0.0 with reward_status and reward_reason, "drop"
dead-letters it (code reward_timeout / reward_error), which makes the trainer drop its group. A
rollout with no completion tokens, or whose reward is not a finite number, goes to the dead-letter
stream with the reason; every dead letter is counted by reason in the metrics. A plug-in that does
not import fails the service at start-up (shared.entry marks it in the logs and exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence

from broker.runtime import ControlWatcher, JobContext, open_job, sample_row
from broker.streams import GROUP_REWARDERS, ROLLOUTS, SCORED
from shared.jobspec import JobSpec
from shared.metrics import RewardMetrics, serve_metrics
from shared.rewards import RewardInput, RewardResult, RewardScorer, build_scorer
from shared.schema import Rollout, Scored
from shared.settings import RewardSettings

log = logging.getLogger(__name__)


def build_scorers(spec: JobSpec, workers: int) -> dict[str, RewardScorer]:
    """The job's reward under "", and under its name each evaluation set's own where it sets one
    (each with its own `workers` processes). Raises what build_scorer raises (a plug-in that does
    not import): the service fails at start-up."""
    scorers = {"": build_scorer(spec.reward, workers=workers)}
    try:
        for es in spec.eval_sets:
            if es.reward is not None:
                scorers[es.name] = build_scorer(es.reward, workers=workers)
    except BaseException:
        for s in scorers.values():
            s.close()
        raise
    return scorers


async def score(scorers: dict[str, RewardScorer], rollouts: Sequence[Rollout]) -> list[tuple[RewardScorer, RewardResult]]:
    """Each rollout's result and the scorer (and so the failure policy) that gave it; the rollouts
    of different rewards are scored concurrently."""
    keys = [r.eval_set if r.eval_set in scorers else "" for r in rollouts]
    groups = {k: [i for i, key in enumerate(keys) if key == k] for k in dict.fromkeys(keys)}
    done = await asyncio.gather(*(
        scorers[k].score([
            RewardInput(prompt=rollouts[i].prompt, completion=rollouts[i].completion, answer=rollouts[i].answer,
                        metadata=rollouts[i].metadata, finish_reason=rollouts[i].finish_reason)
            for i in idx
        ])
        for k, idx in groups.items()
    ))
    out: dict[int, tuple[RewardScorer, RewardResult]] = {}
    for (k, idx), results in zip(groups.items(), done, strict=True):
        out.update({i: (scorers[k], res) for i, res in zip(idx, results, strict=True)})
    return [out[i] for i in range(len(rollouts))]


def run(settings: RewardSettings) -> None:
    ctx = open_job(settings)
    metrics = RewardMetrics(serve_metrics(settings.metrics_port, "reward"), ctx.job_id)
    scorers = build_scorers(ctx.spec, settings.workers)
    loop = asyncio.new_event_loop()  # every scorer is used from this one loop (its HTTP clients live in it)
    try:
        _serve(settings, ctx, scorers, loop, metrics)
    finally:
        for s in scorers.values():
            loop.run_until_complete(s.aclose())
        loop.close()


def _serve(settings: RewardSettings, ctx: JobContext, scorers: dict[str, RewardScorer],
           loop: asyncio.AbstractEventLoop, metrics: RewardMetrics) -> None:
    streams, ledger = ctx.streams, ctx.ledger
    streams.on_dead_letter = metrics.dead_letter  # malformed, oversized, too often delivered
    streams.ensure_group(ROLLOUTS, GROUP_REWARDERS)
    control = ControlWatcher(streams, exit_on=("drain",))  # a user's stop is the trainer's to finish
    cid = settings.consumer_id
    log.info("reward %s ready (%s, on_failure %s, %d workers%s)", cid, scorers[""].description,
             scorers[""].on_failure, settings.workers,
             "".join(f"; eval set {k}: {s.description}" for k, s in scorers.items() if k))
    resuming = True  # first the entries a predecessor of this name left pending
    while True:
        control.poll()
        if control.done:
            break
        if control.state == "paused":
            control.poll(block_ms=settings.block_ms)
            continue
        deliveries = []
        if resuming:
            deliveries = streams.consume_own_pending(ROLLOUTS, GROUP_REWARDERS, cid, Rollout, count=settings.batch)
            resuming = bool(deliveries)
        if not deliveries:
            deliveries = streams.consume(
                ROLLOUTS, GROUP_REWARDERS, cid, Rollout, count=settings.batch, block_ms=settings.block_ms
            )
        if not deliveries:
            continue
        t0 = time.perf_counter()
        # Before any dead letter: the trainer settles a group once a member is dead-lettered, and
        # its rows must exist by then (a generator killed after publishing never wrote them).
        ledger.record_generated([sample_row(d.message) for d in deliveries])  # type: ignore[arg-type]
        todo = []
        for d in deliveries:
            if not d.message.completion_ids:  # type: ignore[attr-defined]
                # No token to carry a gradient, and a zero-length sequence divides by zero in the
                # per-sequence loss aggregations.
                streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id,
                                    "empty completion: the rollout has no completion tokens", code="empty_completion")
            else:
                todo.append(d)
        # score: the whole batch at once; a slow or hung sample costs its own budget, not the others'
        results = loop.run_until_complete(score(scorers, [d.message for d in todo]))  # type: ignore[misc]
        scored, rows, ok_ids = [], [], []
        for d, (scorer, res) in zip(todo, results, strict=True):
            r: Rollout = d.message  # type: ignore[assignment]
            reward = scorer.reward_for(res)
            if reward is None:  # on_failure "drop": the trainer drops the group
                streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id, f"reward {res.status}: {res.reason}",
                                    code=f"reward_{res.status}")
                continue
            if not math.isfinite(reward):
                streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id, f"reward {reward} is not finite",
                                    code="non_finite_reward")
                continue
            if not res.ok:
                log.warning("reward %s on %s: %s (reward %s under on_failure %s)", res.status, r.msg_id, res.reason,
                            reward, scorer.on_failure)
            details = dict(res.components)
            scored.append(Scored(job_id=r.job_id, msg_id=r.msg_id, group_id=r.group_id,
                                 policy_version=r.policy_version, rollout=r, reward=reward, details=details,
                                 reward_status=res.status, reward_reason=res.reason))
            rows.append((r.msg_id, reward, res.status, {"components": details, "reason": res.reason}))
            ok_ids.append(d.entry_id)
        # ledger + publish + ack
        ledger.record_scored(rows)
        streams.publish_many(SCORED, scored)
        streams.ack(ROLLOUTS, GROUP_REWARDERS, ok_ids)
        metrics.scored([s.reward for s in scored])
        metrics.statuses(Counter(res.status for _, res in results))
        log.debug("scored %d in %.3fs", len(scored), time.perf_counter() - t0)
    log.info("reward %s stopping (%s)", cid, control.state)
