"""Trainer service: scored groups -> advantages -> policy loss -> optimizer step -> publish weights.

`_train` is the loop, top to bottom: take the live knobs changed, collect (Parts.collect: feed,
then a complete, fresh batch from the sink, trainer_svc/sink.py; None once the job is to stop),
train (trainer_svc/learner.py, the collapse guard checking the update before anyone sees it),
publish weights (trainer_svc/weights.py), ledger + metrics, evaluate, checkpoint.
The parts it calls on are built in trainer_svc/parts.py. Async and sync modes are the same loop;
sync is max staleness 0 with an in-flight cap of one batch, so the generator can only start the
next batch after the new weights are published.

Under `torchrun` rank 0 runs this loop and the other ranks run `follow` (trainer_svc/dist.py:
what is sharded, who does what); at world size 1 the loop is all there is.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from prometheus_client import CollectorRegistry

from broker.fleet import LIVE_STATES, Fleet, fail_everywhere
from broker.ledger.rows import UsedItem
from broker.runtime import JobContext
from broker.streams import (
    GROUP_GENERATORS,
    GROUP_REWARDERS,
    GROUP_TRAINERS,
    PROMPTS,
    ROLLOUTS,
    SCORED,
)
from shared.drop_skew import step_metrics as drop_skew_metrics
from shared.entry import Terminated, drain_requested
from shared.evalmetrics import episode_means
from shared.logs import set_context
from shared.metrics import job_registry, serve_metrics
from shared.settings import TrainerSettings
from trainer_svc.dist import Ranks
from trainer_svc.learner import follow
from trainer_svc.offload import Offload
from trainer_svc.parts import Parts
from trainer_svc.replay import Taken, capture_rng, software_identity, step_input
from trainer_svc.reward_errors import RewardErrorStreak, RewardsFailed, error_fraction
from trainer_svc.sink import Batch, overlong_reason, record_used, split_trained
from trainer_svc.staleness import staleness_lr_scale

log = logging.getLogger(__name__)


def run(settings: TrainerSettings) -> None:
    """Train jobs (broker.fleet: JOB_ID's one job, else the fleet's queue, one after another, in
    this one process: torch and the model code stay loaded)."""
    ranks = Ranks.from_env(settings.device)  # torchrun: join the process group; else world size 1
    if not ranks.is_main:
        follow(settings, ranks)
        ranks.close()
        return
    # one server for the process's life: each job's metrics come and go with the job (job_registry)
    registry = serve_metrics(settings.metrics_port, "trainer")
    fleet = Fleet(settings, "trainer", settings.consumer_id)
    try:
        for ctx in fleet.jobs():
            train_job(settings, ctx, ranks, registry)
            fleet.served(ctx.job_id)
            if drain_requested():
                break  # SIGTERM: the job (checkpointed) goes on with this process's successor
    finally:
        fleet.close()
    ranks.announce("exit")
    ranks.close()


def train_job(settings: TrainerSettings, ctx: JobContext, ranks: Ranks, registry: CollectorRegistry | None) -> None:
    """One job, from its parts' build to its end state. A job that fails (its model, data or
    reward cannot load; its loss went non-finite) is marked failed with the reason and every
    service of it leaves it; with JOB_ID the failure also ends this process (exit 1)."""
    job_id, spec, ledger, streams = ctx.job_id, ctx.spec, ctx.ledger, ctx.streams
    try:
        with job_registry(registry) as job_metrics:
            parts = Parts.build(settings, job_id, spec, ledger, streams, ranks, job_metrics)
            with parts.tracking:  # the job's TensorBoard / MLflow / W&B run, closed however the loop ends
                _train(parts)
    except BaseException as exc:
        # No `exit` for the other ranks: one may be inside a collective; torchrun stops them.
        if isinstance(exc, Terminated):
            raise  # SIGTERM: this process restarts, the job goes on (shared/entry.py)
        if isinstance(exc, KeyboardInterrupt):
            ledger.move_job(job_id, LIVE_STATES, "stopped")
            raise
        log.exception("trainer: job %s failed", job_id)
        fail_everywhere(ledger, streams, job_id, repr(exc))
        if settings.job_id or not isinstance(exc, Exception):
            raise


def _train(p: Parts) -> None:
    spec, st, control, ledger, job_id = p.spec, p.state, p.control, p.ledger, p.job_id
    taken = p.take_over()
    set_context(policy_version=st.version)
    ledger.mark_job_started(job_id)
    ledger.move_job(job_id, LIVE_STATES, "running")
    p.publish()
    # co-located on a GPU: the trainer's state sits in host memory while generators generate
    offload = Offload.for_job(
        p.learner.model, p.learner.optimizer, p.learner.device, spec.placement, p.ranks.world_size
    )
    offload.to_host()
    if p.resume is not None:
        log.info(
            "resumed from %s at step %d (version %d) in %.1fs: re-doing steps %s; %d groups in flight, "
            "%d pending entries taken over",
            p.resume.checkpoint or "the initial model",
            st.step,
            st.version,
            time.perf_counter() - p.t_boot,
            sorted(p.resume.replay),
            len(p.feeder.in_flight),
            taken,
        )
    if st.step == 0:
        p.evaluator.start_due(0, st.version)
    reward_errors = RewardErrorStreak.for_job(spec)
    while st.step < spec.steps:
        t_start = time.perf_counter()
        control.poll()
        if control.done:
            log.info("%s requested at step %d", control.state, st.step)
            break
        if control.state == "paused":
            p.wait_paused()
            continue
        if knobs := control.take_changes():  # live knobs (PATCH /jobs/{id}), applied from this step on
            p.apply_knobs(knobs)

        # collect: complete groups within the staleness bound; the rest dropped and counted
        batch = p.collect()
        if batch is None:
            break
        t_data = time.perf_counter()
        p.prom.phases.observe("wait", t_data - t_start)

        # advantages, loss, step; the collapse guard looks at the update before anyone sees it. A
        # step that raises is taken again without the groups that raise on their own (Parts.isolate)
        offload.to_device()
        done = _train_step(p, batch)
        if done is None:
            offload.to_host()
            continue
        tripped = done.tripped
        st.version += 1
        st.step += 1
        set_context(policy_version=st.version)
        t_train = time.perf_counter()

        # publish weights
        publish_s, checksum = p.publish()
        offload.to_host()  # before the next prompts are fed: the generators wake to a free device
        if batch.redo is not None:
            p.compare_redone(checksum)

        # ledger + metrics; trained entries are held until a checkpoint covers them, the rest acked
        times = {"time/wait_s": t_data - t_start, "time/train_s": t_train - t_data, "time/publish_s": publish_s}
        _record(p, batch, done, checksum, times, t_start)
        # a scorer that only fails fails the job, saying why, rather than let it end `finished`
        why = reward_errors.observe([s.reward_status for s in batch.samples], [s.reward_reason for s in batch.samples])
        if why is not None:
            raise RewardsFailed(why)
        if st.step < spec.steps:
            p.evaluator.start_due(st.step, st.version)

        # checkpoint: every checkpoint_every steps, and right after a roll-back (a resume must not
        # re-do the discarded steps); then the entries of the steps it covers are acked
        if (tripped or spec.checkpoint_every and st.step % spec.checkpoint_every == 0) and st.step < spec.steps:
            p.checkpoint()
    p.finish()


def _train_step(p: Parts, batch: Batch) -> Taken | None:
    """One optimizer step on `batch`, redone after each guard trip that rolls back; returns its
    metrics, whether the guard tripped and what a replay needs of its last try (lr, RNG state, the
    checkpoint a roll-back restored). None: the step raised on groups of the batch, which were
    dropped (Parts.isolate); the step is to be taken again with others.

    Raises:
        RuntimeError: naming what the step raised and its groups, when no group of the batch
            alone is to blame.
    """
    spec, st, data = p.spec, p.state, batch.data
    assert data is not None
    lr_scale = staleness_lr_scale(float(np.mean(batch.staleness))) if spec.algorithm.staleness_lr else 1.0
    rewards, versions = data.rewards.view(-1).tolist(), data.versions.tolist()
    tripped, restored = False, None
    while True:
        # the schedule's lr at this step, scaled by the live lr and staleness (a re-done step: as recorded)
        lr = st.step_lr(batch.step, lr_scale)
        rng = capture_rng(p.learner.device)  # what the step draws from (dropout), for a replay
        try:
            with p.prom.phases.span("learner_step"):
                metrics = p.learner.step(data, lr=lr)
        except Exception as exc:
            if p.isolate(batch, exc):
                return None
            groups = [g.group_id for g in batch.groups]
            more = f" (+{len(groups) - 4} more)" if len(groups) > 4 else ""
            raise RuntimeError(
                f"step {batch.step} raised {type(exc).__name__}: {exc} on groups {groups[:4]}{more}; "
                f"not isolated to a group of them (Parts.isolate)"[:2000]
            ) from exc
        with p.prom.phases.span("guard"):
            trip = st.guard.inspect(metrics, rewards, versions, retry=tripped, redo=batch.redo is not None)
        if trip is None:
            break
        tripped = True
        rb = st.guard.trip(*trip, batch.step, st.version)
        if not p.roll_back(rb):  # the policy was kept: the step stands
            break
        restored = rb.back_to  # the next try starts from this checkpoint's weights and optimizer state
    st.guard.stood(batch.step)
    return Taken(metrics, tripped, lr, rng, restored)


def _record(p: Parts, batch: Batch, taken: Taken, checksum: str, times: dict[str, float], t_start: float) -> None:
    """The step in the ledger (samples used, what it stepped on for a replay, metrics), Prometheus,
    the tracking sinks and the log; acks what it may. `checksum`: the weights' it produced."""
    spec, st, phases, stale = p.spec, p.state, p.prom.phases, batch.staleness
    t_ledger = time.perf_counter()
    used: list[UsedItem] = [
        {
            "msg_id": s.msg_id,
            "status": "trained",
            "trainer_version": batch.version,
            "staleness": age,
            "drop_reason": overlong_reason(s, spec),
        }
        for s, age in zip(batch.samples, stale, strict=True)
    ]
    with phases.span("ledger"):
        changed = record_used(p.ledger, used + batch.dropped)
    # Samples the ledger already had as used: a re-done step's own (expected), else trained twice.
    twice = len(used) + len(batch.dropped) - changed - (len(used) if batch.redo is not None else 0)
    if twice:
        log.error("step %d: %d samples were already used in the ledger", st.step, twice)
    t_record = time.perf_counter()
    if spec.record_steps:
        assert batch.data is not None
        identity = software_identity(p.learner.device, p.ranks.world_size)
        row = step_input(p.job_id, st.step, st.version, batch.data, taken, checksum, identity)
        with phases.span("ledger"):
            p.ledger.record_step_input(row)
    # what dropping skews: the samples trained on their reward against those kept from it since the last step
    trained, kept = split_trained(batch.samples, spec)
    drops = p.sink.take_drops()
    for reason, samples in kept.items():
        drops.setdefault(reason, []).extend(samples)
    metrics = {
        **taken.metrics,
        **episode_means([s.rollout.env_metrics for s in batch.samples]),
        "off_policy/mean": float(np.mean(stale)),
        "off_policy/max": float(max(stale)),
        "off_policy/dropped": float(len(batch.dropped)),
        "reward/error_fraction": error_fraction([s.reward_status for s in batch.samples]),
        "dynamic_sampling/dropped_groups": float(batch.filtered),
        "staleness/bound": float(st.bound.k),
        "ledger/trained_twice": float(twice),
        # dead-lettered by the trainer since the last step; not "samples/...": "samples" is a metric,
        # and MLflow's file store makes each metric name a file
        "rejected/samples": float(p.sink.take_rejected()),
        "resume/redone": float(batch.redo is not None),
        "guard/trips": float(st.guard.trips),
        **drop_skew_metrics(trained, drops),
        **times,
        "time/record_s": time.perf_counter() - t_record,  # encoding and writing the step's input (replay)
        "time/ledger_s": time.perf_counter() - t_ledger,
        "time/step_s": time.perf_counter() - t_start,
        # seconds per phase since the previous step's record (its ledger writes and acks included)
        **{f"phase/{k}_s": v for k, v in phases.take_last().items()},
    }
    metrics["throughput/samples_per_s"] = len(batch.samples) / metrics["time/step_s"]
    st.bound.after_step(metrics)  # the bound for the next step, from this step's drift
    for warning in p.drop_skew.observe(metrics):
        log.warning("step %d: %s", st.step, warning)
    with phases.span("ledger"):
        p.ledger.record_train_step(p.job_id, st.step, st.version, metrics, job_step=True)  # one transaction
    p.prom.step(st.step, st.version, metrics)
    with phases.span("tracking"):
        p.tracking.step(st.step, metrics)
    with phases.span("ack"):
        p.held += p.sink.release(batch)
        p.streams.trim_acked_many(((PROMPTS, GROUP_GENERATORS), (ROLLOUTS, GROUP_REWARDERS), (SCORED, GROUP_TRAINERS)))
    log.info(
        "step %d: reward %.3f loss %.4f is_mean %.3f ess %.3f stale mean %.2f max %d dropped %d "
        "| wait %.2fs train %.2fs",
        st.step,
        metrics["reward/mean"],
        metrics["loss"],
        metrics["is/mean"],
        metrics["is/ess"],
        metrics["off_policy/mean"],
        int(metrics["off_policy/max"]),
        len(batch.dropped),
        metrics["time/wait_s"],
        metrics["time/train_s"],
    )
