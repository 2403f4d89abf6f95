"""Trainer service: scored groups -> advantages -> policy loss -> optimizer step -> publish weights.

Setup helpers first, then `run`: one loop that reads top to bottom (feed, consume, staleness
filter, advantages, loss, step, publish weights, ledger + metrics). Async and sync modes are the
same loop; sync is max staleness 0 with an in-flight cap of one batch, so the generator can only
start the next batch after the new weights are published.

Under `torchrun` rank 0 runs this loop and the other ranks run `follow` (trainer_svc/dist.py:
what is sharded, who does what); at world size 1 the loop is all there is.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from broker.ledger import write_isolating
from broker.runtime import ControlWatcher, open_job
from broker.streams import (
    CONTROL,
    GROUP_GENERATORS,
    GROUP_REWARDERS,
    GROUP_TRAINERS,
    POLICY,
    PROMPTS,
    ROLLOUTS,
    SCORED,
    JobStreams,
)
from shared.datasets import load_source, load_task
from shared.entry import Terminated, accept_drain
from shared.jobspec import JobSpec
from shared.logs import set_context
from shared.metrics import TrainerMetrics, serve_metrics
from shared.prompts import renderer
from shared.schema import (
    Control,
    PolicyAnnouncement,
    Scored,
    decode,
    encode,
    pack_f32,
    pack_i32,
    unpack_f32,
    unpack_i32,
)
from shared.settings import TrainerSettings
from shared.transport import WeightServer, build_manifest, make_server
from trainer_svc import checkpoint
from trainer_svc.algorithms import (
    ADVANTAGE_ESTIMATORS,
    BatchNorm,
    LossConfig,
    LossInputs,
    accumulate,
    finalize_metrics,
    is_fresh,
    lookup,
    policy_loss,
    staleness,
)
from trainer_svc.dist import Ranks, full_value
from trainer_svc.evaluation import Evaluator, build_sets
from trainer_svc.feeder import DeadLetterWatch, DeadMember, Feeder, Group, GroupAssembler, group_seq
from trainer_svc.guard import check as guard_check
from trainer_svc.guard import non_finite, recovery, rolled_back, trusted_reward, trusted_step
from trainer_svc.logprobs import pad_batch, token_logprobs, token_logprobs_and_entropy
from trainer_svc.shaping import no_signal, overlong_penalty
from trainer_svc.staleness import AdaptiveStaleness, staleness_lr_scale

log = logging.getLogger(__name__)


# --- setup helpers ------------------------------------------------------------------------------


def load_policy(spec: JobSpec, device: str, path: str | Path | None = None):
    """The policy and tokenizer from `path` (a checkpoint), else the job's model."""
    path = path or spec.model_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.train()
    return model, tokenizer


def flatten_weights(
    model: torch.nn.Module | Mapping[str, torch.Tensor], keep_device: bool = False
) -> tuple[list[tuple[str, list[int], str, int]], Any]:
    """Every tensor of the HF state dict (of `model`, or `model` is one), back to back in one
    uint8 buffer (checkpoint names).

    Returns a host numpy array, or with `keep_device` a uint8 tensor on the model's device (so a
    GPU trainer can serve device memory over UCX: cuda_ipc/NVLink or RDMA, no host bounce)."""
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    entries, parts = [], []
    for name, t in state.items():
        t = t.detach().contiguous()
        entries.append((name, list(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size()))
        parts.append(t.reshape(-1).view(torch.uint8))
    flat = torch.cat(parts)
    return entries, (flat if keep_device else flat.cpu().numpy())


def probe(model: torch.nn.Module, length: int = 24) -> tuple[list[int], list[float]]:
    """A fixed pseudo-random token sequence and its logprobs under `model` (the functional
    fingerprint generators check after a swap). The same sequence for every version of a job."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(20250530)
    ids = torch.randint(min(4, vocab - 1), vocab, (1, length), generator=g)
    bos = model.config.bos_token_id
    if bos is not None:
        ids[0, 0] = bos
    was_training = model.training
    model.eval()  # no dropout in the fingerprint
    with torch.no_grad():
        lp = token_logprobs(model, ids.to(model.device), torch.ones_like(ids).to(model.device))
    model.train(was_training)
    return ids[0].tolist(), lp[0].float().cpu().tolist()


def publish_weights(
    model: torch.nn.Module, version: int, server: WeightServer, streams: JobStreams, ledger, job_id: str, keep: int,
    run_id: str = "", snapshot: tuple[Mapping[str, torch.Tensor], tuple[list[int], list[float]]] | None = None,
) -> tuple[float, str]:
    """Serve and announce version `version`; returns (seconds, the version's checksum).

    `snapshot`: (full weights, probe) from `Learner.snapshot` when `model` is sharded; None takes
    both from `model`."""
    t0 = time.perf_counter()
    state, (probe_ids, probe_lp) = snapshot if snapshot is not None else (model.state_dict(), probe(model))
    on_gpu = next(iter(state.values())).is_cuda and server.name == "ucx"
    entries, buf = flatten_weights(state, keep_device=on_gpu)
    manifest = build_manifest(version, entries, buf.cpu().numpy() if on_gpu else buf)  # checksums on host bytes
    server.serve(manifest, buf)
    ledger.record_policy_version(job_id, version, manifest.checksum, manifest.total_bytes)
    streams.publish(
        POLICY,
        PolicyAnnouncement(
            job_id=job_id, msg_id=f"{job_id}/v{version}", policy_version=version,
            manifest=manifest, transport=server.name, address=server.address, trainer_run=run_id,
            probe_ids=pack_i32(probe_ids), probe_logprobs=pack_f32(probe_lp),
        ),
    )
    # A version older than the ones the server still holds cannot be fetched: drop its announcement.
    streams.trim_broadcast(POLICY, keep)
    return time.perf_counter() - t0, manifest.checksum


def save_checkpoint(
    learner: Learner, root: str, job_id: str, step: int, version: int, ledger, state: dict[str, Any]
) -> Path:
    """The policy as an HF-format directory (model + tokenizer) plus `trainer_state/` (optimizer,
    RNG, `state`: step, cursors, ...), written atomically (trainer_svc/checkpoint.py); only then
    recorded in the ledger."""
    final = checkpoint.step_dir(root, job_id, step)
    weights, optimizer = learner.full_state()
    stats = checkpoint.save(final, learner.model, learner.tokenizer, optimizer,
                            {"job_id": job_id, "step": step, "policy_version": version, **state}, model_state=weights)
    ledger.record_checkpoint(job_id, step, version, str(final.resolve()))
    log.info("checkpoint %s: %.1f MB in %.2fs", final, stats["bytes"] / 1e6, stats["seconds"])
    return final


def flatten_batch(groups: list[Group]) -> tuple[list[Scored], torch.Tensor]:
    """Samples in group order and their rewards as (G, n)."""
    samples = [s for g in groups for s in sorted(g.samples.values(), key=lambda s: s.rollout.sample_index)]
    n = groups[0].size
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32).view(len(groups), n)
    return samples, rewards


def truncated(s: Scored) -> bool:
    """Cut at max_tokens rather than ended by EOS or a stop rule."""
    return s.rollout.finish_reason == "length"


def shape_overlong(samples: list[Scored], rewards: torch.Tensor, spec: JobSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The job's over-long treatment (algorithm.overlong): rewards (G, n) with DAPO's soft length
    penalty added to truncated samples ("penalty"), and a (B,) weight that masks truncated samples
    out of the loss ("mask": advantage 0, so no gradient from them)."""
    a = spec.algorithm
    cut = torch.tensor([truncated(s) for s in samples], dtype=torch.bool)
    keep = torch.ones(len(samples))
    if a.overlong == "mask":
        keep = (~cut).to(torch.float32)
    elif a.overlong == "penalty":
        lengths = torch.tensor([len(s.rollout.completion_ids) // 4 for s in samples])
        rewards = rewards + (overlong_penalty(lengths, spec.sampling.max_tokens, a.overlong_buffer,
                                              a.overlong_penalty) * cut).view_as(rewards)
    return rewards, keep


def overlong_reason(s: Scored, spec: JobSpec) -> str | None:
    """What the over-long treatment did to a trained sample, for its ledger row."""
    if not truncated(s) or spec.algorithm.overlong == "keep":
        return None
    what = "masked from the loss" if spec.algorithm.overlong == "mask" else "length penalty added to its reward"
    return f"over-long (cut at max_tokens {spec.sampling.max_tokens}): {what}"


def component_means(samples: list[Scored]) -> dict[str, float]:
    """`reward/<term>` per step: each term of a weighted-sum reward on its own."""
    sums: dict[str, list[float]] = {}
    for s in samples:
        for name, v in s.details.items():
            sums.setdefault(name, []).append(v)
    return {f"reward/{name}": float(np.mean(v)) for name, v in sums.items()}


def out_of_vocab(s: Scored, vocab: int) -> str | None:
    """Why this model cannot embed a scored sample (a token id >= its vocabulary: the embedding
    lookup would fail the whole step), or None. The wire checks ids >= 0; only here is the
    vocabulary known."""
    for name, ids in (("prompt_ids", s.rollout.prompt_array()), ("completion_ids", s.rollout.completion_array())):
        if ids.size and int(ids.max()) >= vocab:
            i = int(np.argmax(ids >= vocab))
            return f"rollout.{name}[{i}] is {int(ids[i])}, outside the model's vocabulary of {vocab} tokens"
    return None


def micro_batch_inputs(samples: list[Scored], adv: torch.Tensor, pad_id: int, device: str):
    """(input_ids, attention_mask, behaviour logprobs, advantages, mask) for one micro-batch."""
    prompts = [unpack_i32(s.rollout.prompt_ids).tolist() for s in samples]
    comps = [unpack_i32(s.rollout.completion_ids).tolist() for s in samples]
    input_ids, attn, cmask = pad_batch(prompts, comps, pad_id)
    behaviour = torch.zeros_like(cmask)  # (b, L-1)
    for i, s in enumerate(samples):
        behaviour[i, cmask[i].bool()] = torch.from_numpy(unpack_f32(s.rollout.logprobs).copy())
    return input_ids.to(device), attn.to(device), behaviour.to(device), adv.to(device), cmask.to(device)


class Learner:
    """The policy, its optimizer and the algorithm: one optimizer step on one global batch.

    advantages -> loss over micro-batches (normalised by global-batch counts, so the gradient does
    not depend on the micro-batch size, nor on how the batch is split across ranks) -> clip ->
    step. Used by the loop below and by the bench.

    With `ranks` of world size > 1 the model is sharded (FSDP2) and every method that touches it
    is collective: rank 0 announces the call with its arguments (trainer_svc/dist.py), and `follow`
    makes the same call on the other ranks.
    """

    def __init__(self, spec: JobSpec, device: str, model_path: str | Path | None = None, ranks: Ranks | None = None):
        self.ranks = ranks or Ranks(device=device)
        self.ranks.announce("init", spec=spec.model_dump(mode="json"))
        self.spec = spec
        self.device = device = self.ranks.device
        # Every rank builds the job's model; only rank 0 reads `model_path` (a checkpoint the other
        # ranks may not see), and `wrap` hands its weights to them.
        model, self.tokenizer = load_policy(spec, device, model_path if self.ranks.is_main else None)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)  # token ids it can embed
        self.model = self.ranks.wrap(model)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        a = spec.algorithm
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
        self.advantage_fn = lookup(ADVANTAGE_ESTIMATORS, a.advantage, "advantage estimator")
        self.cfg = LossConfig.from_spec(a)
        self.lr = a.lr  # a live knob: PATCH /jobs/{id} may change it between steps
        self.ref_model = None
        if a.kl_coef > 0:  # frozen copy of the initial policy for the KL penalty
            self.ref_model, _ = load_policy(spec, device)
            self.ref_model.eval().requires_grad_(False)

    def step(
        self, samples: list[Scored], rewards: torch.Tensor, lr_scale: float = 1.0, lr: float | None = None
    ) -> dict[str, float]:
        """samples in group order; rewards (G, n). The step size is `lr` if given (a re-done step's
        recorded lr), else the base lr times `lr_scale`. Returns the step's metrics."""
        spec = self.spec
        rewards, keep = shape_overlong(samples, rewards, spec)
        advantages = self.advantage_fn(rewards).reshape(-1) * keep  # (B,)
        norm = BatchNorm.from_lengths([len(s.rollout.completion_ids) // 4 for s in samples],
                                      max_len=spec.sampling.max_tokens)
        self.ranks.announce("step", samples=[encode(s) for s in samples], rewards=rewards.tolist(),
                            lr_scale=lr_scale, lr=lr)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        # This rank's share of the global batch, in micro-batches; None pads the count to that of
        # the busiest rank (every FSDP forward is a collective) and contributes no gradient.
        for part in self.ranks.micro_batches(len(samples), spec.algorithm.micro_batch_size):
            lo, hi = part or (0, 1)
            ids, attn, behaviour, adv, mask = micro_batch_inputs(
                samples[lo:hi], advantages[lo:hi], self.pad_id, self.device
            )
            # each sample's own sampling temperature: the behaviour policy it was drawn from
            temp = torch.tensor([s.rollout.temperature for s in samples[lo:hi]])
            logprobs, entropy = token_logprobs_and_entropy(self.model, ids, attn, temp)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref = token_logprobs(self.ref_model, ids, attn, temp)
            out = policy_loss(LossInputs(logprobs, behaviour, adv, mask, ref_logprobs=ref, entropy=entropy),
                              self.cfg, norm)
            if part is None:
                (out.loss * 0.0).backward()
                sums = accumulate(sums, {k: -math.inf if k.endswith("max") else 0.0 for k in out.metrics})
                continue
            # This rank's share of the global sum; x N undoes the average of FSDP's gradient reduction.
            (out.loss * self.ranks.world_size).backward()
            sums = accumulate(sums, out.metrics)
        sums = self.ranks.reduce_metrics(sums)  # every rank's micro-batches: the global batch
        grad_norm = float(full_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                    spec.algorithm.max_grad_norm)))
        lr = self.lr * lr_scale if lr is None else lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return {
            **finalize_metrics(sums, norm),
            **component_means(samples),
            "overlong/truncated": float(sum(truncated(s) for s in samples)),
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": float(norm.num_tokens),
            "samples": float(len(samples)),
        }

    def snapshot(self) -> tuple[dict[str, torch.Tensor], tuple[list[int], list[float]]]:
        """The full weights (on rank 0; {} on the others) and the probe fingerprint, for
        `publish_weights`."""
        self.ranks.announce("snapshot")
        return self.ranks.model_state(self.model), probe(self.model)

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(full weights, full optimizer state in `optimizer.state_dict()` layout) on rank 0, for a
        checkpoint; ({}, {}) on the others."""
        self.ranks.announce("full_state")
        return self.ranks.model_state(self.model), self.ranks.optimizer_state(self.model, self.optimizer)

    def restore(self, path: str | Path | None, weights: bool = True) -> None:
        """Checkpoint `path` (None: the job's initial model and an empty optimizer state) into the
        live model (unless not `weights`) and optimizer, in place; rank 0 reads the files. RNG and
        cursors stay as they are (the collapse guard's undo; a resume restores those itself)."""
        self.ranks.announce("restore", path=None if path is None else str(path), weights=weights)
        main = self.ranks.is_main
        if weights:
            self.ranks.load_model_state(self.model, checkpoint.read_weights(path or self.spec.model_path) if main else {})
        optimizer = None if path is None else checkpoint.read_optimizer(Path(path)) if main else {}
        self.ranks.load_optimizer_state(self.model, self.optimizer, optimizer)


# Ranks 1..N-1: what to do on each announcement of rank 0 (the Learner calls above).
FOLLOW = {
    "step": lambda learner, m: learner.step([decode(b, Scored) for b in m["samples"]], torch.tensor(m["rewards"]),
                                            m["lr_scale"], m["lr"]),
    "snapshot": lambda learner, m: learner.snapshot(),
    "full_state": lambda learner, m: learner.full_state(),
    "restore": lambda learner, m: learner.restore(m["path"], m["weights"]),
    "tick": lambda learner, m: None,  # rank 0 is waiting (for data, or paused)
}


def follow(settings: TrainerSettings, ranks: Ranks) -> None:
    """A rank other than 0: no Redis, no ledger, no weight server; rank 0's collective Learner
    calls, in the order it announces them, until it announces `exit`."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    # torchrun passes a SIGTERM to every rank: rank 0 drains (finishes its step, checkpoints, then
    # announces exit), and that needs this rank in the collectives until then.
    accept_drain()
    first = ranks.receive()
    if first["op"] != "init":
        raise RuntimeError(f"rank {ranks.rank}: expected the init announcement, got {first['op']!r}")
    spec = JobSpec.model_validate(first["spec"])
    torch.manual_seed(spec.seed)
    learner = Learner(spec, settings.device, ranks=ranks)
    while (m := ranks.receive())["op"] != "exit":
        lookup(FOLLOW, m["op"], "announcement")(learner, m)


# --- the loop -----------------------------------------------------------------------------------


def run(settings: TrainerSettings) -> None:
    ranks = Ranks.from_env(settings.device)  # torchrun: join the process group; else world size 1
    if not ranks.is_main:
        follow(settings, ranks)
        ranks.close()
        return
    ctx = open_job(settings)
    job_id, spec, ledger, streams = ctx.job_id, ctx.spec, ctx.ledger, ctx.streams
    try:
        _train(settings, job_id, spec, ledger, streams, ranks)
    except BaseException as exc:
        # No `exit` for the other ranks: one may be inside a collective; torchrun stops them.
        if isinstance(exc, Terminated):
            raise  # SIGTERM: this process restarts, the job goes on (shared/entry.py)
        state = "stopped" if isinstance(exc, KeyboardInterrupt) else "failed"
        ledger.set_job_state(job_id, state, error=None if state == "stopped" else repr(exc)[:2000])
        raise
    ranks.announce("exit")
    ranks.close()


def _train(settings: TrainerSettings, job_id: str, spec: JobSpec, ledger, streams: JobStreams, ranks: Ranks) -> None:
    t_boot = time.perf_counter()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    torch.manual_seed(spec.seed)
    prom = TrainerMetrics(serve_metrics(settings.metrics_port, "trainer"), job_id)
    # resume: the newest committed checkpoint, the feed journal and the ledger (trainer_svc/checkpoint.py)
    resume = checkpoint.plan_resume(settings.checkpoint_dir, job_id, ledger)
    learner = Learner(spec, settings.device, resume.checkpoint if resume else None, ranks)
    model = learner.model
    k = spec.staleness_bound
    adaptive = None
    if spec.adaptive_staleness is not None and spec.mode == "async":
        a = spec.adaptive_staleness
        adaptive = AdaptiveStaleness(a.k_min, a.k_max, a.metric, a.threshold, a.patience)
    if not spec.checkpoint_every:
        log.warning("checkpoint_every is 0: a restarted trainer re-does every step from the initial model, "
                    "and Redis holds every trained sample until the job ends")
    train_set, test_set = load_task(spec.task, spec.seed)
    eval_problems = {es.name: (test_set if es.dataset is None else load_source(es.dataset, spec.task, spec.seed))
                     [: es.max_problems] for es in spec.evaluation_sets()}
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
    feeder = Feeder(streams, spec, train_set, render, run_id,
                    journal=checkpoint.FeedJournal(settings.checkpoint_dir, job_id).write)
    evaluator = Evaluator(spec, build_sets(spec, eval_problems, render), feeder, streams, ledger, job_id)
    scored_in = checkpoint.singleton_consumer(streams)
    assembler = GroupAssembler()
    dead_letters = DeadLetterWatch(streams, job_id)  # groups that can no longer complete
    control = ControlWatcher(streams)
    server = make_server(
        settings.transport, host=settings.bind_host, port=settings.bind_port,
        keep=settings.keep_versions, advertise_host=settings.advertise_host,
    )
    ready: list[Group] = []  # complete groups waiting for a batch slot
    held: list[str] = []  # scored entries of trained steps, acked once a checkpoint covers them
    replay: dict[int, list[str]] = {}  # steps a predecessor trained after the checkpoint: their groups
    # collapse guard (trainer_svc/guard.py): trips so far; the current trajectory's [step, reward]
    # series and checkpoints; the [lo, hi] policy versions roll-backs discarded
    guard, trips = spec.guard, 0
    rewards_seen: list[list[float]] = []
    kept: list[int] = []
    discarded: list[list[int]] = []
    step = version = 0
    if resume is not None:
        step, version, replay = resume.step, resume.version, dict(resume.replay)
        if resume.feeder is not None:
            feeder.restore(resume.feeder)
        feeder.in_flight |= {g for ids in replay.values() for g in ids}
        evaluator.restore(feeder.open_evals, resume.eval_steps)

    def apply_knobs(knobs: dict[str, float]) -> None:
        nonlocal k
        if "lr" in knobs:
            learner.lr = float(knobs["lr"])
        if "max_staleness" in knobs and spec.mode == "async":
            k = int(knobs["max_staleness"])
            if adaptive is not None:
                adaptive.k = min(max(k, adaptive.k_min), adaptive.k_max)
                k = adaptive.k
        feeder.temperature = float(knobs.get("temperature", feeder.temperature))
        feeder.top_p = float(knobs.get("top_p", feeder.top_p))
        log.info("live knobs applied: %s", knobs)

    def trainer_state() -> dict[str, Any]:
        """The loop's state at a step boundary, for the checkpoint (JSON)."""
        return {"run_id": run_id, "k": k, "lr": learner.lr, "knobs": dict(control.settings),
                "adaptive": None if adaptive is None else {"k": adaptive.k, "calm": adaptive.calm},
                "feeder": feeder.state(), "guard": {"rewards": rewards_seen, "trips": trips, "checkpoints": kept,
                          "discarded": discarded}}

    def record_used(items: list[dict]) -> int:
        """ledger.record_used; an item the database refuses (see broker.ledger.write_isolating)
        is logged and the rest recorded, so one bad row does not fail a step that trained."""
        done, refused = write_isolating(ledger.record_used, items)
        for i, why in refused.items():
            log.error("ledger refused the use of sample %s: %s", items[i]["msg_id"], why)
        return sum(done)

    def settle_unknown(g: Group, why: str) -> None:
        """A complete group this run did not feed (or a round it did not start): dropped with the
        reason, or, when it is a late copy of a sample already used, only acked."""
        record_used([{"msg_id": m, "status": "dropped", "trainer_version": version, "drop_reason": why}
                            for m in g.samples])  # record_used leaves used samples as they are
        streams.ack(SCORED, GROUP_TRAINERS, g.entries)
        log.warning("group %s: %s", g.group_id, why)

    def settle_dead(g: Group) -> None:
        """A group with a dead-lettered member (or a dead prompt group) can never be used whole:
        its samples are dropped with the reason, and its feeder or eval slot is freed."""
        why = ("dead-lettered: " + "; ".join(sorted(set(g.dead.values()))))[:1000]
        record_used([{"msg_id": m, "status": "dropped", "trainer_version": version, "drop_reason": why}
                            for m in g.msg_ids])  # rows not written (nothing generated) change nothing
        streams.ack(SCORED, GROUP_TRAINERS, g.entries)
        if g.purpose == "eval":
            evaluator.dead(g)
        feeder.done(g.group_id)
        log.warning("group %s: %s", g.group_id, why)

    def route(deliveries: list) -> int:
        """Scored samples -> complete groups -> `ready`, their eval round, or settled as unknown."""
        for d in deliveries:
            why = out_of_vocab(d.message, learner.vocab_size)  # type: ignore[arg-type]
            if why is not None:  # dead-lettered, and its group settled now (as the dead letter would)
                streams.dead_letter(SCORED, GROUP_TRAINERS, d.entry_id, why, code="token_out_of_vocab",
                                    message=d.message)
                r = d.message.rollout  # type: ignore[attr-defined]
                g = assembler.mark_dead(DeadMember(r.group_id, r.group_size, r.sample_index, r.purpose,
                                                   f"token_out_of_vocab: {why}"))
                if g is not None:
                    settle_dead(g)
                continue
            g = assembler.add(d.entry_id, d.message)  # type: ignore[arg-type]
            if g is None:
                continue
            if g.dead:
                settle_dead(g)
            elif g.purpose == "eval":
                if not evaluator.add(g):
                    settle_unknown(g, "eval round not started by a trainer run this one resumed from")
            elif g.group_id not in feeder.in_flight:
                settle_unknown(g, "not in flight for this trainer run (fed by a predecessor after its last journal write)")
            else:
                ready.append(g)
        evaluator.record_complete(version)
        return len(deliveries)

    def roll_back(kind: str, reason: str, rewards: list[float]) -> bool:
        """Collapse guard trip: back to the newest checkpoint of this trajectory the guard still
        trusts (trainer_svc/guard.py trusted_step), or with none what guard.on_no_checkpoint says
        (guard.py recovery); a lower lr (and a tighter staleness bound if the importance weights
        blew up), recorded in the ledger. Returns whether the step is to be redone (False: the
        current policy was kept, this step's update stands)."""
        nonlocal k, trips, rewards_seen, kept, discarded
        trips += 1
        if trips > guard.max_trips:
            raise RuntimeError(f"collapse guard tripped {trips} times (last at step {step + 1}: {reason}); giving up")
        bound = trusted_step(kind, rewards, [int(s) for s, _ in rewards_seen] + [step + 1], guard)
        plan = recovery(kind, kept, bound, guard)
        change: dict[str, Any] = {"reason": reason, "kind": kind, "step": step + 1, "action": plan.action,
                                  "note": plan.note}
        if plan.action == "fail":
            ledger.record_change(job_id, "trainer collapse guard", change)
            raise RuntimeError(f"collapse guard: {reason} at step {step + 1}; {plan.note}")
        back_to = step if plan.step is None else plan.step  # kept: the trajectory goes on from here
        if plan.step is not None:
            learner.restore(checkpoint.step_dir(settings.checkpoint_dir, job_id, back_to) if back_to else None)
        # the trajectory goes on from back_to: later checkpoints, rewards and versions are not its own
        kept = [c for c in kept if c <= back_to]
        rewards_seen = [x for x in rewards_seen if x[0] <= back_to]
        if plan.step is None and kind == "reward_collapse":  # the kept policy's reward is measured afresh
            rewards_seen = []
        if step > back_to:  # one version per step: back_to's weights are version - (step - back_to)
            discarded = [*discarded, [version - (step - back_to) + 1, version]]
        learner.lr *= guard.lr_factor
        if kind == "is_blowup" and spec.mode == "async":
            k = max(adaptive.k_min if adaptive is not None else 0, k - 1)
            if adaptive is not None:
                adaptive.k = k
        change |= {"rolled_back_to_step": plan.step, "discarded_steps": list(range(back_to + 1, step + 1)),
                   "lr": learner.lr, "max_staleness": k}
        ledger.record_change(job_id, "trainer collapse guard", change)
        log.error("collapse guard: %s at step %d; %s; lr %.3g, staleness bound %d",
                  reason, step + 1, plan.note, learner.lr, k)
        return plan.step is not None

    def checkpoint_now() -> None:
        """The policy at this step boundary, with the loop's state; one of this trajectory's."""
        kept[:] = [*(c for c in kept if c != step), step]
        save_checkpoint(learner, settings.checkpoint_dir, job_id, step, version, ledger, trainer_state())

    def take_scored(block_ms: int) -> int:
        ranks.keepalive()  # the other ranks wait in a collective meanwhile: keep it from timing out
        n = route(scored_in.consume(SCORED, GROUP_TRAINERS, settings.consumer_id, Scored, count=512,
                                    block_ms=block_ms))
        freed = [g for g in map(assembler.mark_dead, dead_letters.poll()) if g is not None]
        for g in freed:
            settle_dead(g)
        if freed:
            evaluator.record_complete(version)  # eval rounds the dead groups completed
            if step < spec.steps and not control.done:
                feeder.top_up(version, k)  # refill the freed slots
        return n

    def wait_paused() -> None:
        ranks.keepalive()
        control.poll(block_ms=settings.block_ms)

    # take over what a predecessor left pending (checkpoint.take_over), then restore the RNG last
    taken = checkpoint.take_over(streams, SCORED, GROUP_TRAINERS, settings.consumer_id, Scored)
    route(taken)
    if replay:
        have = {g.group_id for g in ready}
        missing = sorted({g for ids in replay.values() for g in ids} - have, key=group_seq)
        if missing:
            raise RuntimeError(
                f"cannot resume exactly: steps {sorted(replay)} trained {len(missing)} groups after the last "
                f"checkpoint whose samples are no longer pending in Redis (first: {missing[0]}); Redis lost them "
                "or they were dead-lettered after too many deliveries")
    if resume is not None and resume.checkpoint is not None:
        learner.restore(resume.checkpoint, weights=False)  # the weights came with the model
        st = checkpoint.load_state(resume.checkpoint)
        k, learner.lr = int(st["k"]), float(st["lr"])
        rewards_seen, trips = [list(x) for x in st["guard"]["rewards"]], int(st["guard"]["trips"])
        kept = [int(c) for c in st["guard"]["checkpoints"]]
        discarded = [[int(lo), int(hi)] for lo, hi in st["guard"]["discarded"]]
        if adaptive is not None and st["adaptive"] is not None:
            adaptive.k, adaptive.calm = int(st["adaptive"]["k"]), int(st["adaptive"]["calm"])
        control.poll()  # the control stream replays from its start: apply only knobs set since the checkpoint
        since = {key: v for key, v in control.settings.items() if st["knobs"].get(key) != v}
        control.changed = False
        if since:
            apply_knobs(since)
    set_context(policy_version=version)
    ledger.mark_job_started(job_id)
    ledger.set_job_state(job_id, "running")
    publish_weights(model, version, server, streams, ledger, job_id, settings.keep_versions, run_id, learner.snapshot())
    if resume is not None:
        log.info("resumed from %s at step %d (version %d) in %.1fs: re-doing steps %s; %d groups in flight, "
                 "%d pending entries taken over", resume.checkpoint or "the initial model", step, version,
                 time.perf_counter() - t_boot, sorted(replay), len(feeder.in_flight), len(taken))

    if step == 0:
        evaluator.start_due(0, version)
    while step < spec.steps:
        t_start = time.perf_counter()
        control.poll()
        if control.done:
            log.info("%s requested at step %d", control.state, step)
            break
        if control.state == "paused":
            wait_paused()
            continue
        if control.changed:  # live knobs (PATCH /jobs/{id}), applied from this step on
            control.changed = False
            apply_knobs(control.settings)

        # feed: keep (k + 1) * batch groups in flight
        feeder.top_up(version, k)

        # consume: complete groups within the staleness bound; older ones are dropped and counted.
        # A step a predecessor trained after the checkpoint takes exactly its groups again.
        batch: list[Group] = []
        dropped: list[dict] = []
        drop_entries: list[str] = []
        redo = replay.pop(step + 1, None)
        if redo is not None:
            batch = [g for g in ready if g.group_id in redo]
            ready[:] = [g for g in ready if g.group_id not in redo]
        filtered = 0  # groups dropped by dynamic sampling this step
        while len(batch) < spec.prompts_per_step:
            while ready and len(batch) < spec.prompts_per_step:
                g = ready.pop(0)
                gone = [v for v in {s.rollout.policy_version for s in g.samples.values()} if rolled_back(v, discarded)]
                flat = (redo is None and spec.algorithm.dynamic_sampling and not gone
                        and filtered < spec.algorithm.dynamic_sampling_max_drops * spec.prompts_per_step
                        and bool(no_signal(torch.tensor([[s.reward for s in g.samples.values()]]))[0]))
                if is_fresh(version, g.gen_version_min, k) and not gone and not flat:
                    batch.append(g)
                    continue
                filtered += flat
                why = (f"generated by policy version {min(gone)}, rolled back" if gone
                       else "dynamic sampling: every reward of the group is equal (no gradient)" if flat
                       else f"staleness > {k}")
                for s in g.samples.values():
                    dropped.append({"msg_id": s.msg_id, "status": "dropped", "trainer_version": version,
                                    "staleness": staleness(version, g.gen_version_min), "drop_reason": why})
                drop_entries += g.entries
                feeder.done(g.group_id)
            if len(batch) < spec.prompts_per_step:
                if dropped:
                    feeder.top_up(version, k)  # replace dropped groups so the step can fill
                take_scored(settings.block_ms)
                control.poll()
                if control.done:
                    break
        while control.state == "paused":  # no step advances while paused; nothing is dropped either
            wait_paused()
        if control.done or len(batch) < spec.prompts_per_step:
            break
        batch.sort(key=lambda g: group_seq(g.group_id))  # feed order: arrival order must not matter
        t_data = time.perf_counter()

        # advantages, loss, step (Learner.step: micro-batches normalised by global-batch counts)
        samples, rewards = flatten_batch(batch)
        stale = [staleness(version, s.rollout.policy_version) for s in samples]
        lr_scale = staleness_lr_scale(float(np.mean(stale))) if spec.algorithm.staleness_lr else 1.0
        redo_lr = resume.replay_lr.get(step + 1) if redo is not None and resume is not None else None
        tripped = False
        while True:  # the collapse guard looks at the update before anyone sees it
            step_metrics = learner.step(samples, rewards, lr_scale, lr=redo_lr)
            # the reward series counts only samples of policies on the current trajectory
            measured = trusted_reward(rewards.view(-1).tolist(), [s.rollout.policy_version for s in samples],
                                      discarded)
            window = [] if measured is None else [r for _, r in rewards_seen] + [measured]
            if tripped:  # the redo of a rolled-back step trains on the same samples, now even further
                # off-policy (AIPO truncates their weights): only a garbage update trips it again
                trip = None if (bad := non_finite(step_metrics)) is None else ("non_finite", bad)
            else:
                trip = (None if redo is not None or not guard.enabled
                        else guard_check(step_metrics, window, guard, spec.algorithm.loss))
            if trip is None:
                break
            tripped = True
            if not roll_back(*trip, window):  # the policy was kept (guard.on_no_checkpoint): the step stands
                break
        if measured is not None:
            rewards_seen.append([step + 1, measured])
        trained_version = version
        version += 1
        step += 1
        set_context(policy_version=version)
        t_train = time.perf_counter()

        # publish weights
        publish_s, checksum = publish_weights(
            model, version, server, streams, ledger, job_id, settings.keep_versions, run_id, learner.snapshot()
        )
        if redo is not None:
            assert resume is not None
            before = resume.checksums.get(version)
            if before == checksum:
                log.info("re-done step %d reproduces version %d (checksum %s)", step, version, checksum)
            else:
                log.warning("re-done step %d gives version %d checksum %s, the predecessor published %s "
                            "(non-deterministic kernels?)", step, version, checksum, before)

        # ledger + metrics; trained entries are held until a checkpoint covers them, the rest acked
        t_ledger = time.perf_counter()
        used = [{"msg_id": s.msg_id, "status": "trained", "trainer_version": trained_version, "staleness": st,
                 "drop_reason": overlong_reason(s, spec)} for s, st in zip(samples, stale, strict=True)]
        changed = record_used(used + dropped)
        # Samples the ledger already had as used: a re-done step's own (expected), else trained twice.
        twice = len(used) + len(dropped) - changed - (len(used) if redo is not None else 0)
        if twice:
            log.error("step %d: %d samples were already used in the ledger", step, twice)
        metrics = {
            **step_metrics,
            "off_policy/mean": float(np.mean(stale)),
            "off_policy/max": float(max(stale)),
            "off_policy/dropped": float(len(dropped)),
            "dynamic_sampling/dropped_groups": float(filtered),
            "staleness/bound": float(k),
            "ledger/trained_twice": float(twice),
            "resume/redone": float(redo is not None),
            "guard/trips": float(trips),
            "time/wait_s": t_data - t_start,
            "time/train_s": t_train - t_data,
            "time/publish_s": publish_s,
            "time/ledger_s": time.perf_counter() - t_ledger,
            "time/step_s": time.perf_counter() - t_start,
        }
        metrics["throughput/samples_per_s"] = len(samples) / metrics["time/step_s"]
        if adaptive is not None:  # the bound for the next step, from this step's drift
            k = adaptive.update(metrics)
        ledger.record_train_step(job_id, step, version, metrics)
        prom.step(step, version, metrics)
        ledger.set_job_step(job_id, step)
        held += [e for g in batch for e in g.entries]
        streams.ack(SCORED, GROUP_TRAINERS, drop_entries + assembler.strays)
        assembler.strays.clear()
        for g in batch:
            feeder.done(g.group_id)
        for stream, group in ((PROMPTS, GROUP_GENERATORS), (ROLLOUTS, GROUP_REWARDERS), (SCORED, GROUP_TRAINERS)):
            streams.trim_acked(stream, group)
        log.info(
            "step %d: reward %.3f loss %.4f is_mean %.3f ess %.3f stale mean %.2f max %d dropped %d | wait %.2fs train %.2fs",
            step, metrics["reward/mean"], metrics["loss"], metrics["is/mean"], metrics["is/ess"], metrics["off_policy/mean"],
            int(metrics["off_policy/max"]), len(dropped), metrics["time/wait_s"], metrics["time/train_s"],
        )
        if step < spec.steps:
            evaluator.start_due(step, version)

        # checkpoint: every checkpoint_every steps, and right after a roll-back (a resume must not
        # re-do the discarded steps); then the entries of the steps it covers are acked
        if (tripped or spec.checkpoint_every and step % spec.checkpoint_every == 0) and step < spec.steps:
            checkpoint_now()
            streams.ack(SCORED, GROUP_TRAINERS, held)
            held.clear()

    if control.state == "terminating":  # SIGTERM: a restart of this process, not the user's stop
        if step > 0:
            checkpoint_now()
            streams.ack(SCORED, GROUP_TRAINERS, held)
        log.info("trainer terminated at step %d (version %d), checkpointed; the job stays running", step, version)
        server.close()
        return
    if control.state == "cancelled":  # immediate: no final evaluation, nothing more published
        ledger.set_job_state(job_id, "cancelled")
        log.info("trainer cancelled at step %d (version %d)", step, version)
        server.close()
        return
    if step > 0:  # the final policy, for evaluation and export
        checkpoint_now()
        streams.ack(SCORED, GROUP_TRAINERS, held)
        held.clear()
    # final evaluation of every set, then wait for every outstanding round
    evaluator.start_due(step, version, final=True)
    deadline = time.monotonic() + settings.job_wait_s
    while evaluator.pending and time.monotonic() < deadline:
        take_scored(settings.block_ms)
    ledger.set_job_state(job_id, "finished" if step >= spec.steps else "stopped")
    # The job is over for every service of it: generators and rewarders exit on this.
    streams.publish(CONTROL, Control(job_id=job_id, msg_id=f"end-{step}", policy_version=version,
                                     command="drain", reason=f"trainer finished at step {step}"))
    log.info("trainer done at step %d (version %d)", step, version)
    server.close()
