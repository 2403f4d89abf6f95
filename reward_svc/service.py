"""Reward service: rollouts -> scored completions.

Loop: read rollouts (consumer group `rewarders`) -> ledger rows of the batch (inserted if the
generator died before writing them; keyed by msg_id) -> score each with the job's reward function
-> ledger (status `scored`) -> publish to `{job}:scored` -> ack. A restarted service of the same
REWARD_CONSUMER_ID first scores what its predecessor left pending; SIGTERM finishes the batch.
A rollout with no completion tokens, or whose reward is not a finite number, goes to the
dead-letter stream with the reason; every dead letter is counted by reason in the metrics. A reward
function that raises is the per-message boundary: logged, left unacked, so redelivery (and after
`max_deliveries`, the dead-letter stream) decides; the service keeps scoring the rest.
"""

from __future__ import annotations

import logging
import math
import time

from broker.runtime import ControlWatcher, open_job, sample_row
from broker.streams import GROUP_REWARDERS, ROLLOUTS, SCORED
from shared.metrics import RewardMetrics, serve_metrics
from shared.rewards import get_reward_fn
from shared.schema import Rollout, Scored
from shared.settings import RewardSettings

log = logging.getLogger(__name__)


def run(settings: RewardSettings) -> None:
    ctx = open_job(settings)
    streams, ledger = ctx.streams, ctx.ledger
    metrics = RewardMetrics(serve_metrics(settings.metrics_port, "reward"), ctx.job_id)
    reward_fn = get_reward_fn(ctx.spec.reward)
    streams.on_dead_letter = metrics.dead_letter  # malformed, oversized, too often delivered
    streams.ensure_group(ROLLOUTS, GROUP_REWARDERS)
    control = ControlWatcher(streams, exit_on=("drain",))  # a user's stop is the trainer's to finish
    cid = settings.consumer_id
    log.info("reward %s ready (%s)", cid, ctx.spec.reward)
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
        scored, ok_ids = [], []
        for d in deliveries:
            r: Rollout = d.message  # type: ignore[assignment]
            if not r.completion_ids:
                # No token to carry a gradient, and a zero-length sequence divides by zero in the
                # per-sequence loss aggregations.
                streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id,
                                    "empty completion: the rollout has no completion tokens", code="empty_completion")
                continue
            try:
                reward = float(reward_fn(r.completion, r.answer))
            except Exception:  # the per-message boundary (STYLE 8): redelivery or the dead stream decides
                log.exception("reward %s failed on %s (delivery %d); left pending", ctx.spec.reward, r.msg_id,
                              d.deliveries)
                continue
            if not math.isfinite(reward):
                streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id, f"reward {reward} is not finite",
                                    code="non_finite_reward")
                continue
            scored.append(Scored(job_id=r.job_id, msg_id=r.msg_id, group_id=r.group_id,
                                 policy_version=r.policy_version, rollout=r, reward=reward))
            ok_ids.append(d.entry_id)
        ledger.record_scored([(s.msg_id, s.reward) for s in scored])
        streams.publish_many(SCORED, scored)
        streams.ack(ROLLOUTS, GROUP_REWARDERS, ok_ids)
        metrics.scored([s.reward for s in scored])
        log.debug("scored %d in %.3fs", len(scored), time.perf_counter() - t0)
    log.info("reward %s stopping (%s)", cid, control.state)
