"""bench/ecosystem_gym.py without running it: its job specs validate as a user's would (the reward
left to the dataset), and the held-out before/after it reports are the first and last rounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.ecosystem_gym import DATASETS, gym_spec, held_out
from shared.jobspec import JobSpec

pytest.importorskip("reasoning_gym")


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_each_bench_spec_is_a_valid_job_scored_by_the_dataset(dataset: str) -> None:
    spec = JobSpec.model_validate(gym_spec(Path("/m"), dataset, seed=0, steps=60, eval_every=20))
    assert spec.task.name == "reasoning_gym" and spec.task.dataset == dataset
    assert spec.reward == "reasoning_gym"


def test_held_out_before_and_after_are_the_first_and_last_held_out_rounds() -> None:
    evals = [
        {"name": "held_out", "step": 40, "reward_mean": 0.5},
        {"name": "held_out", "step": 0, "reward_mean": 0.25},
        {"name": "other", "step": 60, "reward_mean": 1.0},
        {"name": "held_out", "step": 60, "reward_mean": 0.75},
    ]
    assert held_out(evals) == (0.25, 0.75, 60)
    assert held_out([]) == (None, None, None)
