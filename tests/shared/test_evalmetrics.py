"""pass@k, maj@n and mean@n against hand-computed values."""

import math

import pytest

from shared.evalmetrics import answer_key, episode_means, majority_correct, pass_at_k, round_metrics


def test_pass_at_k_hand_computed():
    # n = 5 samples, c = 2 correct, k = 2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # k = 1 is the fraction correct: 1 - C(3,1)/C(5,1) = 1 - 3/5
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    # n - c < k: every draw of 4 from 5 holds one of the 2 correct ones
    assert pass_at_k(5, 2, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(8, 3, 3) == pytest.approx(1 - math.comb(5, 3) / math.comb(8, 3))  # 1 - 10/56
    for bad in ((5, 6, 1), (5, 2, 0), (5, 2, 6)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_majority_vote_on_final_answers():
    # "= 7" and "7" share the final number: 2 votes for 7 (wrong), 1 for 8 (right)
    assert answer_key("x = 7") == answer_key("7") == "7"
    assert majority_correct(["x = 7", "7", "8"], [0.0, 0.0, 1.0], 1.0) == 0.0
    assert majority_correct(["8", "7", "8"], [1.0, 0.0, 1.0], 1.0) == 1.0
    assert majority_correct(["8", "7"], [1.0, 0.0], 1.0) == 1.0  # a tie goes to the first seen


def test_round_metrics_average_over_problems():
    # problem A: 1 of 2 correct, problem B: 2 of 2 correct
    problems = [(["1", "2"], [1.0, 0.0]), (["3", "3"], [1.0, 1.0])]
    m = round_metrics(problems, [1, 2], threshold=1.0)
    assert m == pytest.approx({"mean@2": 0.75, "pass@1": 0.75, "pass@2": 1.0, "maj@2": 1.0})
    # a greedy round: mean@1 only (pass@1 equals it for 0/1 rewards)
    assert round_metrics([(["1"], [1.0]), (["2"], [0.0])], [1], 1.0) == {"mean@1": 0.5, "pass@1": 0.5}
    with pytest.raises(ValueError, match="same number of samples"):
        round_metrics([(["1"], [1.0]), (["1", "2"], [1.0, 0.0])], [1], 1.0)


def test_episode_means_average_each_key_over_the_samples_that_carry_it():
    got = episode_means([{"ok": 1.0, "reward": 2.0}, {"ok": 0.0}, {}, {"ok": 0.5}])
    assert got == {"env/ok": pytest.approx(0.5), "env/reward": 2.0}  # ok: (1 + 0 + 0.5) / 3
    assert episode_means([{}, {}]) == {}  # single-turn samples: nothing
