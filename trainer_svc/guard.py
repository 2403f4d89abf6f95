"""Collapse guard: signs that a step is destroying the policy, as small pure checks.

The loop runs `check` on each step's metrics before it publishes the new weights; a trip makes it
roll back to the last committed checkpoint, lower the lr (and the staleness bound when the
importance weights blew up), record the change in the ledger, and redo the step.
No I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GuardConfig:
    """Thresholds; defaults are loose enough that a healthy run never trips (they are a seat belt,
    not a tuning knob)."""

    max_is: float = 100.0  # largest per-token importance weight pi/mu before truncation
    min_ess: float = 0.05  # normalised effective sample size of the importance weights, (0, 1]
    reward_window: int = 5  # steps in the rolling reward mean
    reward_drop: float = 0.5  # trip when the window mean falls below (1 - drop) x the best one...
    min_best_reward: float = 0.2  # ...once the best window mean reached this (there was a signal to lose)
    lr_factor: float = 0.5  # the lr after a trip, relative to before
    max_trips: int = 3  # more trips than this in one job: give up (the job fails with the reason)


def non_finite(metrics: Mapping[str, float]) -> str | None:
    """A NaN or infinite loss or gradient norm: the update is garbage whatever the data."""
    for key in ("loss", "grad_norm"):
        v = metrics.get(key)
        if v is not None and not math.isfinite(v):
            return f"{key} is {v}"
    return None


def is_blowup(metrics: Mapping[str, float], cfg: GuardConfig) -> str | None:
    """Importance weights out of control: the behaviour policy is too far from the current one
    (AIPO truncates the weight, but a huge max or a collapsed ESS means the batch is off-policy)."""
    m, ess = metrics.get("is/max"), metrics.get("is/ess")
    if m is not None and m > cfg.max_is:
        return f"importance weight max {m:.3g} > {cfg.max_is:g}"
    if ess is not None and ess < cfg.min_ess:
        return f"importance-weight ESS {ess:.3g} < {cfg.min_ess:g}"
    return None


def reward_collapse(rewards: Sequence[float], cfg: GuardConfig) -> str | None:
    """`rewards`: reward/mean per step, oldest first. Trips when the mean of the last
    `reward_window` steps is below (1 - reward_drop) times the best such mean so far, and that best
    reached min_best_reward. Needs at least one full window."""
    w = cfg.reward_window
    if len(rewards) < w:
        return None
    means = [sum(rewards[i : i + w]) / w for i in range(len(rewards) - w + 1)]
    best, now = max(means), means[-1]
    if best >= cfg.min_best_reward and now < (1.0 - cfg.reward_drop) * best:
        return f"reward collapse: mean of the last {w} steps {now:.3f} < {1.0 - cfg.reward_drop:g} x best {best:.3f}"
    return None


def check(metrics: Mapping[str, float], rewards: Sequence[float], cfg: GuardConfig) -> tuple[str, str] | None:
    """(kind, reason) of the first trip — kind in non_finite, is_blowup, reward_collapse — or None.
    `rewards` includes this step's reward/mean."""
    if (r := non_finite(metrics)) is not None:
        return "non_finite", r
    if (r := is_blowup(metrics, cfg)) is not None:
        return "is_blowup", r
    if (r := reward_collapse(rewards, cfg)) is not None:
        return "reward_collapse", r
    return None
