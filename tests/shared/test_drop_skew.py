"""What dropping skews (shared/drop_skew.py), with hand-computed numbers: the five-number
description, the relative shift (its scale when the trained mean is near 0, its cap at a zero
scale), a step's metrics by side, the job's count-weighted summary, the warning's threshold and its
minimum count, and the trainer's watch that warns once per crossing."""

from __future__ import annotations

import pytest

from shared.drop_skew import (
    SHIFT_CAP,
    Dist,
    JobTally,
    SkewWatch,
    describe,
    shift,
    step_metrics,
    summarize_job,
    warnings,
)
from shared.jobspec import JobSpec


def test_describe_gives_mean_and_interpolated_quantiles():
    # [1..5]: p10 at position 0.1 * 4 = 0.4 -> 1 + 0.4 = 1.4; p90 at 3.6 -> 4 + 0.6 = 4.6
    assert describe([5, 1, 4, 2, 3]) == Dist(5, 3.0, 1.4, 3.0, 4.6)
    assert describe([7]) == Dist(1, 7.0, 7.0, 7.0, 7.0)
    assert describe([]) is None


def test_shift_is_relative_to_the_trained_scale():
    trained = describe([1, 2, 3, 4, 5])  # mean 3, p10..p90 spread 4.6 - 1.4 = 3.2: scale 3.2
    dropped = describe([4, 4, 16])  # mean 8; p10 4 (position 0.2), p50 4, p90 4 + 0.8 * 12 = 13.6
    assert trained is not None and dropped is not None
    s = shift(dropped, trained)
    assert s.mean == pytest.approx((8 - 3) / 3.2)  # 1.5625
    # quantile differences 2.6, 1.0, 9.0: mean 4.2; the outlier 16 moves the mean more than the median
    assert s.quantile == pytest.approx(4.2 / 3.2)  # 1.3125
    assert shift(trained, trained).mean == 0.0


def test_a_trained_mean_near_zero_does_not_inflate_the_shift():
    trained = describe([-1.0, 1.0, -1.0, 1.0])  # mean 0, p10 -1, p90 1: scale 2 (not 0)
    dropped = describe([1.0, 1.0])
    assert trained is not None and dropped is not None
    assert shift(dropped, trained).mean == pytest.approx(0.5)  # (1 - 0) / 2


def test_a_difference_over_a_zero_scale_is_the_cap():
    zero = describe([0.0, 0.0])
    assert zero is not None
    assert shift(describe([1.0]), zero).mean == SHIFT_CAP  # type: ignore[arg-type]
    assert shift(describe([-3.0]), zero).quantile == -SHIFT_CAP  # type: ignore[arg-type]
    assert shift(zero, zero).mean == 0.0
    assert shift(describe([1e9]), describe([1.0])).mean == SHIFT_CAP  # type: ignore[arg-type]


def test_step_metrics_by_side():
    m = step_metrics(
        [(2, 1.0), (4, 0.0)],
        {"overlong": [(8, 0.0)], "reward_failure": [(6, None)]},  # a failed reward has no reward
    )
    # trained: lengths [2, 4] -> mean 3, p10 2.2, p90 3.8; rewards [0, 1] -> mean 0.5, p10 0.1, p90 0.9
    assert m["drop_skew/trained/count"] == 2 and m["drop_skew/trained/rewarded"] == 2
    assert [m[f"drop_skew/trained/length_{s}"] for s in ("mean", "p10", "p50", "p90")] == pytest.approx(
        [3, 2.2, 3, 3.8]
    )
    assert [m[f"drop_skew/trained/reward_{s}"] for s in ("mean", "p10", "p50", "p90")] == pytest.approx(
        [0.5, 0.1, 0.5, 0.9]
    )
    # dropped, every reason: lengths [8, 6] -> mean 7, p10 6.2, p90 7.8; one reward, 0
    assert m["drop_skew/dropped/count"] == 2 and m["drop_skew/dropped/rewarded"] == 1
    assert m["drop_skew/dropped/length_p10"] == pytest.approx(6.2)
    assert m["drop_skew/dropped/reward_mean"] == 0.0
    assert m["drop_skew/overlong/count"] == 1 and m["drop_skew/overlong/length_mean"] == 8
    assert m["drop_skew/reward_failure/count"] == 1 and "drop_skew/reward_failure/reward_mean" not in m
    assert "drop_skew/stale/count" not in m  # a reason that dropped nothing is absent
    # length: scale max(3, 3.8 - 2.2) = 3; every difference 4 -> 4/3
    assert m["drop_skew/length_shift"] == pytest.approx(4 / 3)
    assert m["drop_skew/length_quantile_shift"] == pytest.approx(4 / 3)
    # reward: scale max(0.5, 0.8) = 0.8; mean difference -0.5 -> -0.625; quantiles -0.1, -0.5, -0.9 -> -0.625
    assert m["drop_skew/reward_shift"] == pytest.approx(-0.625)
    assert m["drop_skew/reward_quantile_shift"] == pytest.approx(-0.625)


def test_a_step_that_drops_nothing_has_counts_and_no_shift():
    m = step_metrics([(3, 1.0)], {})
    assert m["drop_skew/dropped/count"] == 0 and m["drop_skew/trained/count"] == 1
    assert not any(k.endswith("_shift") or k.startswith("drop_skew/dropped/length") for k in m)


def test_no_metric_name_is_a_prefix_of_another():
    """MLflow's file store makes each metric a file: `x` and `x/y` cannot both be metrics."""
    keys = step_metrics(
        [(2, 1.0)], {r: [(3, 0.5)] for r in ("stale", "rolled_back", "dynamic_sampling", "overlong", "other")}
    )
    assert not [(a, b) for a in keys for b in keys if b.startswith(a + "/")]


def test_unknown_reason_is_refused():
    with pytest.raises(ValueError, match="unknown drop reasons \\['slow'\\]"):
        step_metrics([], {"slow": [(1, 1.0)]})


def test_the_job_summary_weights_steps_by_their_counts():
    one = step_metrics([(2, 1.0), (4, 1.0)], {"stale": [(10, 0.0)]})
    two = step_metrics([(8, 0.0)] * 6, {"stale": [(20, 1.0)] * 3})
    skew = summarize_job([one, None, {"loss": 1.0}, two])  # steps without these metrics count for nothing
    trained, dropped = skew.sides["trained"], skew.sides["dropped"]
    assert (trained.count, dropped.count) == (8, 4)
    assert trained.length is not None and dropped.length is not None and dropped.reward is not None
    assert trained.length.mean == pytest.approx((2 + 4 + 6 * 8) / 8)  # exact: 6.75
    # a quantile is the count-weighted mean of the steps': p10 of step one 2.2, of step two 8
    assert trained.length.p10 == pytest.approx((2 * 2.2 + 6 * 8) / 8)
    assert dropped.length.mean == pytest.approx((10 + 3 * 20) / 4)  # 17.5
    assert dropped.reward.mean == pytest.approx(0.75)
    assert set(skew.sides) == {"trained", "dropped", "stale"}
    s = skew.shifts["length"]
    assert s is not None
    # scale: max(6.75, p90 - p10 = 6.95 - 6.55 = 0.4) = 6.75
    assert s.mean == pytest.approx((17.5 - 6.75) / 6.75)


def test_rewards_weigh_by_the_samples_that_had_one():
    one = step_metrics([(1, 1.0)], {"reward_failure": [(5, None)] * 9, "stale": [(5, 0.0)]})
    two = step_metrics([(1, 1.0)], {"stale": [(5, 1.0)] * 3})
    dropped = summarize_job([one, two]).sides["dropped"]
    assert dropped.count == 13 and dropped.reward is not None
    assert dropped.reward.n == 4 and dropped.reward.mean == pytest.approx(0.75)  # (0 + 3) / 4, not / 13


def _tally(n_dropped: int, dropped_len: int, trained_len: int = 10) -> JobTally:
    t = JobTally()
    t.add(step_metrics([(trained_len, 1.0)] * 100, {"overlong": [(dropped_len, 1.0)] * n_dropped}))
    return t


def test_warns_past_the_shift_with_enough_dropped_samples():
    skew = _tally(64, 13).summary()  # length shift (13 - 10) / 10 = 0.3; rewards equal
    (w,) = warnings(skew, max_shift=0.2, min_dropped=64)
    assert w.startswith("dropping biases completion length: the 64 dropped samples average 13 tokens, the 100 ")
    assert "shift +0.30" in w and "drop_skew.max_shift 0.2" in w and "dropped: overlong 64" in w
    assert warnings(skew, max_shift=0.3, min_dropped=64) == []  # at the threshold: no warning
    assert warnings(_tally(63, 13).summary(), max_shift=0.2, min_dropped=64) == []  # too few: noise
    assert warnings(_tally(64, 11).summary(), max_shift=0.2, min_dropped=64) == []  # 0.1: within


def test_the_spec_defaults():
    d = JobSpec(model_path="/m").drop_skew
    assert (d.max_shift, d.min_dropped) == (0.2, 64)


def test_the_watch_warns_once_per_crossing():
    watch = SkewWatch(max_shift=0.2, min_dropped=4)
    assert watch.observe(step_metrics([(10, 1.0)] * 4, {"stale": [(20, 1.0)] * 2})) == []  # 2 dropped: too few
    (first,) = watch.observe(step_metrics([(10, 1.0)] * 4, {"stale": [(20, 1.0)] * 2}))
    assert first.startswith("dropping biases completion length: the 4 dropped")
    assert watch.observe(step_metrics([(10, 1.0)] * 4, {"stale": [(20, 1.0)]})) == []  # still holds: said already
    # four short dropped ones bring the dropped mean to 104 / 9 = 11.6: shift 0.16, within
    assert watch.observe(step_metrics([(10, 1.0)] * 4, {"stale": [(1, 1.0)] * 4})) == []
    assert watch.warned == set()
    assert len(watch.observe(step_metrics([(10, 1.0)], {"stale": [(40, 1.0)] * 40}))) == 1  # crossed again
