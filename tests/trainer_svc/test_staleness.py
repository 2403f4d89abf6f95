"""The adaptive staleness bound and the staleness-aware step size."""

import pytest
import torch

from trainer_svc.algorithms import is_fresh
from trainer_svc.batch import TrainBatch
from trainer_svc.staleness import AdaptiveStaleness, staleness_lr_scale


def test_staleness_lr_scale_follows_zhang_et_al():
    assert staleness_lr_scale(0.0) == 1.0  # fresh batches keep the base rate
    assert staleness_lr_scale(1.0) == 1.0
    assert staleness_lr_scale(2.0) == 0.5
    assert staleness_lr_scale(4.0) == 0.25


def test_drop_boundary_exactly_k_kept_k_plus_one_dropped():
    for k in range(5):
        assert is_fresh(10, 10 - k, k)
        assert not is_fresh(10, 10 - k - 1, k)


def _ess(weights: torch.Tensor) -> float:
    return float(weights.sum() ** 2 / (weights.numel() * (weights**2).sum()))


def _bounds(ctl: AdaptiveStaleness, k: int, steps: list[dict[str, float]]) -> list[int]:
    """The bound after each step, as StalenessBound.after_step moves it from `k`."""
    ks = []
    for metrics in steps:
        k = ctl.update(k, metrics)
        ks.append(k)
    return ks


def test_adaptive_bound_tightens_when_drift_is_injected_and_recovers():
    ctl = AdaptiveStaleness(k_min=0, k_max=4, metric="ess", threshold=0.9, patience=2)
    torch.manual_seed(0)
    calm = torch.exp(torch.randn(512) * 0.05)  # pi ~ mu: importance weights near 1, ESS ~ 0.998
    drift = torch.exp(torch.randn(512) * 1.0)  # injected drift: log-ratios with std 1, ESS ~ 0.37
    assert _ess(calm) > 0.99 and _ess(drift) < 0.5
    ks = _bounds(ctl, 4, [{"is/ess": _ess(calm)}] * 3)
    assert ks == [4, 4, 4]  # already at k_max: calm steps keep it there
    ks += _bounds(ctl, ks[-1], [{"is/ess": _ess(drift)}] * 6)
    assert ks[3:] == [3, 2, 1, 0, 0, 0]  # one version tighter per drifting step, floored at k_min
    ks += _bounds(ctl, ks[-1], [{"is/ess": _ess(calm)}] * 6)
    assert ks[9:] == [0, 1, 1, 2, 2, 3]  # loosens by one every `patience` calm steps


def test_adaptive_bound_on_mismatch_kl():
    ctl = AdaptiveStaleness(k_min=1, k_max=3, metric="mismatch_kl", threshold=0.05, patience=1)
    # floor, then ceiling
    assert _bounds(ctl, 3, [{"mismatch_kl": x} for x in (0.2, 0.3, 0.3, 0.01, 0.01, 0.01)]) == [2, 1, 1, 2, 3, 3]


def test_adaptive_bound_rejects_bad_configuration():
    with pytest.raises(ValueError, match="valid: \\['ess', 'mismatch_kl'\\]"):
        AdaptiveStaleness(0, 2, metric="entropy")
    with pytest.raises(ValueError, match="k_min <= k_max"):
        AdaptiveStaleness(3, 2)


def test_learner_applies_the_staleness_lr_scale(tmp_path):
    from asyncrl.tiny_model import build_tiny_model
    from bench.t_train import fake_batch
    from shared.jobspec import JobSpec
    from trainer_svc.learner import Learner
    from trainer_svc.sink import flatten_batch

    path = build_tiny_model(tmp_path / "m", layers=1, hidden=32, heads=2, intermediate=64, seed=0)
    spec = JobSpec(
        model_path=str(path),
        group_size=4,
        prompts_per_step=2,
        sampling={"max_tokens": 4},
        algorithm={"lr": 1e-3, "staleness_lr": True},
    )
    learner = Learner(spec, "cpu")
    samples, rewards = flatten_batch(fake_batch(2, 4, 4, learner.model.config.vocab_size))
    metrics = learner.step(TrainBatch.of(samples, rewards), lr_scale=staleness_lr_scale(2.0))
    assert metrics["lr"] == pytest.approx(5e-4)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert learner.step(TrainBatch.of(samples, rewards), lr_scale=1.0)["lr"] == pytest.approx(1e-3)
