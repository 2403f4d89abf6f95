"""DAPO's dynamic-sampling filter and soft over-long penalty, on hand-computed values."""

import pytest
import torch

from trainer_svc.shaping import no_signal, overlong_penalty


def test_no_signal_flags_groups_whose_rewards_all_equal():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5 + 1e-12]])
    assert no_signal(rewards).tolist() == [True, False, True, True]


def test_overlong_penalty_ramps_over_the_buffer():
    # max_tokens 10, buffer 4: no penalty up to 6 tokens, then -(len - 6) / 4: 7 -> -0.25, 10 -> -1
    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), max_tokens=10, buffer=4)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0])
    assert overlong_penalty(torch.tensor([10]), 10, 4, max_penalty=0.5).tolist() == [-0.5]
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), 10, 0)
