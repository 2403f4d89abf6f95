"""Batch filters and reward shaping from DAPO (Yu et al. 2025, arXiv 2503.14476): dynamic sampling
and over-long handling. Pure functions over small tensors; the loop records what they decide.
"""

from __future__ import annotations

import torch


def no_signal(rewards: torch.Tensor, atol: float = 1e-9) -> torch.Tensor:
    """(G, n) rewards -> (G,) bool: groups whose rewards all equal. Under group-normalised
    advantages (grpo, group_mean, rloo) such a group has advantage 0 everywhere and adds no
    gradient, only noise to the token normalisation (DAPO section 3.2, dynamic sampling)."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) <= atol


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, max_penalty: float = 1.0) -> torch.Tensor:
    """(B,) completion lengths -> (B,) reward added, DAPO's soft over-long punishment (eq. 13):
    0 up to max_tokens - buffer; then falling linearly to -max_penalty at max_tokens:
    ((max_tokens - buffer) - len) / buffer * max_penalty. A completion cannot exceed max_tokens
    here (the generator stops there), so the -1 branch of the paper is the end of the ramp.

    Raises:
        ValueError: unless 0 < buffer <= max_tokens.
    """
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"the over-long buffer must be in 1..max_tokens ({max_tokens}), got {buffer}")
    start = max_tokens - buffer
    over = (lengths.to(torch.float32) - start).clamp(min=0.0)
    return -(over / buffer).clamp(max=1.0) * max_penalty
