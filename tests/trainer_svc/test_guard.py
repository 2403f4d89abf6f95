"""Collapse guard: hand-computed trips (trainer_svc/guard.py) and the roll-back it triggers."""

import math

import pytest
import torch

from shared.jobspec import GuardSpec
from trainer_svc import checkpoint
from trainer_svc.guard import (
    check,
    is_blowup,
    non_finite,
    reward_collapse,
    trusted_reward,
    trusted_step,
)

CFG = GuardSpec(max_is=10.0, min_ess=0.1, reward_window=2, reward_drop=0.5, min_best_reward=0.2)


def test_non_finite_loss_or_grad_norm():
    assert non_finite({"loss": 0.3, "grad_norm": 1.0}) is None
    assert non_finite({"loss": math.nan, "grad_norm": 1.0}) == "loss is nan"
    assert non_finite({"loss": 0.3, "grad_norm": math.inf}) == "grad_norm is inf"


def test_importance_weight_blowup():
    assert is_blowup({"is/max": 10.0, "is/ess": 0.1}, CFG) is None  # at the limits: fine
    assert "max 12" in is_blowup({"is/max": 12.0, "is/ess": 0.9}, CFG)
    assert "ESS 0.05" in is_blowup({"is/max": 2.0, "is/ess": 0.05}, CFG)


def test_reward_collapse_against_the_best_window():
    # window 2: means of [0.6, 0.8, 0.5, 0.1] are 0.7, 0.65, 0.3; best 0.7, now 0.3 < 0.5 * 0.7 = 0.35
    assert "0.300 < 0.5 x best 0.700" in reward_collapse([0.6, 0.8, 0.5, 0.1], CFG)
    # now 0.4 (0.5, 0.3) >= 0.35: no trip
    assert reward_collapse([0.6, 0.8, 0.5, 0.3], CFG) is None
    # best 0.15 never reached min_best_reward 0.2: nothing to lose, no trip
    assert reward_collapse([0.2, 0.1, 0.0, 0.0], CFG) is None
    assert reward_collapse([0.9], CFG) is None  # no full window yet


def test_trusted_step_is_before_the_collapse():
    # window 2 over steps 5..8: means 0.7 (steps 5, 6), 0.65, 0.3; in the best window the last
    # reward >= 0.7 is step 6's (0.8), which measured the policy trained at step 5: trust up to 5
    assert trusted_step("reward_collapse", [0.6, 0.8, 0.5, 0.1], [5, 6, 7, 8], CFG) == 5
    # a tie keeps the older window: means 0.5, 0.5, 0.3 over steps 1..4 -> window (1, 2), whose
    # last reward >= 0.5 is step 2's -> step 1
    assert trusted_step("reward_collapse", [0.5, 0.5, 0.5, 0.1], [1, 2, 3, 4], CFG) == 1
    # the fall inside the best window: window 3 over steps 1..4, means 0.2133, 0.104; step 3 (0.0)
    # is in the best window but below its mean: the last good step is 2, so trust up to step 1
    w3 = CFG.model_copy(update={"reward_window": 3})
    assert trusted_step("reward_collapse", [0.328, 0.312, 0.0, 0.0], [1, 2, 3, 4], w3) == 1
    # the bad update of a non-finite loss or an IS blow-up is the current step's: no bound
    assert trusted_step("non_finite", [0.6, 0.8, 0.5, 0.1], [5, 6, 7, 8], CFG) is None
    assert trusted_step("is_blowup", [0.6, 0.8, 0.5, 0.1], [5, 6, 7, 8], CFG) is None


def test_trusted_reward_leaves_out_rolled_back_policies():
    # versions 3..5 were rolled back: of rewards 1, 0, 0, 1 (versions 2, 3, 5, 6) count 1 and 1
    assert trusted_reward([1.0, 0.0, 0.0, 1.0], [2, 3, 5, 6], [[3, 5]]) == 1.0
    assert trusted_reward([1.0, 0.0, 0.5], [2, 7, 8], [[3, 5], [7, 7]]) == pytest.approx(0.75)
    assert trusted_reward([0.0, 0.0], [4, 5], [[3, 5]]) is None  # nothing measured the trajectory
    assert trusted_reward([0.2, 0.4], [4, 5], []) == pytest.approx(0.3)


def test_check_reports_the_first_kind():
    ok = {"loss": 0.1, "grad_norm": 1.0, "is/max": 2.0, "is/ess": 0.9}
    assert check(ok, [0.5, 0.5], CFG) is None
    assert check({**ok, "loss": math.nan, "is/max": 99.0}, [0.5], CFG)[0] == "non_finite"
    assert check({**ok, "is/max": 99.0}, [0.6, 0.8, 0.5, 0.1], CFG)[0] == "is_blowup"
    assert check(ok, [0.6, 0.8, 0.5, 0.1], CFG)[0] == "reward_collapse"


def test_roll_back_restores_the_checkpoints_weights_and_optimizer(tmp_path):
    from shared.jobspec import JobSpec
    from trainer_svc.bench import fake_batch
    from trainer_svc.tiny_model import build_tiny_model
    from trainer_svc.train import Learner, flatten_batch

    path = build_tiny_model(tmp_path / "m", layers=1, hidden=32, heads=2, intermediate=64, seed=0)
    spec = JobSpec(model_path=str(path), group_size=4, prompts_per_step=2, sampling={"max_tokens": 4},
                   algorithm={"lr": 1e-2})
    learner = Learner(spec, "cpu")
    samples, rewards = flatten_batch(fake_batch(2, 4, 4, learner.model.config.vocab_size))
    learner.step(samples, rewards)
    final = checkpoint.step_dir(tmp_path, "job", 1)
    checkpoint.save(final, learner.model, learner.tokenizer, learner.optimizer, {"step": 1, "policy_version": 1})
    good = {n: t.clone() for n, t in learner.model.state_dict().items()}
    good_avg = learner.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    learner.step(samples, rewards)  # the "bad" step
    assert not torch.equal(learner.model.state_dict()["lm_head.weight"], good["lm_head.weight"])
    learner.restore(final)
    for n, t in learner.model.state_dict().items():
        assert torch.equal(t, good[n]), n
    assert torch.equal(learner.optimizer.state_dict()["state"][0]["exp_avg"], good_avg)
    assert checkpoint.step_of(final) == 1
    # without a checkpoint: the job's initial model and a fresh optimizer
    learner.restore(None)
    assert learner.optimizer.state_dict()["state"] == {}
    assert learner.step(samples, rewards)["lr"] == pytest.approx(1e-2)  # and it trains on from there
