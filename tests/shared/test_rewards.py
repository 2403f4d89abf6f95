"""Reward functions by name: exact match on the final number, math equivalence via math-verify."""

import typing

import pytest

from shared.jobspec import REWARDS, JobSpec
from shared.rewards import REWARD_FUNCTIONS, exact_match, get_reward_fn, math_verify


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("42", "42", 1.0),
        ("= 42", "42", 1.0),
        ("the sum is 40 then 42", "42", 1.0),  # the last number counts
        ("42 then 40", "42", 0.0),
        ("-7", "-7", 1.0),
        ("1,234", "1234", 1.0),
        ("42.0", "42", 1.0),
        ("", "42", 0.0),
        ("no number", "42", 0.0),
        ("4", "42", 0.0),
    ],
)
def test_exact_match(completion, answer, expected):
    assert exact_match(completion, answer) == expected


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
        ("The answer is 42", "42", 1.0),
        ("so x = 3/4", "0.75", 1.0),
        ("The answer is 41", "42", 0.0),
        ("", "42", 0.0),
    ],
)
def test_math_verify(completion, answer, expected):
    assert math_verify(completion, answer) == expected


def test_reward_registry_by_name():
    assert get_reward_fn("exact_match") is exact_match
    assert set(REWARD_FUNCTIONS) == {"exact_match", "math_verify", "python_exec"}
    with pytest.raises(
        ValueError, match="unknown reward function 'f1'; valid: \\['exact_match', 'math_verify', 'python_exec'\\]"
    ):
        get_reward_fn("f1")


def test_job_spec_names_every_reward_function():
    # The spec's Literal is what the API validates; the registry is what the services run.
    assert set(typing.get_args(JobSpec.model_fields["reward"].annotation)) == set(REWARD_FUNCTIONS)
    assert set(REWARDS) == set(REWARD_FUNCTIONS)
