"""Rewards that went bad, as pure rules with hand-computed numbers: the job's reward range (the
reward service's `bounded`, the trainer's own check of a scored sample), the reward error fraction,
the rule that fails a job whose rewards all failed for N steps in a row, and advantages that stay
finite for rewards a float32 group statistic would overflow on. A sink test on real Redis shows a
scored sample outside the range dead-lettered alone, its group settled, nothing trained."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from broker.streams import SCORED, Delivery
from shared.jobspec import JobSpec
from shared.rewards.base import RewardResult, bounded, failed_fraction
from tests.trainer_svc.test_admission import _Job, _scored
from trainer_svc.algorithms import group_mean_advantages, grpo_advantages, rloo_advantages
from trainer_svc.reward_errors import RewardErrorStreak, error_fraction, reward_out_of_range

# --- the range -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reward,components,why",
    [
        (1.0, {}, None),
        (1e6, {}, None),  # the bounds themselves are in
        (-1e6, {"a": -1e6}, None),
        (1e308, {}, "reward 1e+308 is outside the job's range [-1e+06, 1e+06]"),
        (-1000000.5, {}, "reward -1000000.5 is outside"),
        (math.inf, {}, "reward inf is outside"),
        (math.nan, {}, "reward nan is outside"),
        (2.0, {"ok": 1.0, "huge": 1e7}, "reward component 'huge' 10000000.0 is outside"),
    ],
)
def test_a_reward_outside_the_jobs_range_is_that_samples_error(reward, components, why):
    res = RewardResult(reward=reward, components=components)
    out = bounded(res, -1e6, 1e6)
    if why is None:
        assert out is res
    else:
        assert (out.status, out.reward, out.components) == ("error", None, {})
        assert out.reason.startswith(why) and out.reason.endswith("(reward_limits.bounds)")


def test_a_failed_result_passes_the_range_unchanged():
    res = RewardResult(reward=None, status="timeout", reason="over the time budget of 2 s")
    assert bounded(res, 0.0, 1.0) is res


def test_the_spec_bounds_the_range_and_the_error_steps():
    spec = JobSpec(model_path="m")
    assert spec.reward_limits.bounds == (-1e6, 1e6) and spec.reward_limits.fail_after_error_steps == 5
    assert spec.reward_limits.error_steps(100) == 5
    assert JobSpec(model_path="m", steps=3).reward_limits.error_steps(3) == 3  # a shorter job: its last step
    narrow = JobSpec(model_path="m", reward_limits={"bounds": [0, 1], "fail_after_error_steps": 0})
    assert narrow.reward_limits.bounds == (0.0, 1.0) and narrow.reward_limits.error_steps(100) == 0
    for bad, says in (
        ({"bounds": [1, 1]}, "the low bound must be below the high one"),
        ({"bounds": [2, 1]}, "the low bound must be below the high one"),
        ({"bounds": [0, 1e13]}, "less than or equal to 1000000000000"),
        ({"bounds": [0, 1e308]}, "less than or equal to 1000000000000"),
        ({"fail_after_error_steps": -1}, "greater than or equal to 0"),
    ):
        with pytest.raises(ValidationError, match=says):
            JobSpec(model_path="m", reward_limits=bad)


def test_the_trainer_checks_a_scored_rewards_range_itself():
    spec = JobSpec(model_path="m", reward_limits={"bounds": [-1, 1]})
    assert reward_out_of_range(_scored("job1/g0", 0, 0, 1.0), spec) is None
    assert reward_out_of_range(_scored("job1/g0", 0, 0, -1.0), spec) is None
    why = reward_out_of_range(_scored("job1/g0", 0, 0, 1e308), spec)
    assert why == "1e+308 is outside the job's range [-1, 1] (reward_limits.bounds)"


def test_a_scored_sample_outside_the_range_is_dead_lettered_and_its_group_settled(streams):
    """A scored entry that did not come from the reward service (which never publishes a reward
    outside the range) is dead-lettered by the sink alone; its group can no longer complete, so it
    is settled dead (its slot freed), and the other group still makes the batch."""
    job = _Job(streams, JobSpec(model_path="m", prompts_per_step=1, group_size=2, max_staleness=0))
    job.feeder.top_up(0, job.k)
    (g0,) = job.feeder.feed_order()
    job.sink.ledger = _Rows()
    f = job.feeder
    job.sink.add([Delivery("1-0", _scored(g0, 0, 0, 1e308, f)), Delivery("1-1", _scored(g0, 1, 0, 0.0, f))], 0)
    (dead,) = streams.dead_letters()
    assert (dead.code, dead.stream, dead.entry_id) == ("reward_out_of_range", SCORED, "1-0")
    assert dead.reason == "reward: 1e+308 is outside the job's range [-1e+06, 1e+06] (reward_limits.bounds)"
    assert g0 not in job.feeder.in_flight  # settled: its slot is free for the next group
    assert {r["msg_id"]: r["status"] for r in job.sink.ledger.rows} == {f"{g0}/0": "dropped", f"{g0}/1": "dropped"}
    assert "reward_out_of_range: reward: 1e+308 is outside" in job.sink.ledger.rows[0]["drop_reason"]
    job.feeder.top_up(0, job.k)
    (g1,) = job.feeder.feed_order()
    job.arrive(g1, 0)
    b = job.step()
    assert b is not None and [g.group_id for g in b.groups] == [g1]
    assert bool(torch.isfinite(b.data.rewards).all())


class _Rows:
    """The ledger's record_used, recorded."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def record_used(self, items: list[dict]) -> int:
        self.rows += items
        return len(items)


# --- the error fraction and the streak -------------------------------------------------------


def test_the_reward_error_fraction_counts_timeouts_and_errors():
    assert failed_fraction({"ok": 6, "error": 1, "timeout": 1}) == 0.25  # (1 + 1) / 8
    assert failed_fraction({"error": 3}) == 1.0
    assert failed_fraction({"ok": 3}) == 0.0
    assert failed_fraction({}) is None  # nothing scored yet
    assert error_fraction(["ok", "error", "timeout", "ok", "ok"]) == 0.4  # 2 / 5
    assert error_fraction([]) == 0.0


def test_a_job_fails_after_n_steps_in_a_row_of_only_failed_rewards():
    """N = 3: steps 1-2 all error, step 3 has one ok reward (the streak ends), steps 4-6 all fail:
    step 6 is the third in a row, and the reason is the most common failure of steps 4-6 (HTTP 500
    on 5 of the 8 samples, a timeout on 3)."""
    streak = RewardErrorStreak(limit=3)
    http, slow = "http scorer answered HTTP 500", "over the time budget of 2 s"
    assert streak.observe(["error"] * 2, [http] * 2) is None
    assert streak.observe(["error"] * 2, [http] * 2) is None and streak.steps == 2
    assert streak.observe(["error", "ok"], [http, ""]) is None and streak.steps == 0  # one ok: not all failed
    assert streak.observe(["error", "timeout"], [http, slow]) is None
    assert streak.observe(["timeout", "error", "error"], [slow, http, http]) is None and streak.steps == 2
    why = streak.observe(["error", "timeout", "error"], [http, slow, http])
    assert why == (
        "all rewards errored for 3 steps: http scorer answered HTTP 500 (5 of 8 samples; "
        "reward_limits.fail_after_error_steps 3)"
    )


def test_the_streak_limit_of_zero_never_fails_and_an_empty_step_resets():
    off = RewardErrorStreak(limit=0)
    assert all(off.observe(["error"], ["x"]) is None for _ in range(100)) and off.steps == 100
    one = RewardErrorStreak(limit=1)
    assert one.observe([], []) is None and one.steps == 0
    assert one.observe(["error"], [""]) == (
        "all rewards errored for 1 steps: (no reason given) (1 of 1 samples; reward_limits.fail_after_error_steps 1)"
    )
    assert RewardErrorStreak.for_job(JobSpec(model_path="m", steps=2)).limit == 2


# --- advantages at the range's edge ----------------------------------------------------------


def test_advantages_stay_finite_where_float32_group_statistics_overflow():
    """Rewards near float32's largest (3.4e38): a float32 group statistic overflows, so GRPO's
    advantages would be 0 (std inf) or NaN (mean inf), silently. In float64, by hand:
    [3e38, -3e38]: mean 0, std = sqrt((9e76 + 9e76) / (2 - 1)) = 4.243e38, A = +-0.70711;
    [3e38, 3e38, -3e38]: mean 1e38, deviations 2e38, 2e38, -4e38, std = sqrt(24e76 / 2) = 3.4641e38,
    A = 0.57735, 0.57735, -1.1547."""
    two = torch.tensor([[3e38, -3e38]], dtype=torch.float32)
    three = torch.tensor([[3e38, 3e38, -3e38]], dtype=torch.float32)
    assert math.isinf(float(two.std())) and math.isinf(float(three.mean()))  # what float32 alone gives
    a2, a3 = grpo_advantages(two), grpo_advantages(three)
    assert a2.dtype == a3.dtype == torch.float32
    torch.testing.assert_close(a2, torch.tensor([[0.70711, -0.70711]]), rtol=1e-4, atol=0)
    torch.testing.assert_close(a3, torch.tensor([[0.57735, 0.57735, -1.1547]]), rtol=1e-4, atol=0)
    # [1, 0]: mean 0.5, std sqrt(0.5) = 0.7071, A = +-0.5 / (0.7071 + 1e-6) = +-0.70710578 (unchanged)
    torch.testing.assert_close(grpo_advantages(torch.tensor([[1.0, 0.0]])), torch.tensor([[0.70710578, -0.70710578]]))
    # the widest range a job may set, 1e12: group_mean A = r - mean = +-1e12, rloo n/(n-1) x that
    wide = torch.tensor([[1e12, -1e12]], dtype=torch.float32)
    torch.testing.assert_close(group_mean_advantages(wide), torch.tensor([[1e12, -1e12]]))
    torch.testing.assert_close(rloo_advantages(wide), torch.tensor([[2e12, -2e12]]))
    torch.testing.assert_close(grpo_advantages(wide), torch.tensor([[0.70711, -0.70711]]), rtol=1e-4, atol=0)
