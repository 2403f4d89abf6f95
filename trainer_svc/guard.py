"""Collapse guard: signs that a step is destroying the policy, as small pure checks.

The loop runs `check` on each step's metrics before it publishes the new weights; a trip makes it
roll back to the last committed checkpoint the guard trusts (`recovery` says what happens when
there is none), lower the lr (and the staleness bound when the importance weights blew up), record
the change in the ledger, and redo the step.
Thresholds: the job spec's `guard` (shared/jobspec.py GuardSpec). No I/O here.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from shared.jobspec import GuardSpec

_NORMAL = statistics.NormalDist()


def non_finite(metrics: Mapping[str, float]) -> str | None:
    """A NaN or infinite loss or gradient norm: the update is garbage whatever the data."""
    for key in ("loss", "grad_norm"):
        v = metrics.get(key)
        if v is not None and not math.isfinite(v):
            return f"{key} is {v}"
    return None


# loss -> (ESS metric, max metric) of the weights that say whether that loss's update is off-policy
# garbage (trainer_svc/algorithms.py). A loss that truncates or clips (AIPO's min(pi/mu, rho),
# PPO's clip, GSPO's clipped sequence ratio) reports the weights it applies: a raw ratio of 148 on
# a token AIPO truncates at rho = 2 changes nothing, while a few tokens carrying the whole update
# (their applied ESS) do. REINFORCE applies no weight at all: the raw ratios are how far each
# token's uncorrected contribution is from the on-policy gradient, so it is read raw.
IS_SIGNALS: dict[str, tuple[str, str]] = {
    "reinforce": ("is/ess", "is/max"),
    "aipo": ("is/applied_ess", "is/applied_max"),
    "ppo_clip": ("is/applied_ess", "is/applied_max"),
    "gspo": ("is/applied_ess", "is/applied_max"),
}


def is_blowup(metrics: Mapping[str, float], cfg: GuardSpec, loss: str) -> str | None:
    """Importance weights out of control for `loss` (a key of IS_SIGNALS): the largest weight the
    loss applies above max_is, or their normalised ESS below min_ess. A metric the step did not
    report (a ledger from before the applied-weight metrics) is not checked.

    Raises:
        ValueError: `loss` is not a known loss.
    """
    if loss not in IS_SIGNALS:
        raise ValueError(f"unknown loss '{loss}'; valid: {sorted(IS_SIGNALS)}")
    ess_key, max_key = IS_SIGNALS[loss]
    applied = "" if loss == "reinforce" else "applied "
    m, ess = metrics.get(max_key), metrics.get(ess_key)
    if m is not None and m > cfg.max_is:
        return f"{applied}importance weight max {m:.3g} > {cfg.max_is:g} ({loss})"
    if ess is not None and ess < cfg.min_ess:
        return f"{applied}importance-weight ESS {ess:.3g} < {cfg.min_ess:g} ({loss})"
    return None


def window_means(rewards: Sequence[float], w: int) -> list[float]:
    """Means of every run of `w` consecutive rewards, oldest first ([] with fewer than w)."""
    return [sum(rewards[i : i + w]) / w for i in range(len(rewards) - w + 1)]


def batch_noise(metrics: Mapping[str, float]) -> float:
    """The sampling noise of this step's reward/mean, reward/std / sqrt(samples) (0 when either is
    missing). A lower bound: samples of one prompt group are correlated, so a batch holds fewer
    independent draws than samples."""
    std, n = metrics.get("reward/std"), metrics.get("samples")
    if std is None or not n or not math.isfinite(std):
        return 0.0
    return std / math.sqrt(n)


def step_noise(rewards: Sequence[float], floor: float = 0.0) -> float:
    """The std of one step's reward/mean around the run's level, from the series itself:
    median |x[t+1] - x[t]| / (sqrt 2 * 0.6745), at least `floor` (`batch_noise`).

    Successive differences cancel a slow trend (a learning run), and for Gaussian noise of std s
    a difference has std s * sqrt 2 and median absolute value 0.6745 * s * sqrt 2. The median (not
    the mean of squares) lets the few big jumps of a collapse leave the estimate alone, and the
    zero differences of a run stuck at 0 pull it down, so a collapse cannot hide in its own noise.
    """
    diffs = [abs(b - a) for a, b in itertools.pairwise(rewards)]
    series = statistics.median(diffs) / (math.sqrt(2.0) * _NORMAL.inv_cdf(0.75)) if diffs else 0.0
    return max(series, floor)


def reward_margin(n_windows: int, w: int, noise: float, false_alarm: float, m: int | None = None) -> float:
    """How far below the best window mean the current one must be before noise is ruled out.

    Derivation: a healthy run at a steady level mu has step rewards mu + e_t, e_t of std `noise`;
    a window mean has standard error s = noise / sqrt(w). A trip on noise alone needs
    best - now > (a + b) s, so the best window above mu + a s or the current one below mu - b s.
    Over n_windows windows, P(the best above mu + a s) <= n_windows * Q(a) (union bound, Q the
    normal upper tail), and the check runs once per window, so P(some current window below
    mu - b s) <= n_windows * Q(b). With a = b = Q^-1(false_alarm / (2 n_windows)) the run trips on
    noise with probability <= false_alarm:

        margin = 2 * Q^-1(false_alarm / (2 * n_windows)) * noise / sqrt(w)

    The margin grows like sqrt(log n_windows): the best window of a long noisy run is biased
    upward by about sqrt(2 ln n) standard errors, which the bare relative drop ignored. E.g. 150
    windows of 5 at false_alarm 0.001: Q^-1(3.3e-6) = 4.5, margin 9.0 s; the issue's healthy run
    (64-sample batches, p ~ 0.15: s ~ 0.02, best 0.219, now 0.106) sits 5.6 s below: no trip.
    The union bound is loose for overlapping windows; the slack pays for the noise estimate's own
    error and for skewed rewards (simulated 8 x 8 batches with prompt difficulty ~ Beta, intra-
    group correlation 1/3, 150-1000 steps: <= 3 % of runs trip at 0.001, against 70-100 % for
    the relative drop alone).

    Against a reference level measured over `m` steps rather than a full window (the run's
    opening, below), the reference's own standard error is noise / sqrt(m):

        margin = Q^-1(false_alarm / (2 * n_windows)) * noise * (1 / sqrt(m) + 1 / sqrt(w))
    """
    z = -_NORMAL.inv_cdf(false_alarm / (2.0 * max(n_windows, 1)))
    return z * noise * (1.0 / math.sqrt(m or w) + 1.0 / math.sqrt(w))


def reference_means(rewards: Sequence[float], w: int) -> list[tuple[float, int, int]]:
    """(mean, steps, first index) of every level the reward held: the run's opening (its first
    1 .. w-1 steps: a policy that collapses within a window never fills one at its old level)
    and every full window of `w` steps, oldest first."""
    opening = [(sum(rewards[:m]) / m, m, 0) for m in range(1, min(w, len(rewards) + 1))]
    return opening + [(mean, w, i) for i, mean in enumerate(window_means(rewards, w))]


def _collapse(rewards: Sequence[float], cfg: GuardSpec, floor: float) -> tuple[float, int, int, float, float] | None:
    """(reference mean, its steps, its first index, now, margin) of the reference level the
    current window fell furthest below beyond its noise margin, or None (reward_collapse)."""
    w = cfg.reward_window
    if len(rewards) < w:
        return None
    now, top = sum(rewards[-w:]) / w, max(rewards[-w:])
    refs = reference_means(rewards, w)
    noise = step_noise(rewards, floor)
    found, excess = None, 0.0
    # full windows first: on a tie the level measured over more steps is the one reported
    for mean, m, start in sorted(refs, key=lambda r: -r[1]):
        line = (1.0 - cfg.reward_drop) * mean
        if mean < cfg.min_best_reward or now >= line:
            continue
        if m < w and top >= line:
            # an opening level is measured over fewer steps than a window, and the median-based
            # noise runs low for skewed rewards: against it every step of the window must have
            # fallen below the line, not only their mean (a collapse, not a dip)
            continue
        margin = reward_margin(len(refs), w, noise, cfg.reward_false_alarm, m)
        if mean - now - margin > excess:
            found, excess = (mean, m, start, now, margin), mean - now - margin
    return found


def reward_collapse(rewards: Sequence[float], cfg: GuardSpec, floor: float = 0.0) -> str | None:
    """`rewards`: reward/mean per step, oldest first; `floor`: this step's `batch_noise`. Trips
    when the mean of the last `reward_window` steps is below (1 - reward_drop) times a level the
    reward held before (`reference_means`: the best window, or the run's opening when the fall
    came before a window filled: then every step of the window must be below that line), that
    level having reached min_best_reward, and more than `reward_margin` below it (the noise of
    the series, `step_noise`). Needs one full window."""
    hit = _collapse(rewards, cfg, floor)
    if hit is None:
        return None
    mean, m, _start, now, margin = hit
    w = cfg.reward_window
    level = f"best {mean:.3f}" if m == w else f"the first {m} step(s)' {mean:.3f}"
    return (
        f"reward collapse: mean of the last {w} steps {now:.3f} < {1.0 - cfg.reward_drop:g} x {level}, "
        f"{mean - now:.3f} below it (noise margin {margin:.3f})"
    )


def trusted_step(kind: str, rewards: Sequence[float], steps: Sequence[int], cfg: GuardSpec) -> int | None:
    """The newest step whose policy is still trusted after a trip of `kind`; `rewards` as for
    `check`, `steps[i]` the step of `rewards[i]`. None: no bound (non_finite, is_blowup: the bad
    update is this step's own, every earlier one stands). reward_collapse: the policy decayed over
    several steps, so the newest checkpoint may hold a collapsed one, and so may the reference
    level's last step (a mean hides a fall inside it). Trust the policy measured by the last step,
    up to the end of the level the reward fell from (`_collapse`; else the best window), whose
    reward reached that level: the one trained the step before it. 0: only the initial model."""
    w = cfg.reward_window
    if kind != "reward_collapse" or len(rewards) < w:
        return None
    hit = _collapse(rewards, cfg, 0.0)
    if hit is not None:
        level, end = hit[0], hit[2] + hit[1]
    else:
        means = window_means(rewards, w)
        best = means.index(max(means))
        level, end = means[best], best + w
    last_good = max(i for i in range(end) if rewards[i] >= level)
    return steps[last_good] - 1


@dataclass(frozen=True)
class Recovery:
    """What a trip does to the policy (`recovery`)."""

    # checkpoint: restore `step`'s checkpoint; initial: the job's initial model (`step` 0);
    # keep: the current weights stand (the step is not redone); fail: the job fails
    action: Literal["checkpoint", "initial", "keep", "fail"]
    step: int | None  # the step the trajectory goes on from (None: keep, fail)
    note: str  # what happened, for the change record and the log


def recovery(kind: str, checkpoints: Sequence[int], bound: int | None, cfg: GuardSpec) -> Recovery:
    """Where a trip of `kind` sends the policy: the newest of this trajectory's `checkpoints`
    (steps) at or before `bound` (`trusted_step`; None: any); a bound of 0 trusts the initial
    model only, which is then where the job restarts from (unless `fail`). With none,
    `cfg.on_no_checkpoint`:
    `initial` restarts from the initial model; `fail` fails the job; `lower_lr` keeps the current
    weights and goes on with the lower lr, except after a non-finite update, which has already
    written non-finite values into the weights: nothing usable to keep, so the job fails."""
    usable = [c for c in checkpoints if bound is None or c <= bound]
    if usable:
        return Recovery("checkpoint", max(usable), f"rolled back to the checkpoint of step {max(usable)}")
    if bound == 0 and cfg.on_no_checkpoint != "fail":
        # the reward fell from the job's first steps: the initial model is the one trusted policy
        return Recovery(
            "initial",
            0,
            "the reward fell from the job's first steps, so the only policy trusted is "
            "the initial model: restarted from it (guard.on_no_checkpoint 'fail' fails instead)",
        )
    if checkpoints:
        why = f"no checkpoint from before the collapse (the trusted policy is step {bound}'s)"
    else:
        why = "no checkpoint to go back to (checkpoint_every sets them)"
    policy = cfg.on_no_checkpoint
    if policy == "initial":
        return Recovery("initial", 0, f"{why}: restarted from the initial model (guard.on_no_checkpoint 'initial')")
    if policy == "fail":
        return Recovery("fail", None, f"{why}, and guard.on_no_checkpoint is 'fail'")
    if kind == "non_finite":
        return Recovery(
            "fail",
            None,
            f"{why}, and a non-finite update left no usable weights to keep "
            "(guard.on_no_checkpoint 'initial' restarts from the initial model instead)",
        )
    return Recovery(
        "keep", None, f"{why}: kept the current policy and lowered the lr (guard.on_no_checkpoint 'lower_lr')"
    )


def trusted_reward(
    rewards: Sequence[float], versions: Sequence[int], discarded: Sequence[Sequence[int]]
) -> float | None:
    """The mean reward of a batch over the samples generated by policies the guard has not rolled
    back (`versions[i]` generated `rewards[i]`; `discarded`: [lo, hi] version ranges); None when no
    sample qualifies: such a batch says nothing about the current trajectory (right after a
    roll-back, what is in flight came from the discarded policies)."""
    kept = [r for r, v in zip(rewards, versions, strict=True) if not rolled_back(v, discarded)]
    return sum(kept) / len(kept) if kept else None


def rolled_back(version: int, discarded: Sequence[Sequence[int]]) -> bool:
    """Whether a roll-back discarded policy `version` (`discarded`: [lo, hi] version ranges)."""
    return any(lo <= version <= hi for lo, hi in discarded)


def check(metrics: Mapping[str, float], rewards: Sequence[float], cfg: GuardSpec, loss: str) -> tuple[str, str] | None:
    """(kind, reason) of the first trip — kind in non_finite, is_blowup, reward_collapse — or None.
    `rewards` includes this step's reward/mean; `loss` is the job's loss (algorithm.loss)."""
    if (r := non_finite(metrics)) is not None:
        return "non_finite", r
    if (r := is_blowup(metrics, cfg, loss)) is not None:
        return "is_blowup", r
    if (r := reward_collapse(rewards, cfg, batch_noise(metrics))) is not None:
        return "reward_collapse", r
    return None


@dataclass(frozen=True)
class RollBack:
    """What a trip does (`CollapseGuard.trip`): the recovery, and from which step on the
    trajectory goes (`back_to`; the current step when the policy is kept)."""

    kind: str
    reason: str
    step: int  # the step that tripped
    plan: Recovery
    back_to: int

    @property
    def redo(self) -> bool:
        """Whether the step is to be redone (False: the current policy was kept, its update stands)."""
        return self.plan.step is not None

    def change(self) -> dict[str, object]:
        """The ledger's change record of the trip, before the loop adds what it lowered."""
        return {
            "reason": self.reason,
            "kind": self.kind,
            "step": self.step,
            "action": self.plan.action,
            "note": self.plan.note,
        }


class CollapseGuard:
    """The collapse guard of one trajectory: its trips so far, the [step, reward] series and the
    checkpoints of the current trajectory, and the [lo, hi] policy versions roll-backs discarded.

    `inspect` runs the checks (`check`) on a step before anyone sees its update; `trip` turns a
    trip into a `RollBack` and moves this state to the trajectory it goes on from. The pure
    functions above do the judging."""

    def __init__(self, cfg: GuardSpec, loss: str):
        self.cfg, self.loss = cfg, loss
        self.trips = 0
        self.rewards: list[list[float]] = []
        self.checkpoints: list[int] = []
        self.discarded: list[list[int]] = []
        self.measured: float | None = None  # the step being inspected: its trusted reward
        self.window: list[float] = []

    def gone(self, versions: set[int]) -> list[int]:
        """Those of `versions` a roll-back discarded."""
        return [v for v in versions if rolled_back(v, self.discarded)]

    def inspect(
        self,
        metrics: Mapping[str, float],
        rewards: Sequence[float],
        versions: Sequence[int],
        retry: bool = False,
        redo: bool = False,
    ) -> tuple[str, str] | None:
        """(kind, reason) of a trip of this step, or None. `rewards`, `versions`: each sample's
        reward and the policy that generated it (the series counts only samples of policies on
        the current trajectory). `retry`: the redo of a rolled-back step, on the same samples now
        even further off-policy (AIPO truncates their weights): only a garbage update trips it
        again. `redo`: a resume's re-done step, which stood once already: never trips."""
        self.measured = trusted_reward(rewards, versions, self.discarded)
        self.window = [] if self.measured is None else [r for _, r in self.rewards] + [self.measured]
        if retry:
            return None if (bad := non_finite(metrics)) is None else ("non_finite", bad)
        if redo or not self.cfg.enabled:
            return None
        return check(metrics, self.window, self.cfg, self.loss)

    def trip(self, kind: str, reason: str, step: int, version: int) -> RollBack:
        """A trip at `step` (the one just trained, from policy `version`): back to the newest
        checkpoint of this trajectory the guard still trusts (`trusted_step`), or with none what
        guard.on_no_checkpoint says (`recovery`). The series, checkpoints and discarded versions
        follow the trajectory from `back_to` on, unless the plan is `fail`.

        Raises:
            RuntimeError: the guard tripped more than max_trips times.
        """
        self.trips += 1
        if self.trips > self.cfg.max_trips:
            raise RuntimeError(f"collapse guard tripped {self.trips} times (last at step {step}: {reason}); giving up")
        bound = trusted_step(kind, self.window, [int(s) for s, _ in self.rewards] + [step], self.cfg)
        plan = recovery(kind, self.checkpoints, bound, self.cfg)
        back_to = step - 1 if plan.step is None else plan.step  # kept: the trajectory goes on from here
        out = RollBack(kind, reason, step, plan, back_to)
        if plan.action == "fail":
            return out
        # the trajectory goes on from back_to: later checkpoints, rewards and versions are not its own
        self.checkpoints = [c for c in self.checkpoints if c <= back_to]
        self.rewards = [x for x in self.rewards if x[0] <= back_to]
        if plan.step is None and kind == "reward_collapse":  # the kept policy's reward is measured afresh
            self.rewards = []
        if step - 1 > back_to:  # one version per step: back_to's weights are version - (step - 1 - back_to)
            self.discarded = [*self.discarded, [version - (step - 1 - back_to) + 1, version]]
        return out

    def stood(self, step: int) -> None:
        """`step`'s update stands: its trusted reward joins the series."""
        if self.measured is not None:
            self.rewards.append([step, self.measured])

    def checkpointed(self, step: int) -> None:
        """A checkpoint of `step` on this trajectory."""
        self.checkpoints = [*(c for c in self.checkpoints if c != step), step]

    def state(self) -> dict[str, object]:
        """The checkpoint's `guard` entry: rewards, trips, checkpoints, discarded."""
        return {
            "rewards": self.rewards,
            "trips": self.trips,
            "checkpoints": self.checkpoints,
            "discarded": self.discarded,
        }

    def restore(self, state: Mapping[str, Sequence]) -> None:
        """The inverse of `state`."""
        self.rewards = [list(x) for x in state["rewards"]]
        self.trips = int(state["trips"])  # type: ignore[call-overload]
        self.checkpoints = [int(c) for c in state["checkpoints"]]
        self.discarded = [[int(lo), int(hi)] for lo, hi in state["discarded"]]
