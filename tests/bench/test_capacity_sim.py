"""The discrete-event simulation's limits against the hand-computed bottleneck (bench/capacity_sim.py)."""

from __future__ import annotations

import pytest

from bench.capacity_sim import SimConfig, simulate

BASE = dict(batch_samples=16, samples_per_step=64, redis_s_per_sample=1e-4, steps=16)


def test_generator_bound() -> None:
    # one generator making 50 samples/s, a trainer that could take 256/s: the generator's rate
    r = simulate(SimConfig(generators=1, gen_samples_per_s=50, step_s=0.25, **BASE))  # type: ignore[arg-type]
    assert r.samples_per_s == pytest.approx(50, rel=0.06)
    # Redis busy = rate x cost per sample (1e-4 s): 0.005
    assert r.redis_utilisation == pytest.approx(50 * 1e-4, rel=0.1)
    assert 0 <= r.staleness_mean <= r.staleness_max <= 2


def test_trainer_bound() -> None:
    # eight generators offer 400/s; the trainer takes 64 per 0.25 s step: at most 256/s
    r = simulate(SimConfig(generators=8, gen_samples_per_s=50, step_s=0.25, **BASE))  # type: ignore[arg-type]
    assert 150 < r.samples_per_s <= 256
    assert r.trainer_busy > 0.6


def test_redis_bound() -> None:
    # 100 generators offer 5,000/s, a trainer that never waits, a shard costing 1 ms/sample: 1,000/s at most
    r = simulate(SimConfig(generators=100, gen_samples_per_s=50, batch_samples=16, samples_per_step=512,
                           step_s=0.0, redis_s_per_sample=1e-3, steps=10))
    assert 800 < r.samples_per_s <= 1000 * 1.01
    assert r.redis_utilisation > 0.85


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError):
        SimConfig(generators=0, gen_samples_per_s=1, batch_samples=1, samples_per_step=1, step_s=0, redis_s_per_sample=0)
