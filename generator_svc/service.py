"""Generator service: prompt groups -> completions with behaviour logprobs, tagged with the policy version.

The loop is broker.service.ServiceLoop; `Generation` is its handler. Each batch: prompt groups
(consumer group `generators`) -> make sure the engine holds at least the version each group was
fed at (pull + verify + swap in place, between generate calls) -> one generate call at that
single version -> publish each group's rollouts and ack its prompt entry in one atomic step, only
if this generator still holds the entry -> ledger rows (status `generated`). A prompt group the
engine cannot take (a prompt that fills the context) goes to the dead-letter stream with the
reason before the call; the rest of the batch is generated.

Partial rollouts across restarts. A restarted generator (same GEN_GENERATOR_ID) first generates the
entries it left pending; another replica reclaims a dead one's after `claim_idle_ms`. Publishing is
conditional on still holding the entry, so of two generations of one group (a reclaim raced a slow
but live generator, or a kill fell between publish and ack) exactly one reaches the streams. The
ledger write comes after the publish because only the published copy may be recorded; a kill in
between loses nothing: the reward service writes the same row (msg_id keyed) before scoring.
SIGTERM finishes the batch in hand (publish, ack), then exits 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
from pydantic import ValidationError

from broker.ledger import write_isolating
from broker.runtime import ControlWatcher, JobContext, open_job, sample_row
from broker.service import ServiceLoop
from broker.streams import (
    GROUP_GENERATORS,
    POLICY,
    PROMPTS,
    ROLLOUTS,
    Consumer,
    Delivery,
    JobStreams,
)
from generator_svc.colocate import Turns
from generator_svc.engine import Engine, TransferError
from generator_svc.engine import prepare as prepare_engine
from shared.entry import Drained, drain_requested
from shared.ids import sample_id
from shared.logs import set_context
from shared.metrics import GeneratorMetrics, serve_metrics
from shared.placement import takes_turns
from shared.schema import (
    EvalRound,
    PolicyAnnouncement,
    PromptGroup,
    Rollout,
    pack_f32,
    pack_i32,
    unpack_f32,
    unpack_i32,
)
from shared.settings import GeneratorSettings

log = logging.getLogger(__name__)


class WeightVerificationError(RuntimeError):
    """The engine's weights after a swap do not reproduce the trainer's probe."""


class PolicyFollower:
    """Tracks `{job}:policy` and keeps the engine on the newest announced version."""

    def __init__(self, streams: JobStreams, engine: Engine, ledger, generator_id: str,
                 verify_atol: float = 1e-3, load_retries: int = 2, metrics: GeneratorMetrics | None = None):
        self.streams, self.engine, self.ledger, self.generator_id = streams, engine, ledger, generator_id
        self.verify_atol, self.load_retries = verify_atol, load_retries
        self.metrics = metrics or GeneratorMetrics(job_id=streams.job_id)
        self.fingerprint: str | None = None
        self.loaded_run: str | None = None
        self.version = -1
        self.loaded_at: float | None = None
        self._last_beat = 0.0
        self.newest: PolicyAnnouncement | None = None
        latest = streams.latest(POLICY, PolicyAnnouncement)
        self.last_id = "0"
        if latest is not None:  # a late joiner starts from the newest version, not the first
            self.last_id, self.newest = latest

    def poll(self, block_ms: int | None = None) -> None:
        with self.metrics.phases.span("policy_poll"):
            self.last_id, msgs = self.streams.read_broadcast(POLICY, self.last_id, PolicyAnnouncement,
                                                             block_ms=block_ms)
        for m in msgs:
            # A restarted trainer (new run id) may count versions from wherever its checkpoint left
            # them, even lower than ours: its announcements win by arrival order, not by number.
            if (self.newest is None or m.manifest.version > self.newest.manifest.version
                    or m.trainer_run != self.newest.trainer_run):
                self.newest = m

    def stale(self) -> bool:
        """Whether the newest announcement is not what the engine holds."""
        n = self.newest
        return n is not None and (n.manifest.version > self.version or n.trainer_run != self.loaded_run)

    def sync(self, min_version: int, wait_s: float) -> None:
        """Load the newest announced version; block until one >= min_version is loaded.

        A transfer that fails (trainer restarting, version evicted, connection cut midway) leaves
        the old weights in the engine; it is retried, moving on to newer versions as they appear.
        """
        deadline = time.monotonic() + wait_s
        self.poll()
        while True:
            if self.stale():
                try:
                    self._load(self.newest)
                except TransferError as exc:
                    log.warning("%s; still serving v%d", exc, self.version)
                    if self.version >= min_version:
                        return  # the old weights are good enough for now: retry at the next sync
                    if time.monotonic() > deadline:
                        raise
                    self._wait_version(min_version)
                    continue
            if self.version >= min_version:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"policy version {min_version} was not loaded within {wait_s:.0f} s")
            self._wait_version(min_version)

    def _wait_version(self, min_version: int) -> None:
        """Half a second's wait for the next announcement, unless SIGTERM came (`Drained`)."""
        if drain_requested():
            raise Drained(f"SIGTERM while waiting for policy version {min_version}")
        self.poll(block_ms=500)

    def beat(self, every_s: float = 5.0, force: bool = False) -> None:
        """Heartbeat hash entry: which version this generator serves, since when, and that it lives."""
        if force or time.monotonic() - self._last_beat >= every_s:
            with self.metrics.phases.span("heartbeat"):
                self.streams.heartbeat(self.generator_id, {"version": self.version, "loaded_at": self.loaded_at,
                                                           "fingerprint": self.fingerprint})
            self._last_beat = time.monotonic()

    def _load(self, ann: PolicyAnnouncement) -> None:
        """Pull, swap and verify one version; retried, and never used unverified."""
        v, phases = ann.manifest.version, self.metrics.phases
        for attempt in range(self.load_retries + 1):
            res = self.engine.load_version(ann.transport, ann.address, ann.manifest)
            phases.observe("fetch", res["fetch_s"])  # pull + chunk checksums, in the engine's worker
            phases.observe("swap", res["total_s"] - res["fetch_s"])  # reload_weights + prefix cache reset
            with phases.span("verify"):
                gap = self._probe_gap(ann)
            if gap <= self.verify_atol:
                break
            log.error("policy v%d: probe logprobs differ by %.3g (> %.3g) after the swap (attempt %d)",
                      v, gap, self.verify_atol, attempt + 1)
        else:
            raise WeightVerificationError(
                f"policy v{v}: the weights in the engine do not reproduce the trainer's probe "
                f"(max |logprob gap| {gap:.3g} > {self.verify_atol:.3g}) after {self.load_retries + 1} loads"
            )
        self.version = v
        self.loaded_run = ann.trainer_run
        set_context(policy_version=v)
        with phases.span("fingerprint"):
            fingerprint = self.engine.fingerprint()
        with phases.span("load_ledger"):
            self.ledger.record_generator_load(self.streams.job_id, v, self.generator_id, fingerprint)
        self.loaded_at = time.time()
        self.fingerprint = fingerprint
        self.beat(force=True)
        self.metrics.loaded(v, res["total_s"])
        log.info(
            "loaded policy v%d (%.1f MB) fetch %.3fs load %.3fs total %.3fs; probe gap %.2g; engine fingerprint %s",
            v, res["bytes"] / 1e6, res["fetch_s"], res["load_s"], res["total_s"], gap, fingerprint,
        )

    def _probe_gap(self, ann: PolicyAnnouncement) -> float:
        if not ann.probe_ids:
            return 0.0  # an announcement without a probe (older trainer): checksums only
        ids = unpack_i32(ann.probe_ids).tolist()
        got = np.asarray(self.engine.score(ids), dtype=np.float64)
        want = unpack_f32(ann.probe_logprobs).astype(np.float64)
        if got.shape != want.shape or not np.all(np.isfinite(got)):
            return float("inf")
        return float(np.max(np.abs(got - want))) if got.size else 0.0


def rollouts_for(group: PromptGroup, samples, version: int, generator_id: str) -> list[Rollout]:
    return [
        Rollout(
            job_id=group.job_id,
            msg_id=sample_id(group.msg_id, i),
            group_id=group.group_id,
            policy_version=version,
            policy_version_max=version,  # one generate call never spans a swap
            purpose=group.purpose,
            prompt_index=group.prompt_index,
            sample_index=i,
            group_size=group.n,
            generator_id=generator_id,
            prompt_ids=pack_i32(s.prompt_ids),
            completion_ids=pack_i32(s.completion_ids),
            logprobs=pack_f32(s.logprobs),
            completion=s.text,
            finish_reason=s.finish_reason,
            answer=group.answer,
            prompt=group.prompt,
            metadata=group.metadata,
            eval_set=group.eval_set,
            temperature=group.sampling.temperature,
        )
        for i, s in enumerate(samples)
    ]


def entry_rollouts(units: list[tuple[Delivery, list[PromptGroup]]], results: list, version: int, generator_id: str,
                   streams: JobStreams) -> list[tuple[str, list[Rollout]]]:
    """Each entry's rollouts from the engine's samples (`results`, one list per group in `units`
    order). A group whose output is not a valid rollout (a NaN or positive logprob: a broken
    engine) is dead-lettered with the reason, as `reject_too_long` does, instead of failing the
    whole call: a training group's entry (acked), or the one problem of an evaluation round."""
    out = []
    samples = iter(results)
    for d, gs in units:
        made: list[Rollout] = []
        for g in gs:
            try:
                made += rollouts_for(g, next(samples), version, generator_id)
            except ValidationError as exc:
                why = f"group {g.group_id}: the engine's output is not a valid rollout: {exc.errors()[0].get('msg')}"
                _dead_group(streams, d, why, "invalid_output", message=g)
                if not isinstance(d.message, EvalRound):
                    made = []
                    break
        if made:
            out.append((d.entry_id, made))
        else:
            _all_dead(streams, d)
    return out


def _dead_group(streams: JobStreams, d: Delivery, why: str, code: str, raw: bytes = b"",
                message: PromptGroup | None = None) -> None:
    """Dead-letter one group of entry `d`: a training group's entry with it (acked), an evaluation
    problem alone (its round's entry stays for the others)."""
    group = None if isinstance(d.message, EvalRound) else GROUP_GENERATORS
    streams.dead_letter(PROMPTS, group, d.entry_id, why, raw, code=code, message=message)


def _all_dead(streams: JobStreams, d: Delivery) -> None:
    """Entry `d` has nothing left to generate: an evaluation round whose every problem was
    dead-lettered is acked (a training group's entry was acked with its dead letter)."""
    if isinstance(d.message, EvalRound):
        streams.ack(PROMPTS, GROUP_GENERATORS, [d.entry_id])


def too_long_reason(prompt_tokens: int, max_model_len: int) -> str | None:
    """Why the engine would refuse a prompt of `prompt_tokens` tokens, or None if it fits.

    vLLM refuses a prompt that leaves no room for one completion token (length >= max_model_len),
    and it refuses the whole generate call with it: one over-long prompt would cost the batch.
    A prompt that fits but leaves fewer than max_tokens is fine: its samples end early ("length").
    """
    if prompt_tokens < max_model_len:
        return None
    return (
        f"prompt of {prompt_tokens} tokens does not fit the engine's context of {max_model_len} tokens "
        f"(GEN_MAX_MODEL_LEN) with room for a completion; shorten the prompt or raise the context length"
    )


def reject_too_long(
    deliveries: list[Delivery], count_tokens: Callable[[Sequence[str]], list[int]], max_model_len: int,
    streams: JobStreams,
) -> list[tuple[Delivery, list[PromptGroup]]]:
    """Each delivery with the prompt groups to generate for it (an evaluation round is one entry
    of many groups). A prompt that does not fit is dead-lettered: a training group's entry with
    it (and acked), an evaluation problem alone (its round's entry stays for the others; the
    dead letter carries that problem as a prompt group, so the trainer settles just it)."""
    units = [(d, d.message.groups() if isinstance(d.message, EvalRound) else [d.message]) for d in deliveries]
    flat = [g for _, gs in units for g in gs]
    missing = [g.prompt for g in flat if not g.prompt_ids]  # a text prompt: the engine tokenizes it
    counted = iter(count_tokens(missing) if missing else [])
    lengths = {id(g): g.num_prompt_tokens if g.prompt_ids else next(counted) for g in flat}
    keep = []
    for d, gs in units:
        fits = []
        for g in gs:
            reason = too_long_reason(lengths[id(g)], max_model_len)
            if reason is None:
                fits.append(g)
            else:
                # The dead letter carries the group, so the trainer settles just it (and frees its
                # feeder slot): a training group, or one problem of an evaluation round.
                _dead_group(streams, d, f"group {g.group_id}: {reason}", "prompt_too_long", message=g)
        if fits:
            keep.append((d, fits))
        else:
            _all_dead(streams, d)
    return keep


def prompt_token_counter(model_path: str) -> Callable[[Sequence[str]], list[int]]:
    """Prompt lengths in tokens as the engine counts them (the model's own tokenizer, special
    tokens included, as vLLM adds them to a text prompt)."""
    from transformers import AutoTokenizer  # heavy; vLLM depends on it anyway

    tok = AutoTokenizer.from_pretrained(model_path)
    return lambda prompts: [len(ids) for ids in tok(list(prompts), add_special_tokens=True)["input_ids"]]


# What the prompts stream carries: training groups and whole evaluation rounds.
KINDS = (PromptGroup, EvalRound)


def samples_of(msg) -> int:
    """Samples a prompts-stream entry asks for."""
    return msg.n * len(msg.items) if isinstance(msg, EvalRound) else msg.n


def run(settings: GeneratorSettings) -> None:
    # vLLM's import needs no job: done first, it overlaps the API's start and the job's submission
    log.info("engine: vllm imported in %.2fs", prepare_engine(kv_cache_gib=settings.kv_cache_gib,
                                                               in_process=settings.engine_in_process))
    ctx = open_job(settings)
    metrics = GeneratorMetrics(serve_metrics(settings.metrics_port, "generator"), ctx.job_id)
    set_context(generator_id=settings.generator_id)
    consumer = Consumer(PROMPTS, GROUP_GENERATORS, settings.generator_id, KINDS)
    ctx.streams.ensure_group(consumer.stream, consumer.group)  # before the engine's slow start
    turns = takes_turns(ctx.spec.placement, Engine.device_type())
    engine = Engine(
        ctx.spec.model_path,
        seed=ctx.spec.seed,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        kv_cache_gib=settings.kv_cache_gib,
        enforce_eager=settings.enforce_eager,
        in_process=settings.engine_in_process,
        enable_sleep_mode=turns,
    )
    try:
        policy = PolicyFollower(ctx.streams, engine, ctx.ledger, settings.generator_id, settings.verify_atol,
                                settings.load_retries, metrics)
        handler = Generation(settings, ctx, consumer, engine, policy, metrics, Turns(engine, turns))
        # a user's stop is the trainer's to finish: only its drain (or a cancel) ends this service
        loop = ServiceLoop(ctx.streams, consumer, handler, block_ms=settings.block_ms, exit_on=("drain",),
                           on_dead_letter=metrics.dead_letter, phases=metrics.phases)
        log.info("generator %s ready", consumer.name)
        state = loop.run()
        log.info("generator %s stopping (%s)", consumer.name, state)
    finally:
        engine.close()


class Generation:
    """The generator's handler (broker.service.Handler): one generate call per batch of prompt
    entries, at one policy version no older than any of its groups was fed at."""

    def __init__(self, settings: GeneratorSettings, ctx: JobContext, consumer: Consumer, engine: Engine,
                 policy: PolicyFollower, metrics: GeneratorMetrics, turns: Turns | None = None):
        self.settings, self.streams, self.ledger, self.consumer = settings, ctx.streams, ctx.ledger, consumer
        self.engine, self.policy, self.metrics = engine, policy, metrics
        self.turns = turns or Turns(engine, False)  # co-located on a GPU: sleep between batches
        self.group_size = ctx.spec.group_size
        self.default_batch = ctx.spec.generation_batch or settings.batch_groups
        self.count_tokens = prompt_token_counter(ctx.spec.model_path)
        self.count = self.default_batch

    def tick(self) -> None:
        self.policy.beat()

    def batch_size(self, control: ControlWatcher) -> int:
        self.count = int(control.settings.get("generation_batch", self.default_batch))  # a live knob
        return self.count

    def more(self, deliveries: list[Delivery]) -> int:
        """The batch is `count` groups' worth of samples: take more of what is already waiting
        rather than generate a few sequences at a time (an evaluation round, one entry, counts
        all of its samples and is never split across calls)."""
        want = self.count * self.group_size
        have = sum(samples_of(d.message) for d in deliveries)
        return max(1, (want - have) // self.group_size) if have < want else 0

    def idle(self) -> None:
        self.policy.poll()
        if self.policy.stale() and not self.turns.asleep:
            self.policy.sync(0, self.settings.job_wait_s)  # idle: pick up new weights early

    def handle(self, deliveries: list[Delivery]) -> None:
        units = reject_too_long(deliveries, self.count_tokens, self.settings.max_model_len, self.streams)
        if not units:
            return
        groups = [g for _, gs in units for g in gs]
        self.turns.wake()  # before the swap: it writes into the engine's device memory
        # A group fed at version v must not be generated by an older policy (sync mode relies on it).
        self.policy.sync(max(g.policy_version for g in groups), self.settings.job_wait_s)
        phases = self.metrics.phases
        t0 = time.perf_counter()
        with phases.span("generate"):
            results = self.engine.generate([g.prompt_array().tolist() if g.prompt_ids else g.prompt for g in groups],
                                           [g.sampling for g in groups], [g.n for g in groups])
        dt = time.perf_counter() - t0
        self.turns.rest()  # asleep before the rollouts exist: the trainer may then take the device
        per_entry = entry_rollouts(units, results, self.policy.version, self.consumer.name, self.streams)
        with phases.span("publish"):
            published = self.streams.publish_if_owned(self.consumer, ROLLOUTS, per_entry)
        rollouts = [r for (_, rs), ok in zip(per_entry, published, strict=True) if ok for r in rs]
        if not all(published):  # reclaimed by another replica meanwhile: its copy is the one
            log.warning("%d of %d entries were taken over by another generator; not published",
                        published.count(False), len(units))
        self._record(rollouts, len(groups), dt)

    def _record(self, rollouts: list[Rollout], groups: int, dt: float) -> None:
        """Ledger rows and metrics of the published rollouts. A row the ledger refuses is only
        logged here (its rollout is published and its prompt acked); the reward service writes
        the same row, meets the same refusal and dead-letters it."""
        with self.metrics.phases.span("ledger"):
            _, refused = write_isolating(self.ledger.record_generated, [sample_row(r) for r in rollouts])
        for i, why in refused.items():
            log.error("ledger refused sample %s: %s", rollouts[i].msg_id, why)
        ntok = sum(r.num_completion_tokens for r in rollouts)
        self.metrics.generated(len(rollouts), ntok, dt)
        log.info("v%d: %d groups, %d samples, %d tokens in %.2fs (%.0f tok/s)",
                 self.policy.version, groups, len(rollouts), ntok, dt, ntok / max(dt, 1e-9))
