"""Staleness control beyond the fixed bound: an adaptive bound and a staleness-aware step size.

Pure and small; the trainer feeds them one step's metrics and applies what they return.
"""

from __future__ import annotations

from dataclasses import dataclass


def staleness_lr_scale(mean_staleness: float) -> float:
    """Step-size multiplier for a batch whose samples are `mean_staleness` versions old on average.

    Zhang, Gupta, Lian & Liu (IJCAI 2016), "Staleness-aware Async-SGD for Distributed Deep
    Learning": divide the learning rate by the gradient's staleness, eta_i = eta / tau_i. A fresh
    batch (tau <= 1) keeps the base rate, so sync mode and k = 1 pipelining are unchanged.
    """
    return 1.0 / max(1.0, mean_staleness)


@dataclass
class AdaptiveStaleness:
    """A bound k in [k_min, k_max] driven by measured drift between behaviour and current policy.

    Drift is either the normalised effective sample size of the importance weights (`ess`, in
    (0, 1]; 1 = on-policy, lower = the generator's policy has drifted from the trainer's) or the k3
    mismatch KL (`mismatch_kl`, >= 0). One step over the line tightens k by one at once (drift hurts
    the update now); `patience` calm steps in a row loosen it by one (throughput comes back slowly).
    The move is multiplicative-decrease / additive-increase in spirit, like TCP's congestion window.
    """

    k_min: int
    k_max: int
    metric: str = "ess"
    threshold: float = 0.9
    patience: int = 3
    k: int | None = None
    calm: int = 0

    def __post_init__(self) -> None:
        if self.metric not in ("ess", "mismatch_kl"):
            raise ValueError(f"unknown drift metric '{self.metric}'; valid: ['ess', 'mismatch_kl']")
        if not 0 <= self.k_min <= self.k_max:
            raise ValueError(f"need 0 <= k_min <= k_max, got {self.k_min}, {self.k_max}")
        if self.k is None:
            self.k = self.k_max

    def drifted(self, value: float) -> bool:
        return value < self.threshold if self.metric == "ess" else value > self.threshold

    def update(self, metrics: dict[str, float]) -> int:
        """Feed one step's metrics (`is/ess` or `mismatch_kl`); returns the bound for the next step."""
        key = "is/ess" if self.metric == "ess" else "mismatch_kl"
        value = metrics[key]
        assert self.k is not None
        if self.drifted(value):
            self.k = max(self.k_min, self.k - 1)
            self.calm = 0
        else:
            self.calm += 1
            if self.calm >= self.patience:
                self.k = min(self.k_max, self.k + 1)
                self.calm = 0
        return self.k
