"""The learner: the policy, its optimizer and the algorithm, one optimizer step on one global batch
(`Learner`), and what ranks 1..N-1 run instead of the loop (`follow`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from shared.entry import accept_drain
from shared.jobspec import JobSpec, local_model_dir
from shared.settings import TrainerSettings
from trainer_svc import checkpoint, lora
from trainer_svc.algorithms import (
    ADVANTAGE_ESTIMATORS,
    BatchNorm,
    LossConfig,
    LossInputs,
    accumulate,
    finalize_metrics,
    lookup,
    policy_loss,
)
from trainer_svc.batch import TrainBatch
from trainer_svc.dist import Ranks, full_value
from trainer_svc.logprobs import token_logprobs, token_logprobs_and_entropy
from trainer_svc.packing import check_packing
from trainer_svc.precision import autocast, mixed_precision_policy
from trainer_svc.shaping import overlong_penalty
from trainer_svc.weights import probe


def load_policy(spec: JobSpec, device: str, path: str | Path | None = None, adapters: bool = True):
    """The policy and tokenizer from `path` (a checkpoint), else the job's model. With `spec.lora`
    (and `adapters`): the job's model with fresh LoRA adapters (a checkpoint's top-level weights
    are merged: never the base to adapt; `Learner` loads its adapter folder)."""
    path = local_model_dir(path or spec.model_path, "model_path" if path is None else "checkpoint")
    if spec.lora is not None and adapters:
        local_model_dir(spec.model_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lora_spec = spec.lora if adapters else None
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        spec.model_path if lora_spec is not None else path, dtype=torch.float32
    )
    model = model.to(device)
    if lora_spec is not None:
        model = lora.wrap(model, lora_spec, spec.seed)
    model.train()
    return model, tokenizer


def model_context(config: Any) -> int | None:
    """The most tokens (prompt + completion) a sample of this model can hold: its
    max_position_embeddings, times its rope_scaling factor where it has one (an engine extends the
    context so: a looser bound rather than one that refuses what the engine generated); None when
    the config states none."""
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0:
        return None
    scaling = getattr(config, "rope_scaling", None)
    factor = scaling.get("factor", 1.0) if isinstance(scaling, dict) else 1.0
    return int(positions * max(1.0, float(factor) if isinstance(factor, (int, float)) else 1.0))


def shape_overlong(batch: TrainBatch, spec: JobSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The job's over-long treatment (algorithm.overlong): rewards (G, n) with DAPO's soft length
    penalty added to truncated samples ("penalty"), and a (B,) weight that masks truncated samples
    out of the loss ("mask": advantage 0, so no gradient from them)."""
    a = spec.algorithm
    rewards, cut = batch.rewards, batch.truncated
    keep = torch.ones(len(batch))
    if a.overlong == "mask":
        keep = (~cut).to(torch.float32)
    elif a.overlong == "penalty":
        rewards = rewards + (
            overlong_penalty(batch.completion_lens, spec.sampling.max_tokens, a.overlong_buffer, a.overlong_penalty)
            * cut
        ).view_as(rewards)
    return rewards, keep


def enable_gradient_checkpointing(model: torch.nn.Module) -> bool:
    """Activation checkpointing of an HF model's layers (non-reentrant), if it supports it;
    whether it was enabled."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return False
    cast(PreTrainedModel, model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return True


class Learner:
    """The policy, its optimizer and the algorithm: one optimizer step on one global batch.

    advantages -> loss over micro-batches (normalised by global-batch counts, so the gradient does
    not depend on the micro-batch size, nor on how the batch is split across ranks) -> clip ->
    step. Used by the trainer loop and by the bench.

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
        # LoRA: the initial adapters (B = 0), which `restore(None)` puts back; then the checkpoint's
        self.initial_adapter = lora.adapter_state(model) if spec.lora and self.ranks.is_main else None
        if spec.lora and model_path and self.ranks.is_main and (Path(model_path) / lora.ADAPTER_DIR).is_dir():
            lora.load_adapter_state(model, lora.read_adapter(Path(model_path) / lora.ADAPTER_DIR))
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)  # token ids it can embed
        self.context = model_context(model.config)  # tokens a sample may hold in all
        a = spec.algorithm
        if a.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        # Packing: refuse a model that would let packed samples attend to each other. Before the
        # FSDP2 wrap: a forward of the wrapped model before the optimizer exists left the optimizer
        # holding parameters FSDP2 does not know (KeyError in get_optimizer_state_dict).
        if a.packing:
            check_packing(model)
        self.model = self.ranks.wrap(
            model, cpu_offload=a.cpu_offload, mp_policy=mixed_precision_policy(device, a.dtype)
        )
        self.autocast = autocast(device, a.dtype)  # the forward's precision; weights stay float32
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # LoRA: the adapters only (the frozen base has no optimizer state at all)
        self.optimizer = torch.optim.AdamW(
            [p for _, p in lora.trainable(self.model)], lr=a.lr, betas=a.betas, eps=a.eps, weight_decay=a.weight_decay
        )
        self.advantage_fn = lookup(ADVANTAGE_ESTIMATORS, a.advantage, "advantage estimator")
        self.cfg = LossConfig.from_spec(a)
        self.lr = a.lr  # the step size when `step` is given none (the loop gives the schedule's)
        self.ref_model = None
        if a.kl_coef > 0:  # frozen copy of the initial policy for the KL penalty
            self.ref_model, _ = load_policy(spec, device, adapters=False)
            self.ref_model.eval().requires_grad_(False)

    def step(self, batch: TrainBatch, lr_scale: float = 1.0, lr: float | None = None) -> dict[str, float]:
        """One optimizer step on `batch` (samples in group order). The step size is `lr` if given
        (the loop's: the schedule's at its step, LoopState.step_lr), else the base lr times
        `lr_scale`. Returns the step's metrics. Whatever raises does so before the optimizer
        steps: a step that raises leaves the weights and the optimizer state as they were."""
        spec = self.spec
        self.ranks.announce("step", tensors=batch.tensors(), terms=list(batch.term_names), lr_scale=lr_scale, lr=lr)
        rewards, norm, sums = self._gradients(batch)
        grad_norm = float(
            full_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(), spec.algorithm.max_grad_norm))
        )
        lr = self.lr * lr_scale if lr is None else lr
        metrics = {
            **finalize_metrics(sums, norm),
            **batch.reward_terms(),
            "overlong/truncated": float(int(batch.truncated.sum())),
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": float(norm.num_tokens),
            "samples": float(len(batch)),
        }
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return metrics

    def check(self, batch: TrainBatch) -> None:
        """Raise what `step` would raise on `batch`, changing nothing: the loss and its gradients,
        cleared after, and no optimizer step. The probe a failed step is bisected with
        (trainer_svc/isolation.py).

        Raises:
            RuntimeError: the model spans several ranks (every pass there is a collective that
                rank 0 alone cannot make).
        """
        if self.ranks.world_size > 1:
            raise RuntimeError("Learner.check runs at world size 1 only")
        try:
            self._gradients(batch)
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    def _gradients(self, batch: TrainBatch) -> tuple[torch.Tensor, BatchNorm, dict[str, float]]:
        """Advantages, then the loss and backward of every micro-batch of this rank's share:
        the gradients of the whole batch accumulated; returns the rewards as shaped (G, n), the
        batch's normalisation and the metric sums over every rank."""
        spec = self.spec
        rewards, keep = shape_overlong(batch, spec)
        advantages = self.advantage_fn(rewards).reshape(-1) * keep  # (B,)
        norm = BatchNorm.from_lengths(batch.model_token_counts(), max_len=spec.sampling.max_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        # This rank's share of the global batch, in micro-batches (sample ranges, or sample lists
        # packed to a token budget); None pads the count to that of the busiest rank (every FSDP
        # forward is a collective) and contributes no gradient.
        a = spec.algorithm
        parts = (
            self.ranks.packed_micro_batches(batch.sample_lengths(), a.micro_batch_tokens)
            if a.packing
            else self.ranks.micro_batches(len(batch), a.micro_batch_size)
        )
        for part in parts:
            sums = accumulate(sums, self._backward(batch, advantages, norm, part))
        return rewards, norm, self.ranks.reduce_metrics(sums)  # every rank's micro-batches: the global batch

    def _backward(
        self, batch: TrainBatch, advantages: torch.Tensor, norm: BatchNorm, part: tuple[int, int] | list[int] | None
    ) -> dict[str, float]:
        """Loss and backward of samples [lo, hi) of `batch` (`part`), or of the samples listed,
        packed into one row (trainer_svc/packing.py); None: a padding micro-batch that
        contributes no gradient. Returns its metric sums."""
        pos = None
        unpack: Callable[[torch.Tensor], torch.Tensor]
        if isinstance(part, list) or (part is None and self.spec.algorithm.packing):
            mb = batch.packed_micro_batch(part or [0]).to(self.device)
            ids, attn, pos, temp, behaviour, mask = (
                mb.input_ids,
                None,
                mb.position_ids,
                mb.temperatures,
                mb.behaviour_logprobs,
                mb.mask,
            )
            cut = {"top_k": mb.top_ks, "top_p": mb.top_ps}
            adv, unpack = advantages[mb.samples.cpu()].to(self.device), mb.unpack
        else:
            lo, hi = part or (0, 1)
            ids, attn, behaviour, mask, temp = batch.micro_batch(lo, hi, self.pad_id)
            ids, attn, behaviour, mask = (t.to(self.device) for t in (ids, attn, behaviour, mask))
            cut = {"top_k": batch.top_ks[lo:hi], "top_p": batch.top_ps[lo:hi]}
            adv, unpack = advantages[lo:hi].to(self.device), _same
        # each sample's own temperature, top-k and top-p: the behaviour policy it was drawn from,
        # the truncated distribution this policy's samples come from (ARCHITECTURE.md)
        chunk = self.spec.algorithm.logprob_chunk_tokens
        with self.autocast():
            logprobs, entropy = token_logprobs_and_entropy(
                self.model,
                ids,
                attn,
                temp,
                entropy_grad=self.cfg.entropy_coef > 0,
                chunk_tokens=chunk,
                position_ids=pos,
                **cut,
            )
        logprobs, entropy = unpack(logprobs), unpack(entropy)  # packed: back to one row per sample
        ref = None
        if self.ref_model is not None:
            with torch.no_grad(), self.autocast():
                # the initial policy sampled the same way (its own cut): the KL is 0 at the start
                ref = unpack(
                    token_logprobs(self.ref_model, ids, attn, temp, chunk_tokens=chunk, position_ids=pos, **cut)
                )
        out = policy_loss(LossInputs(logprobs, behaviour, adv, mask, ref_logprobs=ref, entropy=entropy), self.cfg, norm)
        if part is None:
            (out.loss * 0.0).backward()
            return {k: -math.inf if k.endswith("max") else 0.0 for k in out.metrics}
        # This rank's share of the global sum; x N undoes the average of FSDP's gradient reduction.
        (out.loss * self.ranks.world_size).backward()
        return out.metrics

    def snapshot(self) -> tuple[dict[str, torch.Tensor], tuple[list[int], list[float]]]:
        """The full weights (LoRA: the adapter's tensors only) on rank 0, {} on the others, and
        the probe fingerprint (with the adapter applied), for `weights.publish_weights`."""
        self.ranks.announce("snapshot")
        if self.spec.lora is not None:
            return lora.adapter_state(self.model, self.ranks.is_main), probe(self.model)
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
        if weights and self.spec.lora is not None:  # the base is frozen: only the adapters go back
            state = (lora.read_adapter(Path(path) / lora.ADAPTER_DIR) if path else self.initial_adapter) if main else {}
            lora.load_adapter_state(self.model, state or {}, main)
        elif weights:
            self.ranks.load_model_state(
                self.model, checkpoint.read_weights(path or self.spec.model_path) if main else {}
            )
        optimizer = None if path is None else checkpoint.read_optimizer(Path(path)) if main else {}
        self.ranks.load_optimizer_state(self.model, self.optimizer, optimizer)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


# Ranks 1..N-1: what to do on each announcement of rank 0 (the Learner calls above).
FOLLOW = {
    "step": lambda learner, m: learner.step(TrainBatch.from_tensors(m["tensors"], m["terms"]), m["lr_scale"], m["lr"]),
    "snapshot": lambda learner, m: learner.snapshot(),
    "full_state": lambda learner, m: learner.full_state(),
    "restore": lambda learner, m: learner.restore(m["path"], m["weights"]),
    "tick": lambda learner, m: None,  # rank 0 is waiting (for data, or paused)
}


def follow(settings: TrainerSettings, ranks: Ranks) -> None:
    """A rank other than 0: no Redis, no ledger, no weight server; rank 0's collective Learner
    calls, in the order it announces them, until it announces `exit`; each `init` starts a job."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    # torchrun passes a SIGTERM to every rank: rank 0 drains (finishes its step, checkpoints, then
    # announces exit), and that needs this rank in the collectives until then.
    accept_drain()
    learner: Learner | None = None
    while (m := ranks.receive())["op"] != "exit":
        if m["op"] == "init":  # a job begins (rank 0 serves the fleet's jobs one after another)
            spec = JobSpec.model_validate(m["spec"])
            torch.manual_seed(spec.seed)
            learner = None
            learner = Learner(spec, settings.device, ranks=ranks)
            continue
        if learner is None:
            raise RuntimeError(f"rank {ranks.rank}: expected the init announcement, got {m['op']!r}")
        lookup(FOLLOW, m["op"], "announcement")(learner, m)
