"""Rewards that went bad: a scored sample outside the job's reward range, and a job whose scorer
only fails. Pure rules over the samples of a batch; the sink and the loop apply them.

A scorer that answers 500 for the whole job leaves every sample `reward_status` error with reward
0 under on_failure "zero": the steps train on nothing (group-normalised advantages are 0) while
the job looks healthy and ends `finished`. `RewardErrorStreak` turns that into a failed job once
`reward_limits.fail_after_error_steps` steps in a row had every reward fail, naming the most
common failure. Fail, not pause: a paused job holds the fleet's trainer (and its queue) until
someone looks, and the steps would add nothing once resumed; the checkpoint and the reason stay,
and a fixed scorer is a new submission away.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.jobspec import JobSpec
from shared.rewards.base import FAILED
from shared.schema import Scored

MAX_REASON_SHOWN = 500  # of the most common failure, in the job's error


class RewardsFailed(RuntimeError):
    """Every reward failed for `reward_limits.fail_after_error_steps` steps in a row."""


def reward_out_of_range(s: Scored, spec: JobSpec) -> str | None:
    """Why the trainer must not train on a scored sample's reward (outside the job's
    `reward_limits.bounds`: the reward service never publishes one, so it was not scored by
    it), or None; the sink's rule "reward" (trainer_svc/sink.py `_vet`). A reward of 1e308 would
    be inf as the batch's float32 and every advantage of its group NaN."""
    low, high = spec.reward_limits.bounds
    if not low <= s.reward <= high:
        return f"{s.reward!r} is outside the job's range [{low:g}, {high:g}] (reward_limits.bounds)"
    return None


def error_fraction(statuses: Sequence[str]) -> float:
    """The share of `statuses` (reward statuses of a step's samples) that failed (timeout or
    error); 0.0 for none."""
    return sum(s in FAILED for s in statuses) / len(statuses) if statuses else 0.0


@dataclass
class RewardErrorStreak:
    """Counts the trained steps in a row whose every reward failed.

    Attributes:
        limit: steps in a row that fail the job (`RewardLimitsSpec.error_steps`); 0: never.
        steps: the current streak.
        reasons: the streak's failure reasons, counted.
    """

    limit: int
    steps: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    @classmethod
    def for_job(cls, spec: JobSpec) -> RewardErrorStreak:
        return cls(spec.reward_limits.error_steps(spec.steps))

    def observe(self, statuses: Sequence[str], reasons: Sequence[str]) -> str | None:
        """One trained step: its samples' reward statuses and reasons. Returns why the job is to
        fail once the streak reaches `limit`, else None. A step with one reward that did not
        fail ends the streak."""
        if not statuses or error_fraction(statuses) < 1.0:
            self.steps = 0
            self.reasons.clear()
            return None
        self.steps += 1
        self.reasons.update(reasons)
        if not self.limit or self.steps < self.limit:
            return None
        why, n = self.reasons.most_common(1)[0]
        total = self.reasons.total()
        return (
            f"all rewards errored for {self.steps} steps: {why[:MAX_REASON_SHOWN] or '(no reason given)'} "
            f"({n} of {total} samples; reward_limits.fail_after_error_steps {self.limit})"
        )
