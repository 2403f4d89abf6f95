"""The staleness bound k: its one owner, its adaptive policy, and a staleness-aware step size.

`StalenessBound.k` is the one place k lives while a job runs, and the bound its only writer: the
spec's starting value (shared/staleness_bound.py), the live knob `max_staleness`, the collapse
guard's tightening, a resume, and the adaptive policy (when the job has one). The rest is pure and
small.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.jobspec import JobSpec
from shared.staleness_bound import start_bound


def staleness_lr_scale(mean_staleness: float) -> float:
    """Step-size multiplier for a batch whose samples are `mean_staleness` versions old on average.

    Zhang, Gupta, Lian & Liu (IJCAI 2016), "Staleness-aware Async-SGD for Distributed Deep
    Learning": divide the learning rate by the gradient's staleness, eta_i = eta / tau_i. A fresh
    batch (tau <= 1) keeps the base rate, so sync mode and k = 1 pipelining are unchanged.
    """
    return 1.0 / max(1.0, mean_staleness)


@dataclass
class AdaptiveStaleness:
    """The policy of a bound k in [k_min, k_max] driven by measured drift between behaviour and
    current policy. It holds only its calm count; k is the caller's (StalenessBound, the one place
    k lives), handed in and returned.

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
    calm: int = 0

    def __post_init__(self) -> None:
        if self.metric not in ("ess", "mismatch_kl"):
            raise ValueError(f"unknown drift metric '{self.metric}'; valid: ['ess', 'mismatch_kl']")
        if not 0 <= self.k_min <= self.k_max:
            raise ValueError(f"need 0 <= k_min <= k_max, got {self.k_min}, {self.k_max}")

    def drifted(self, value: float) -> bool:
        return value < self.threshold if self.metric == "ess" else value > self.threshold

    def update(self, k: int, metrics: dict[str, float]) -> int:
        """The bound for the next step from bound `k` and one step's metrics (`is/ess` or `mismatch_kl`)."""
        key = "is/ess" if self.metric == "ess" else "mismatch_kl"
        if self.drifted(metrics[key]):
            self.calm = 0
            return max(self.k_min, k - 1)
        self.calm += 1
        if self.calm < self.patience:
            return k
        self.calm = 0
        return min(self.k_max, k + 1)


class StalenessBound:
    """The current bound k of one trainer run: samples more than k versions old are dropped, and
    the feeder keeps (k + 1) * prompts_per_step groups in flight.

    `k` is the one place the bound lives. Under adaptive staleness (async jobs with
    `adaptive_staleness`) every write keeps it in the policy's [k_min, k_max] and the policy moves
    it after each step. Sync jobs keep k = 0 whatever is written."""

    def __init__(self, spec: JobSpec):
        self.asynchronous = spec.mode == "async"
        a = spec.adaptive_staleness if self.asynchronous else None
        self.policy = None if a is None else AdaptiveStaleness(a.k_min, a.k_max, a.metric, a.threshold, a.patience)
        self.k = start_bound(spec.mode, spec.max_staleness, None if a is None else a.k_max)

    def set_knob(self, k: int) -> None:
        """The live knob `max_staleness` (async only; clamped to the adaptive range)."""
        p = self.policy
        if self.asynchronous:
            self.k = int(k) if p is None else min(max(int(k), p.k_min), p.k_max)

    def tighten(self) -> None:
        """One version tighter (the collapse guard's answer to blown-up importance weights; async
        only), never below the adaptive k_min nor 0."""
        if self.asynchronous:
            self.k = max(self.policy.k_min if self.policy is not None else 0, self.k - 1)

    def after_step(self, metrics: dict[str, float]) -> None:
        """The adaptive policy's bound for the next step, from this step's drift (no policy: k stays)."""
        if self.policy is not None:
            self.k = self.policy.update(self.k, metrics)

    def state(self) -> dict[str, Any]:
        """`k` and `adaptive` (the controller's k and calm count, or None), the checkpoint's keys."""
        return {"k": self.k, "adaptive": None if self.policy is None else {"k": self.k, "calm": self.policy.calm}}

    def restore(self, state: dict[str, Any]) -> None:
        """The inverse of `state`."""
        self.k = int(state["k"])
        if self.policy is not None and state.get("adaptive") is not None:
            self.policy.calm = int(state["adaptive"]["calm"])
