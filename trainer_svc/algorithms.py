"""RL math as small pure functions over typed records. No Redis, SQL or vLLM here.

Shapes: B samples, T completion positions (right-padded), G groups of n samples.

One optimizer step over a global batch split into micro-batches::

    norm = BatchNorm.from_lengths(completion_lengths, max_len)      # once, whole batch
    for each micro-batch:
        out = policy_loss(LossInputs(...), cfg, norm)                # already globally normalised
        out.loss.backward()
        sums = accumulate(sums, out.metrics)
    metrics = finalize_metrics(sums, norm)

Each loss returns a per-token loss (B, T); `aggregate` reduces it with denominators taken from
`BatchNorm` (global counts), never from the micro-batch, so the summed gradient does not depend
on how the batch is split (verl `agg_loss` modes, computed over the global batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# --- records ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossInputs:
    logprobs: torch.Tensor  # (B, T) current policy log pi(a_t|s_t), with grad
    behaviour_logprobs: torch.Tensor  # (B, T) log mu(a_t|s_t) reported by the generator
    advantages: torch.Tensor  # (B,) one advantage per sample (outcome reward)
    mask: torch.Tensor  # (B, T) 1.0 for completion tokens, 0.0 for padding
    ref_logprobs: torch.Tensor | None = None  # (B, T) log pi_ref of a frozen reference, no grad
    # (B, T) token entropy of pi: with grad for the entropy bonus (LossConfig.entropy_coef > 0),
    # else detached, a metric only
    entropy: torch.Tensor | None = None


@dataclass(frozen=True)
class LossOutputs:
    loss: torch.Tensor  # scalar; already normalised by global-batch counts (sum over micro-batches)
    metrics: dict[str, float]  # sums over this micro-batch; keys ending in "max" are maxima


@dataclass(frozen=True)
class TokenLoss:
    """What a registered loss returns, before aggregation."""

    per_token: torch.Tensor  # (B, T) loss per token; values at padding are ignored
    metrics: dict[str, torch.Tensor]  # 0-dim sums over this micro-batch (loss-specific)


@dataclass(frozen=True)
class BatchNorm:
    """Denominators of the whole global batch, computed once per optimizer step.

    Attributes:
        num_tokens: completion tokens in the global batch (the sum of every mask).
        num_seqs: samples in the global batch (including any with an empty completion).
        max_len: the generation token budget (`sampling.max_tokens`), a constant across steps.
    """

    num_tokens: int
    num_seqs: int
    max_len: int

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.num_seqs < 1 or self.max_len < 1:
            raise ValueError(f"BatchNorm needs num_tokens >= 0, num_seqs >= 1, max_len >= 1; got {self}")

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], max_len: int) -> BatchNorm:
        """From the completion length of every sample in the global batch."""
        return cls(num_tokens=int(sum(lengths)), num_seqs=len(lengths), max_len=max_len)


@dataclass(frozen=True)
class LossConfig:
    """Which loss and aggregation, and their constants (defaults equal `shared.jobspec`'s).

    Raises:
        ValueError: on an unknown loss or aggregation name, listing the valid ones.
    """

    loss: str = "aipo"
    aggregation: str = "token-mean"
    rho: float = 2.0  # aipo: importance weight truncated at rho
    clip_low: float = 0.2  # ppo_clip: ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # ppo_clip: ratio clipped above at 1 + clip_high
    gspo_clip_low: float = 3e-4  # gspo: sequence ratio clipped below at 1 - gspo_clip_low
    gspo_clip_high: float = 4e-4  # gspo: sequence ratio clipped above at 1 + gspo_clip_high
    kl_coef: float = 0.0  # weight of the k3 KL to the reference; 0 disables it
    entropy_coef: float = 0.0  # entropy bonus: loss_t -= entropy_coef * H_t; 0 disables it

    def __post_init__(self) -> None:
        lookup(LOSSES, self.loss, "loss")
        lookup(AGGREGATIONS, self.aggregation, "aggregation")

    @classmethod
    def from_spec(cls, spec: Any) -> LossConfig:
        """From a `shared.jobspec.AlgorithmSpec` (read by attribute name)."""
        return cls(
            loss=spec.loss,
            aggregation=spec.aggregation,
            rho=spec.rho,
            clip_low=spec.clip_low,
            clip_high=spec.clip_high,
            gspo_clip_low=spec.gspo_clip_low,
            gspo_clip_high=spec.gspo_clip_high,
            kl_coef=spec.kl_coef,
            entropy_coef=spec.entropy_coef,
        )


# --- advantages ---------------------------------------------------------------------------------
#
# Each estimator computes in float64 and returns the rewards' dtype. A float32 group statistic
# overflows near float32's largest value (3.4e38): a mean or std of inf makes every advantage of the
# group 0 or NaN, silently. Rewards reach the trainer within the job's `reward_limits.bounds` (at
# most 1e12 in size: the reward service and trainer_svc/sink.py see to it), so an advantage is
# always far inside float32; the float64 is the margin for the statistics.


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO group z-score (Shao et al. 2024, DeepSeekMath eq. 3 outcome supervision).

    A_i = (r_i - mean(r)) / (std(r) + eps), std with Bessel's correction (as TRL and verl).

    Args:
        rewards: (G, n) rewards, one row per prompt group.
    Returns:
        (G, n) advantages in the rewards' dtype; a group whose rewards are all equal gets zeros.
    """
    r = rewards.double()
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(mean)
    return ((r - mean) / (std + eps)).to(rewards.dtype)


def group_mean_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Group-mean baseline, no std division: A_i = r_i - mean(r).

    AIPO's baseline v(x) = (1/n) sum_i r(x, y_i) (LlamaRL, arXiv 2505.24034, sec. 5); Dr. GRPO
    (Liu et al. 2025, arXiv 2503.20783) drops GRPO's std division as a difficulty bias.

    Args:
        rewards: (G, n).
    Returns:
        (G, n) in the rewards' dtype; each row sums to zero.
    """
    r = rewards.double()
    return (r - r.mean(dim=1, keepdim=True)).to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv 2402.14740, eq. 6).

    A_i = r_i - (1/(n-1)) sum_{j != i} r_j = n/(n-1) * (r_i - mean(r)).

    Args:
        rewards: (G, n) with n >= 2.
    Returns:
        (G, n); each row sums to zero.
    Raises:
        ValueError: if n < 2 (no other sample to form the baseline).
    """
    n = rewards.shape[1]
    if n < 2:
        raise ValueError(f"rloo needs at least 2 samples per group, got {n}")
    r = rewards.double()
    loo_mean = (r.sum(dim=1, keepdim=True) - r) / (n - 1)
    return (r - loo_mean).to(rewards.dtype)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "grpo": grpo_advantages,
    "group_mean": group_mean_advantages,
    "rloo": rloo_advantages,
}


# --- losses (per token) -------------------------------------------------------------------------


def _log_ratio(inp: LossInputs, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) log(pi/mu), with grad through log pi; 0 at padding so exp() never sees garbage."""
    return (inp.logprobs - inp.behaviour_logprobs) * mask


def applied_weight_sums(weight: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the importance weights a loss's gradient actually applies to A * grad log pi
    (after its truncation or clip; 0 where the clip zeroes the gradient), for the collapse guard's
    `is/applied_ess` and `is/applied_max` (trainer_svc/guard.py): a raw pi/mu of 148 on a token that
    AIPO truncates at rho changes nothing, a few tokens carrying the whole update does.

    Args:
        weight: (B, T) per token, or (B,) per sequence for a loss whose weight is a sequence's.
        mask: the same shape, 1.0 where a unit counts (completion tokens; non-empty sequences).
    Returns:
        0-dim `is/applied_sum`, `is/applied_sq_sum`, `is/applied_n` (units counted) and
        `is/applied_max` over the counted units.
    """
    w = weight.detach() * mask  # weights are >= 0, so padding's zeros never raise the max
    return {
        "is/applied_sum": w.sum(),
        "is/applied_sq_sum": (w * w).sum(),
        "is/applied_n": mask.sum(),
        "is/applied_max": w.max() if w.numel() else w.new_zeros(()),
    }


def aipo_loss(inp: LossInputs, cfg: LossConfig) -> TokenLoss:
    """AIPO: REINFORCE with a truncated importance weight (LlamaRL, arXiv 2505.24034, sec. 5).

    loss_t = - sg(min(pi/mu, rho)) * A * log pi(a_t)

    The weight is a stop-gradient, so the gradient is min(pi/mu, rho) * A * grad log pi and stays
    alive at weight rho (V-trace-style truncation; the reference notes' variant (a)). Truncation
    bounds the variance that stale samples (mu far from pi) would otherwise bring.

    Returns:
        per_token (B, T); metrics `is/truncated_sum` (tokens with pi/mu > rho) and the applied
        weights min(pi/mu, rho) (`applied_weight_sums`).
    """
    mask = inp.mask.to(inp.logprobs.dtype)
    ratio = torch.exp(_log_ratio(inp, mask).detach())  # (B, T)
    weight = torch.clamp(ratio, max=cfg.rho)
    per_token = -weight * inp.advantages[:, None] * inp.logprobs
    truncated = ((ratio > cfg.rho).to(mask.dtype) * mask).sum()
    return TokenLoss(per_token, {"is/truncated_sum": truncated, **applied_weight_sums(weight, mask)})


def reinforce_loss(inp: LossInputs, cfg: LossConfig) -> TokenLoss:
    """Plain REINFORCE with no off-policy correction: loss_t = - A * log pi(a_t) (Williams 1992).

    The ablation for stale samples: it treats behaviour-policy samples as if they were on-policy
    (applied weight 1 on every token).
    """
    mask = inp.mask.to(inp.logprobs.dtype)
    per_token = -inp.advantages[:, None] * inp.logprobs
    return TokenLoss(
        per_token,
        {
            "is/truncated_sum": torch.zeros((), dtype=inp.logprobs.dtype),
            **applied_weight_sums(torch.ones_like(mask), mask),
        },
    )


def ppo_clip_loss(inp: LossInputs, cfg: LossConfig) -> TokenLoss:
    """PPO clipped surrogate against the behaviour policy, with DAPO clip-higher.

    r_t = exp(log pi - log mu) (with grad), eps_low/eps_high = clip_low/clip_high:
    loss_t = - min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)
    (Schulman et al. 2017, arXiv 1707.06347, eq. 7; decoupled clip range from Yu et al. 2025,
    DAPO, arXiv 2503.14476, eq. 10.)

    Returns:
        per_token (B, T); metrics `is/truncated_sum` (tokens where the clip is active, i.e. the
        clipped term is the strictly smaller objective and the token's gradient is zero) and the
        applied weights: d loss_t / d log pi = -r_t * A off the clip, 0 on it, so r_t or 0
        (`applied_weight_sums`; r_t is unbounded for A < 0, where the clip never binds above).
    """
    mask = inp.mask.to(inp.logprobs.dtype)
    ratio = torch.exp(_log_ratio(inp, mask))  # (B, T), with grad
    adv = inp.advantages[:, None]  # (B, 1)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    r = ratio.detach()
    active = ((adv > 0) & (r > 1.0 + cfg.clip_high)) | ((adv < 0) & (r < 1.0 - cfg.clip_low))
    applied = applied_weight_sums(r * (~active).to(mask.dtype), mask)
    return TokenLoss(per_token, {"is/truncated_sum": (active.to(mask.dtype) * mask).sum(), **applied})


def gspo_loss(inp: LossInputs, cfg: LossConfig) -> TokenLoss:
    """GSPO: PPO clip on a length-normalised sequence ratio (Zheng et al. 2025, arXiv 2507.18071).

    s_i = exp( (1/|y_i|) sum_t (log pi - log mu) )                       (GSPO eq. 7)
    loss_i = - min(s_i * A_i, clip(s_i, 1 - gspo_clip_low, 1 + gspo_clip_high) * A_i)   (eq. 5)

    loss_i is placed on each of sequence i's tokens, so `seq-mean-token-mean` aggregation yields
    mean_i loss_i as in the paper (verl forces that mode for GSPO); `token-mean` would weight each
    sequence by its length instead.

    Returns:
        per_token (B, T); metrics `is/truncated_seq_sum` (non-empty sequences whose clip is active)
        and the applied weights per non-empty sequence: s_i off the clip, 0 on it
        (`applied_weight_sums`).
    """
    mask = inp.mask.to(inp.logprobs.dtype)
    lengths = mask.sum(dim=1)  # (B,)
    seq_log_ratio = _log_ratio(inp, mask).sum(dim=1) / lengths.clamp(min=1.0)  # (B,)
    s = torch.exp(seq_log_ratio)  # (B,), with grad
    adv = inp.advantages
    clipped = torch.clamp(s, 1.0 - cfg.gspo_clip_low, 1.0 + cfg.gspo_clip_high)
    per_seq = -torch.min(s * adv, clipped * adv)  # (B,)
    per_token = per_seq[:, None].expand_as(mask)
    sd = s.detach()
    active = ((adv > 0) & (sd > 1.0 + cfg.gspo_clip_high)) | ((adv < 0) & (sd < 1.0 - cfg.gspo_clip_low))
    active_sum = (active & (lengths > 0)).to(mask.dtype).sum()
    applied = applied_weight_sums(sd * (~active).to(mask.dtype), (lengths > 0).to(mask.dtype))
    return TokenLoss(per_token, {"is/truncated_seq_sum": active_sum, **applied})


LOSSES: dict[str, Callable[[LossInputs, LossConfig], TokenLoss]] = {
    "reinforce": reinforce_loss,
    "aipo": aipo_loss,
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
}


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) from samples of pi (Schulman 2020, "Approximating
    KL divergence"): k3 = exp(ref - logp) - (ref - logp) - 1 >= 0, unbiased, low variance.

    Args:
        logprobs: (B, T) log pi, with grad (the gradient flows through it).
        ref_logprobs: (B, T) log pi_ref.
        mask: (B, T) float; padding gets d = 0, hence k3 = 0 (exp never sees padding values).
    Returns:
        (B, T), 0 at padding.
    """
    d = (ref_logprobs - logprobs) * mask
    return torch.exp(d) - d - 1.0


def mismatch_k3(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(mu || pi), mu the generator's (behaviour) policy and pi the
    trainer's, from tokens sampled by mu (Schulman 2020): with r = pi/mu,
    k3 = (r - 1) - log r >= 0, 0 where the two agree. Summed over model tokens and divided by
    their count it is the step metric `mismatch_kl`: on samples of the trainer's current version
    (sync mode, staleness 0) the cost of the engines' numerics (precision, kernels); on stale
    samples it also holds the policy's drift since.

    Args:
        logprobs: (B, T) log pi (no grad needed).
        behaviour_logprobs: (B, T) log mu.
        mask: (B, T) float; padding gets log r = 0, hence k3 = 0.
    Returns:
        (B, T) in the dtype of `logprobs`, 0 at padding. Computed as expm1(x) - x in float64: k3 is
        ~x^2/2, so at float32's logprob gaps (~1e-7) float32's exp(x) - 1 - x rounds it to 0 or to
        noise of the size of x itself.
    """
    log_ratio = ((logprobs - behaviour_logprobs) * mask).double()
    return ((torch.expm1(log_ratio) - log_ratio) * mask).to(logprobs.dtype)


# --- aggregation over the global batch ----------------------------------------------------------


def _token_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: BatchNorm) -> torch.Tensor:
    """sum_{i,t} l_it / N_tokens (DAPO token-level loss, arXiv 2503.14476 eq. 8)."""
    return (per_token * mask).sum() / max(norm.num_tokens, 1)


def _seq_mean_token_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: BatchNorm) -> torch.Tensor:
    """(1/N_seqs) sum_i (1/|y_i|) sum_t l_it (GRPO, arXiv 2402.03300 eq. 3)."""
    lengths = mask.sum(dim=1).clamp(min=1.0)  # an empty sequence contributes 0, not 0/0
    return ((per_token * mask).sum(dim=1) / lengths).sum() / norm.num_seqs


def _seq_mean_token_sum_norm(per_token: torch.Tensor, mask: torch.Tensor, norm: BatchNorm) -> torch.Tensor:
    """sum_{i,t} l_it / (max_len * N_seqs): Dr. GRPO's constant normaliser (arXiv 2503.20783)."""
    return (per_token * mask).sum() / (norm.max_len * norm.num_seqs)


AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, BatchNorm], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm: BatchNorm) -> torch.Tensor:
    """Reduce a micro-batch's per-token loss (B, T) with global-batch denominators to a scalar.

    Summing the results over the micro-batches of a step gives the global-batch loss exactly.

    Raises:
        ValueError: on an unknown mode, listing the valid ones.
    """
    fn = lookup(AGGREGATIONS, mode, "aggregation")
    return fn(per_token, mask.to(per_token.dtype), norm)


# --- the entry point the trainer calls ----------------------------------------------------------


def policy_loss(inp: LossInputs, cfg: LossConfig, norm: BatchNorm) -> LossOutputs:
    """The loss of one micro-batch, normalised by the global batch; backward() it and sum.

    Adds kl_coef * k3(pi, ref) per token when `cfg.kl_coef > 0` and subtracts the entropy bonus
    entropy_coef * H_t when `cfg.entropy_coef > 0` (Williams & Peng 1991; Mnih et al. 2016, A3C,
    arXiv 1602.01783 eq. 5), then aggregates by `cfg.aggregation`, so both terms are normalised
    like the policy loss. Metrics (sums over this micro-batch, `is/max` a maximum), all masked:
    `loss`, `is/sum` and `is/sq_sum` (token ratios pi/mu), `is/max`, the loss's
    `is/truncated_*sum`, `mismatch_kl/sum` (k3 of KL(mu || pi): (r - 1) - log r), and
    `kl_ref/sum` / `entropy/sum` when `ref_logprobs` / `entropy` are given.

    Raises:
        ValueError: if `cfg.kl_coef > 0` and `inp.ref_logprobs` is None, or `cfg.entropy_coef > 0`
            and `inp.entropy` is None or has no grad (the bonus would add a constant, no gradient).
    """
    mask = inp.mask.to(inp.logprobs.dtype)
    out = LOSSES[cfg.loss](inp, cfg)
    per_token = out.per_token
    stats = dict(out.metrics)
    if inp.ref_logprobs is not None:
        kl = k3_kl(inp.logprobs, inp.ref_logprobs, mask)  # (B, T)
        stats["kl_ref/sum"] = kl.detach().sum()
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    elif cfg.kl_coef > 0:
        raise ValueError("kl_coef > 0 needs LossInputs.ref_logprobs from the frozen reference model")
    if cfg.entropy_coef > 0:
        if inp.entropy is None or not inp.entropy.requires_grad:
            raise ValueError(
                "entropy_coef > 0 needs LossInputs.entropy with grad "
                "(logprobs.token_logprobs_and_entropy(..., entropy_grad=True))"
            )
        per_token = per_token - cfg.entropy_coef * inp.entropy
    loss = aggregate(per_token, mask, cfg.aggregation, norm)

    with torch.no_grad():
        log_ratio = _log_ratio(inp, mask)
        ratio = torch.exp(log_ratio) * mask  # (B, T), 0 at padding
        stats["loss"] = loss.detach()
        stats["is/sum"] = ratio.sum()
        stats["is/sq_sum"] = (ratio * ratio).sum()
        stats["is/max"] = ratio.max() if ratio.numel() else ratio.new_zeros(())
        stats["mismatch_kl/sum"] = mismatch_k3(inp.logprobs, inp.behaviour_logprobs, mask).sum()
        if inp.entropy is not None:
            stats["entropy/sum"] = (inp.entropy * mask).sum()
    # one device->host copy for all metrics instead of one per metric
    keys = list(stats)
    values = torch.stack([stats[k].detach().double().reshape(()) for k in keys]).tolist()
    return LossOutputs(loss=loss, metrics=dict(zip(keys, values, strict=True)))


# --- metrics across micro-batches ---------------------------------------------------------------


def accumulate(sums: Mapping[str, float], new: Mapping[str, float]) -> dict[str, float]:
    """Combine one micro-batch's metrics into the running ones: maxima for keys ending in "max",
    sums for the rest. Returns a new dict (start from `{}`)."""
    out = dict(sums)
    for key, v in new.items():
        if key not in out:
            out[key] = v
        elif key.endswith("max"):
            out[key] = max(out[key], v)
        else:
            out[key] = out[key] + v
    return out


# sum key -> (per-step metric, denominator: "tokens" or "seqs" of the global batch)
_MEANS: dict[str, tuple[str, str]] = {
    "is/sum": ("is/mean", "tokens"),
    "is/truncated_sum": ("is/truncated_frac", "tokens"),
    "is/truncated_seq_sum": ("is/truncated_frac", "seqs"),
    "mismatch_kl/sum": ("mismatch_kl", "tokens"),
    "kl_ref/sum": ("kl_ref", "tokens"),
    "entropy/sum": ("entropy", "tokens"),
}


def finalize_metrics(sums: Mapping[str, float], norm: BatchNorm) -> dict[str, float]:
    """Per-step metrics from the accumulated micro-batch sums.

    Returns `loss`, `is/mean`, `is/max`, `is/truncated_frac`, `is/ess`, `is/applied_ess`,
    `is/applied_max`, `mismatch_kl`, and `kl_ref` / `entropy` when they were measured. `is/ess` is
    the normalised effective sample size of the token importance weights w = pi/mu,
    (sum w)^2 / (N * sum w^2) in (0, 1] (Kong 1992; 1 = on-policy, ~1/N = one token dominates);
    1.0 for a batch without tokens. `is/applied_ess` is the same over the weights the loss applies
    after its truncation or clip (`applied_weight_sums`), 1.0 when none is non-zero (no update to
    be dominated); `is/applied_max` their largest.
    """
    denom = {"tokens": max(norm.num_tokens, 1), "seqs": norm.num_seqs}
    out: dict[str, float] = {}
    if "loss" in sums:
        out["loss"] = sums["loss"]
    for key, (name, unit) in _MEANS.items():
        if key in sums:
            out[name] = sums[key] / denom[unit]
    if "is/max" in sums:
        out["is/max"] = sums["is/max"]
    if "is/sum" in sums and "is/sq_sum" in sums:
        sq = sums["is/sq_sum"]
        out["is/ess"] = sums["is/sum"] ** 2 / (denom["tokens"] * sq) if sq > 0 else 1.0
    if "is/applied_sq_sum" in sums:
        sq, n = sums["is/applied_sq_sum"], sums["is/applied_n"]
        out["is/applied_ess"] = sums["is/applied_sum"] ** 2 / (n * sq) if sq > 0 and n > 0 else 1.0
        out["is/applied_max"] = max(sums["is/applied_max"], 0.0)  # a padding rank's -inf alone: 0
    return out


# --- learning-rate schedule ---------------------------------------------------------------------


@dataclass(frozen=True)
class LrSchedule:
    """The lr by step (a job's: `from_spec`; this dataclass's own defaults are a constant `lr`, so a
    LoopState built without a spec never decays to 0).

    Raises:
        ValueError: on an unknown schedule name (listing the valid ones), or a warm-up longer than
            the job.
    """

    lr: float = 1e-6  # the peak lr (algorithm.lr)
    name: str = "constant"  # constant, linear or cosine: the decay after the warm-up
    warmup_steps: int = 0  # steps 1..warmup_steps ramp linearly up to lr
    min_lr_ratio: float = 0.0  # linear, cosine: the last step's lr / lr
    steps: int = 1  # the job's last step

    def __post_init__(self) -> None:
        lookup(LR_DECAYS, self.name, "lr schedule")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must lie in 0..steps ({self.steps}), got {self.warmup_steps}")

    @classmethod
    def from_spec(cls, spec: Any) -> LrSchedule:
        """From a `shared.jobspec.JobSpec` (read by attribute name)."""
        a = spec.algorithm
        return cls(
            lr=a.lr, name=a.lr_schedule, warmup_steps=a.warmup_steps, min_lr_ratio=a.min_lr_ratio, steps=spec.steps
        )


# name -> the fraction of (1 - min_lr_ratio) decayed at progress p in [0, 1] after the warm-up
LR_DECAYS: dict[str, Callable[[float], float]] = {
    "constant": lambda p: 0.0,
    "linear": lambda p: p,
    "cosine": lambda p: 0.5 * (1.0 - math.cos(math.pi * p)),  # SGDR (Loshchilov & Hutter 2017), half a period
}


def lr_factor(step: int, sched: LrSchedule) -> float:
    """The lr of `step` relative to the peak lr, in [0, 1].

    Steps count from 1 (the first optimizer step; the ledger's numbering). With W warm-up steps
    and S steps in all::

        t <= W:   t / W                                   (step 1 at 1/W, step W at 1)
        t >  W:   1 - (1 - min_lr_ratio) * decay(p),  p = min((t - W) / (S - W), 1)

    decay(p) is 0 (constant), p (linear) or (1 - cos(pi p)) / 2 (cosine), so a decaying schedule
    reaches min_lr_ratio at the last step S and stays there past it. Exactly 1.0 for a constant
    schedule after its warm-up, so a job with `lr_schedule: constant` trains at `lr` bit for bit.
    """
    w, s = sched.warmup_steps, sched.steps
    if w and step <= w:
        return max(step, 0) / w
    p = min((step - w) / max(s - w, 1), 1.0)
    return 1.0 - (1.0 - sched.min_lr_ratio) * LR_DECAYS[sched.name](p)


def lr_at(step: int, sched: LrSchedule) -> float:
    """The lr of `step` (1-based): the peak lr times `lr_factor`."""
    return sched.lr * lr_factor(step, sched)


# --- staleness ----------------------------------------------------------------------------------


def staleness(trainer_version: int, gen_version_min: int) -> int:
    """How many optimizer steps behind the policy that generated a sample is (>= 0)."""
    return trainer_version - gen_version_min


def is_fresh(trainer_version: int, gen_version_min: int, max_staleness: int) -> bool:
    """Keep a sample only if it is at most `max_staleness` versions old (k = 0: on-policy)."""
    return staleness(trainer_version, gen_version_min) <= max_staleness


def lookup(registry: dict, name: str, what: str):
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} '{name}'; valid: {sorted(registry)}") from None
