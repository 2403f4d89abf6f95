"""The trainer's parts for one job, built and resumed (`Parts.build`, `Parts.resume`), and the
verbs the loop (trainer_svc/train.py) calls on them that need more than one part."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from broker.fleet import LIVE_STATES
from broker.guard_report import GUARD_ACTOR
from broker.ledger import TrainerLedger
from broker.runtime import ControlWatcher
from broker.streams import (
    CONTROL,
    GROUP_GENERATORS,
    GROUP_REWARDERS,
    GROUP_TRAINERS,
    PROMPTS,
    ROLLOUTS,
    SCORED,
    Consumer,
    JobStreams,
)
from shared.datasets import load_source, load_task
from shared.drop_skew import SkewWatch
from shared.ids import control_id
from shared.jobspec import JobSpec
from shared.metrics import TrainerMetrics
from shared.prompts import renderer
from shared.schema import Control, Scored
from shared.settings import TrainerSettings
from shared.transport import WeightServer, make_server
from trainer_svc import checkpoint
from trainer_svc.algorithms import LrSchedule
from trainer_svc.batch import TrainBatch
from trainer_svc.dist import Ranks
from trainer_svc.evaluation import Evaluator, build_sets
from trainer_svc.feeder import Feeder, Group
from trainer_svc.guard import CollapseGuard, RollBack
from trainer_svc.isolation import culprits
from trainer_svc.learner import Learner
from trainer_svc.redis_state import RedisWatch
from trainer_svc.sink import Batch, TrainSink, flatten_batch
from trainer_svc.staleness import StalenessBound
from trainer_svc.state import LoopState
from trainer_svc.tracking import Tracking
from trainer_svc.weights import publish_weights

log = logging.getLogger(__name__)


@dataclass
class Parts:
    settings: TrainerSettings
    spec: JobSpec
    job_id: str
    ledger: TrainerLedger
    streams: JobStreams
    ranks: Ranks
    prom: TrainerMetrics
    learner: Learner
    state: LoopState
    feeder: Feeder
    evaluator: Evaluator
    sink: TrainSink
    control: ControlWatcher
    server: WeightServer
    scored_in: JobStreams  # the scored stream without idle reclaim (checkpoint.singleton_consumer)
    resume: checkpoint.Resume | None
    tracking: Tracking  # the job's TensorBoard / MLflow / W&B run, if any (trainer_svc/tracking.py)
    drop_skew: SkewWatch  # what dropping skews over the job, warned in the log (shared/drop_skew.py)
    held: list[str] = field(
        default_factory=list
    )  # scored entries of trained steps, acked once a checkpoint covers them
    t_boot: float = field(default_factory=time.perf_counter)
    redis: RedisWatch | None = None  # whether Redis still holds the job's state (trainer_svc/redis_state.py)

    @property
    def reader(self) -> Consumer:
        """The trainer in its group: one per job, so its name is the settings' consumer id."""
        return Consumer(SCORED, GROUP_TRAINERS, self.settings.consumer_id, Scored)

    @classmethod
    def build(
        cls,
        settings: TrainerSettings,
        job_id: str,
        spec: JobSpec,
        ledger: TrainerLedger,
        streams: JobStreams,
        ranks: Ranks,
        registry: CollectorRegistry | None = None,
    ) -> Parts:
        t_boot = time.perf_counter()
        if settings.threads:
            torch.set_num_threads(settings.threads)
        torch.manual_seed(spec.seed)
        prom = TrainerMetrics(registry, job_id)  # registry: this job's (train.run serves the process's)
        streams.on_dead_letter = prom.dead_letter
        # resume: the newest committed checkpoint, the feed journal and the ledger (trainer_svc/checkpoint.py)
        resume = checkpoint.plan_resume(settings.checkpoint_dir, job_id, ledger)
        learner = Learner(spec, settings.device, resume.checkpoint if resume else None, ranks)
        log.info("trainer: model loaded in %.2fs", time.perf_counter() - t_boot)
        if not spec.checkpoint_every:
            log.warning(
                "checkpoint_every is 0: a restarted trainer re-does every step from the initial model, "
                "and Redis holds every trained sample until the job ends"
            )
        train_set, test_set = load_task(spec.task, spec.seed)
        eval_problems = {
            es.name: (test_set if es.dataset is None else load_source(es.dataset, spec.task, spec.seed))[
                : es.max_problems
            ]
            for es in spec.evaluation_sets()
        }
        # prompts rendered once (chat template or plain text) and carried as token ids from here on
        render = renderer(learner.tokenizer, spec.chat_template, spec.chat_template_kwargs)
        for stream, group in ((PROMPTS, GROUP_GENERATORS), (ROLLOUTS, GROUP_REWARDERS), (SCORED, GROUP_TRAINERS)):
            streams.ensure_group(stream, group)
        # A new run id per trainer process, resumed or not. Announcements carry it, so generators drop
        # the dead trainer's weight server and reload from this one even though the version numbers
        # repeat (the re-done steps re-publish them). New group ids carry it too: the feed counter
        # continues from the journal, and the run id keeps them apart from any group a predecessor fed
        # after its last journal write. The predecessor's in-flight groups keep their ids.
        run_id = uuid.uuid4().hex[:8]
        redis = RedisWatch(streams, run_id)
        redis.stamp()  # its absence later: Redis lost the job's state
        feeder = Feeder(
            streams,
            spec,
            train_set,
            render,
            run_id,
            journal=checkpoint.FeedJournal(settings.checkpoint_dir, job_id).write,
        )
        tracking = Tracking.open(settings, job_id, spec, resume.step if resume else 0)
        evaluator = Evaluator(spec, build_sets(spec, eval_problems, render), feeder, streams, ledger, job_id, tracking)
        guard = CollapseGuard(spec.guard, spec.algorithm.loss)
        control = ControlWatcher(streams)
        state = LoopState(
            run_id,
            learner.lr,
            StalenessBound(spec),
            guard,
            feeder,
            control.settings,
            schedule=LrSchedule.from_spec(spec),
        )
        server = make_server(
            settings.transport,
            host=settings.bind_host,
            port=settings.bind_port,
            keep=settings.keep_versions,
            advertise_host=settings.advertise_host,
        )
        log.info("trainer: ready in %.2fs (model, data, prompts, weight server)", time.perf_counter() - t_boot)
        return cls(
            settings,
            spec,
            job_id,
            ledger,
            streams,
            ranks,
            prom,
            learner,
            state,
            feeder,
            evaluator,
            TrainSink(spec, streams, ledger, feeder, evaluator, guard, learner.vocab_size, learner.context),
            control,
            server,
            checkpoint.singleton_consumer(streams),
            resume,
            tracking,
            SkewWatch(spec.drop_skew.max_shift, spec.drop_skew.min_dropped),
            t_boot=t_boot,
            redis=redis,
        )

    def take_over(self) -> int:
        """Continue where a predecessor stopped: its feeder state and replayed steps, every entry it
        left pending (checkpoint.take_over), then the checkpoint's loop state and RNG, last, and the
        live knobs set since it. Returns how many entries were taken over."""
        resume, state, sink = self.resume, self.state, self.sink
        if resume is not None:
            state.step, state.version = resume.step, resume.version
            # the steps the job kept, so the drop skew's warning speaks for the whole job
            for row in self.ledger.train_steps(self.job_id):
                if row["step"] <= resume.step:
                    self.drop_skew.tally.add(row["metrics"])
            state.replay_lr = dict(resume.replay_lr)
            if resume.feeder is not None:
                self.feeder.restore(resume.feeder)
            sink.expect_replay(resume.replay)
            self.evaluator.restore(self.feeder.open_evals, resume.eval_steps)
        # samples of versions a predecessor published are not from the future
        sink.newest_version = max([state.version, *(resume.checksums if resume is not None else ())])
        taken = checkpoint.take_over(self.streams, self.reader)
        sink.add(taken, state.version)
        sink.check_replay(state.version)
        if resume is not None and resume.checkpoint is not None:
            self.learner.restore(resume.checkpoint, weights=False)  # the weights came with the model
            applied = state.restore(checkpoint.load_state(resume.checkpoint))
            self.control.poll()  # the control stream replays from its start: apply only knobs set since the checkpoint
            since = {key: v for key, v in self.control.take_changes().items() if applied.get(key) != v}
            if since:
                self.apply_knobs(since)
        return len(taken)

    # --- verbs ---------------------------------------------------------------------------------

    def apply_knobs(self, knobs: dict[str, float]) -> None:
        """Live knobs (PATCH /jobs/{id}), from this step on."""
        if "lr" in knobs:
            self.state.lr = float(knobs["lr"])
        if "max_staleness" in knobs:
            self.state.bound.set_knob(int(knobs["max_staleness"]))
        self.feeder.temperature = float(knobs.get("temperature", self.feeder.temperature))
        self.feeder.top_p = float(knobs.get("top_p", self.feeder.top_p))
        self.feeder.top_k = int(knobs.get("top_k", self.feeder.top_k))
        self.tracking.change(self.state.step + 1, "knobs", knobs)
        log.info("live knobs applied: %s", knobs)

    def feed(self) -> None:
        """Fill the free slots of the next k + 1 versions (trainer_svc/feeder.py)."""
        with self.prom.phases.span("feed"):
            self.feeder.top_up(self.state.version, self.state.bound.k)

    def collect(self) -> Batch | None:
        """The next step's batch: feed the free slots, then read the scored stream into the sink
        until it holds the step's groups (TrainSink.take: complete, in feed order, within the
        staleness bound; the rest dropped and counted), refilling the slots drops free on the way.
        A complete batch waits out a pause (no step advances while paused; nothing is dropped
        either). None once the job is to stop."""
        st, control, sink = self.state, self.control, self.sink
        self.feed()
        sink.begin(st.step + 1, st.version, st.bound.k)
        while True:
            with self.prom.phases.span("assemble"):
                batch = sink.take()
            if batch is not None:
                break
            if sink.dropped_any():
                self.feed()  # replace dropped groups so the step can fill
            self.take_scored(self.settings.block_ms)
            control.poll()
            if control.done:
                return None
        while control.state == "paused":
            self.wait_paused()
        return None if control.done else batch

    def take_scored(self, block_ms: int) -> int:
        """Read the scored stream into the sink (blocking up to `block_ms`), settle dead letters,
        and refill the slots they freed (and those of groups the sink dropped for a member it
        dead-lettered itself); returns how many entries were read."""
        self.ranks.keepalive()  # the other ranks wait in a collective meanwhile: keep it from timing out
        # Redis came back empty: re-announce, re-create the groups, settle what it lost
        lost = self.redis.recover(self.sink, self.state.version) if self.redis and self.redis.lost() else 0
        with self.prom.phases.span("read"):
            got = self.scored_in.consume(self.reader, count=512, block_ms=block_ms)
        flying = len(self.feeder.in_flight)
        with self.prom.phases.span("assemble"):
            n = self.sink.add(got, self.state.version)  # a member it dead-letters may drop its group
        freed = lost + self.sink.poll_dead(self.state.version) + self.sink.settle_lost(self.state.version)
        if (
            (freed or len(self.feeder.in_flight) < flying)
            and self.state.step < self.spec.steps
            and not self.control.done
        ):
            self.feed()  # refill the freed slots
        return n

    def isolate(self, batch: Batch, exc: Exception) -> bool:
        """The step raised `exc` on `batch`: find the groups that raise on their own (bisected
        with Learner.check, trainer_svc/isolation.py), drop them with the error as the reason and
        put the others back for the step's next try (TrainSink.isolate). Returns False, with
        nothing changed, when the input cannot be blamed: no group raises alone (the error does not
        repeat, or needs several groups together), every group of a batch of several does (the
        model's or the job's fault, not one input's), the step re-does a predecessor's (its groups
        are fixed), or the model spans several ranks (a pass there is a collective).

        Raises:
            RuntimeError: the groups dropped this way ended the job's progress (TrainSink.isolate).
        """
        if batch.redo is not None or self.ranks.world_size > 1:
            return False
        log.error("step %d raised %s: %s; looking for the groups it comes from", batch.step, type(exc).__name__, exc)

        def probe(groups: Sequence[Group]) -> None:
            samples, rewards = flatten_batch(list(groups))
            self.learner.check(TrainBatch.of(samples, rewards))

        found = culprits(batch.groups, probe)
        if not found or len(found) == len(batch.groups) > 1:
            log.error(
                "no group of step %d raises it alone (%d of %d do): not the input's",
                batch.step,
                len(found),
                len(batch.groups),
            )
            return False
        self.sink.isolate(batch, {batch.groups[i].group_id: f"{type(e).__name__}: {e}" for i, e in found.items()})
        return True

    def wait_paused(self) -> None:
        self.ranks.keepalive()
        self.control.poll(block_ms=self.settings.block_ms)

    def publish(self) -> tuple[float, str]:
        """Serve and announce the current version; (seconds, checksum)."""
        self.sink.newest_version = max(self.sink.newest_version or 0, self.state.version)
        with self.prom.phases.span("snapshot"):  # the probe's forward included
            snapshot = self.learner.snapshot()
        return publish_weights(
            self.learner.model,
            self.state.version,
            self.server,
            self.streams,
            self.ledger,
            self.job_id,
            self.settings.keep_versions,
            self.state.run_id,
            snapshot,
            self.prom.phases,
            max_staleness=self.state.bound.k,
            lora=None if self.spec.lora is None else self.spec.lora.adapter(),
            on_announce=None if self.redis is None else self.redis.announced,
        )

    def compare_redone(self, checksum: str) -> None:
        """A resume's re-done step against what its predecessor published (equal on CPU, bit for bit)."""
        st, resume = self.state, self.resume
        assert resume is not None
        before = resume.checksums.get(st.version)
        if before == checksum:
            log.info("re-done step %d reproduces version %d (checksum %s)", st.step, st.version, checksum)
        else:
            log.warning(
                "re-done step %d gives version %d checksum %s, the predecessor published %s "
                "(non-deterministic kernels?)",
                st.step,
                st.version,
                checksum,
                before,
            )

    def roll_back(self, rb: RollBack) -> bool:
        """Carry out a collapse guard trip: the policy the plan trusts (none: what
        guard.on_no_checkpoint says), a lower lr, a tighter staleness bound if the importance
        weights blew up, the change recorded in the ledger. Returns whether the step is to be
        redone (False: the current policy was kept, this step's update stands).

        Raises:
            RuntimeError: the plan is to fail the job.
        """
        state, change = self.state, rb.change()
        if rb.plan.action == "fail":
            self._record_trip(rb.step, change)
            raise RuntimeError(f"collapse guard: {rb.reason} at step {rb.step}; {rb.plan.note}")
        if rb.redo:
            back_to = rb.back_to
            self.learner.restore(
                checkpoint.step_dir(self.settings.checkpoint_dir, self.job_id, back_to) if back_to else None
            )
        state.lr *= self.spec.guard.lr_factor
        if rb.kind == "is_blowup":
            state.bound.tighten()
        change |= {
            "rolled_back_to_step": rb.plan.step,
            "discarded_steps": list(range(rb.back_to + 1, rb.step)),
            "lr": state.lr,
            "max_staleness": state.bound.k,
        }
        self._record_trip(rb.step, change)
        log.error(
            "collapse guard: %s at step %d; %s; lr %.3g, staleness bound %d",
            rb.reason,
            rb.step,
            rb.plan.note,
            state.lr,
            state.bound.k,
        )
        return rb.redo

    def _record_trip(self, step: int, change: dict[str, Any]) -> None:
        """A guard trip in the job's change log (broker/guard_report.py reads it) and its tracking."""
        self.ledger.record_change(self.job_id, GUARD_ACTOR, change)
        self.tracking.change(step, "guard", change)

    def checkpoint(self) -> None:
        """Checkpoint this step boundary, then ack the entries of the steps it covers."""
        self.state.checkpoint(self.learner, self.settings.checkpoint_dir, self.job_id, self.ledger)
        self.streams.ack(SCORED, GROUP_TRAINERS, self.held)
        self.held.clear()

    def finish(self) -> None:
        """After the loop: checkpoint what a restart or an export needs, the final evaluation, the job's state."""
        st, control, ledger, job_id = self.state, self.control, self.ledger, self.job_id
        if control.state == "terminating":  # SIGTERM: a restart of this process, not the user's stop
            if st.step > 0:
                self.checkpoint()
            log.info(
                "trainer terminated at step %d (version %d), checkpointed; the job stays running", st.step, st.version
            )
            self.server.close()
            return
        if control.state == "cancelled":  # immediate: no final evaluation, nothing more published
            ledger.move_job(job_id, LIVE_STATES, "cancelled")  # a job failed by another service stays failed
            log.info("trainer cancelled at step %d (version %d)", st.step, st.version)
            self.server.close()
            return
        if st.step > 0:  # the final policy, for evaluation and export
            self.checkpoint()
        # final evaluation of every set, then wait for every outstanding round
        self.evaluator.start_due(st.step, st.version, final=True)
        # what Redis lost is recorded (not waited for), now and while the evaluation runs
        self.sink.settle_lost(st.version, every=True, min_interval_s=0)
        deadline = time.monotonic() + self.settings.job_wait_s
        while self.evaluator.pending and time.monotonic() < deadline:
            self.take_scored(self.settings.block_ms)
            self.sink.settle_lost(st.version, every=True)
        ledger.move_job(job_id, LIVE_STATES, "finished" if st.step >= self.spec.steps else "stopped")
        # The job is over for every service of it: generators and rewarders exit on this.
        self.streams.publish(
            CONTROL,
            Control(
                job_id=job_id,
                msg_id=control_id("end", str(st.step)),
                policy_version=st.version,
                command="drain",
                reason=f"trainer finished at step {st.step}",
            ),
        )
        log.info("trainer done at step %d (version %d)", st.step, st.version)
        self.server.close()
