"""RL math as small pure functions over typed records. No Redis, SQL or vLLM here.

Shapes: B samples, T completion positions (right-padded), G groups of n samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossInputs:
    logprobs: torch.Tensor  # (B, T) current policy log pi(a_t|s_t), with grad
    behaviour_logprobs: torch.Tensor  # (B, T) log mu(a_t|s_t) reported by the generator
    advantages: torch.Tensor  # (B,) one advantage per sample (outcome reward)
    mask: torch.Tensor  # (B, T) 1.0 for completion tokens, 0.0 for padding


@dataclass(frozen=True)
class LossOutputs:
    loss: torch.Tensor  # scalar; already divided by the global token count
    metrics: dict[str, float]  # sums over this micro-batch (divide by the global token count to average)


# --- advantages ---------------------------------------------------------------------------------


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO group z-score (Shao et al. 2024, DeepSeekMath eq. 3 outcome supervision).

    A_i = (r_i - mean(r)) / (std(r) + eps), std with Bessel's correction (as TRL and verl).

    Args:
        rewards: (G, n) rewards, one row per prompt group.
    Returns:
        (G, n) advantages; a group whose rewards are all equal gets zeros.
    """
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    return (rewards - mean) / (std + eps)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"grpo": grpo_advantages}


# --- losses -------------------------------------------------------------------------------------


def aipo_loss(inp: LossInputs, *, rho: float, num_tokens: int) -> LossOutputs:
    """AIPO: REINFORCE with a truncated importance weight (LlamaRL, arXiv 2505.24034, sec. 5).

    loss = - sum_{b,t} mask * sg(min(pi/mu, rho)) * A_b * log pi(a_t)  /  num_tokens

    The weight is a stop-gradient so the gradient is min(pi/mu, rho) * A * grad log pi; truncation
    at rho bounds the variance that stale samples (mu far from pi) would otherwise bring.
    `num_tokens` is the completion-token count of the whole global batch, so the result does not
    depend on how the batch is split into micro-batches ("token-mean" aggregation).
    """
    mask = inp.mask
    log_ratio = (inp.logprobs.detach() - inp.behaviour_logprobs) * mask
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=rho)
    per_token = -weight * inp.advantages[:, None] * inp.logprobs
    loss = (per_token * mask).sum() / num_tokens
    truncated = (ratio > rho).float() * mask
    # k3 estimator of KL(mu || pi) per token (Schulman 2020): (r - 1) - log r with r = pi/mu.
    k3 = (ratio - 1.0 - log_ratio) * mask
    metrics = {
        "is/sum": float((ratio * mask).sum()),
        "is/max": float((ratio * mask).max()) if mask.any() else 0.0,
        "is/truncated_sum": float(truncated.sum()),
        "mismatch_kl/sum": float(k3.sum()),
    }
    return LossOutputs(loss=loss, metrics=metrics)


LOSSES: dict[str, Callable[..., LossOutputs]] = {"aipo": aipo_loss}


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
