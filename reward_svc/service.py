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
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence

from broker.ledger import Ledger, write_isolating
from broker.runtime import ControlWatcher, JobContext, open_job, sample_row
from broker.streams import GROUP_REWARDERS, ROLLOUTS, SCORED, Delivery, JobStreams
from shared.jobspec import JobSpec
from shared.metrics import RewardMetrics, serve_metrics
from shared.rewards import RewardInput, RewardResult, RewardScorer, build_scorer
from shared.rewards.base import MAX_REASON
from shared.schema import Rollout, Scored, clean_text
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


DUPLICATE = "duplicate_msg_id"  # trainer_svc.feeder ignores dead letters with this code


def record_generated(streams: JobStreams, ledger: Ledger, deliveries: list[Delivery]) -> list[Delivery]:
    """Write the batch's ledger rows (status `generated`, msg_id keyed: a no-op for rows the
    generator wrote). A rollout whose row the database refuses is dead-lettered with the database's
    reason; returns the others."""
    _, refused = write_isolating(ledger.record_generated, [sample_row(d.message) for d in deliveries])  # type: ignore[arg-type]
    for i, why in refused.items():
        d = deliveries[i]
        streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id, f"the ledger refused the sample: {why}",
                            code="ledger_rejected", message=d.message)
    return [d for i, d in enumerate(deliveries) if i not in refused]


def record_scored(streams: JobStreams, ledger: Ledger, batch: list[tuple[Delivery, Scored]]) -> list[tuple[Delivery, Scored]]:
    """Record the rewards; returns the (entry, message) pairs to publish. Dead-lettered instead: a
    sample the database refuses (its reason), and a second entry of a msg_id already scored."""
    # "entry": the source of the reward, so a retry of this entry (its publish lost to a crash)
    # counts as this entry's scoring, and another entry with the msg_id does not.
    rows = [(s.msg_id, s.reward, s.reward_status,
             {"components": dict(s.details), "reason": s.reward_reason, "entry": f"{ROLLOUTS}/{d.entry_id}"})
            for d, s in batch]
    done, refused = write_isolating(ledger.record_scored_ids, rows)
    mine = set().union(*done)
    out = []
    for i, (d, s) in enumerate(batch):
        if i in refused:
            streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id, f"the ledger refused the reward: {refused[i]}",
                                code="ledger_rejected", message=d.message)
        elif s.msg_id in mine:
            out.append((d, s))
        else:
            streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id,
                                f"msg_id {s.msg_id} is already scored: another entry carried it first", code=DUPLICATE,
                                message=d.message)
    return out


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
        if resuming:  # one at a time: the predecessor may have died of one of them
            deliveries = streams.consume_own_pending(ROLLOUTS, GROUP_REWARDERS, cid, Rollout, count=1)
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
        deliveries = record_generated(streams, ledger, deliveries)
        todo, seen = [], set()
        for d in deliveries:
            r: Rollout = d.message  # type: ignore[assignment]
            if not r.completion_ids:
                # No token to carry a gradient, and a zero-length sequence divides by zero in the
                # per-sequence loss aggregations.
                streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id,
                                    "empty completion: the rollout has no completion tokens", code="empty_completion",
                                    message=r)
            elif r.msg_id in seen:
                streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id,
                                    f"msg_id {r.msg_id} appears twice in one read", code=DUPLICATE, message=r)
            else:
                seen.add(r.msg_id)
                todo.append(d)
        # score: the whole batch at once; a slow or hung sample costs its own budget, not the others'
        results = loop.run_until_complete(score(scorers, [d.message for d in todo]))  # type: ignore[misc]
        batch = []
        for d, (scorer, res) in zip(todo, results, strict=True):
            r = d.message  # type: ignore[assignment]
            reward = scorer.reward_for(res)
            if reward is None:  # on_failure "drop": the trainer drops the group
                streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id, f"reward {res.status}: {res.reason}",
                                    code=f"reward_{res.status}", message=r)
                continue
            details = {clean_text(str(k))[:256]: float(v) for k, v in res.components.items()}
            bad = [k for k, v in details.items() if not math.isfinite(v)]
            if not math.isfinite(reward) or bad:
                what = f"reward {reward}" if not math.isfinite(reward) else f"reward component {bad[0]} {details[bad[0]]}"
                streams.dead_letter(ROLLOUTS, GROUP_REWARDERS, d.entry_id, f"{what} is not finite",
                                    code="non_finite_reward", message=r)
                continue
            if not res.ok:
                log.warning("reward %s on %s: %s (reward %s under on_failure %s)", res.status, r.msg_id, res.reason,
                            reward, scorer.on_failure)
            batch.append((d, Scored(job_id=r.job_id, msg_id=r.msg_id, group_id=r.group_id,
                                    policy_version=r.policy_version, rollout=r, reward=reward, details=details,
                                    reward_status=res.status, reward_reason=clean_text(res.reason)[:MAX_REASON])))
        # ledger + publish + ack: publish and ack as one atomic step, only while this consumer still
        # holds the entry (a replica that reclaimed it meanwhile publishes its own copy)
        batch = record_scored(streams, ledger, batch)
        done = streams.publish_if_owned(SCORED, [(d.entry_id, [s]) for d, s in batch], ROLLOUTS, GROUP_REWARDERS, cid)
        batch = [b for b, ok in zip(batch, done, strict=True) if ok]
        metrics.scored([s.reward for _, s in batch])
        metrics.statuses(Counter(res.status for _, res in results))
        log.debug("scored %d in %.3fs", len(batch), time.perf_counter() - t0)
    log.info("reward %s stopping (%s)", cid, control.state)
