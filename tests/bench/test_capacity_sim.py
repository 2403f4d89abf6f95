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
    r = simulate(
        SimConfig(
            generators=100,
            gen_samples_per_s=50,
            batch_samples=16,
            samples_per_step=512,
            step_s=0.0,
            redis_s_per_sample=1e-3,
            steps=10,
        )
    )
    assert 800 < r.samples_per_s <= 1000 * 1.01
    assert r.redis_utilisation > 0.85


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError):
        SimConfig(
            generators=0, gen_samples_per_s=1, batch_samples=1, samples_per_step=1, step_s=0, redis_s_per_sample=0
        )


def test_waiting_generators_poll_redis() -> None:
    # 40 generators offer 2,000/s to a trainer that takes 256/s: most wait on the feeder's bound,
    # each polling at 1 ms of Redis CPU per second; 1 generator is never left waiting for long
    cfg = dict(gen_samples_per_s=50, step_s=0.25, redis_idle_per_consumer=1e-3, **BASE)
    many = simulate(SimConfig(generators=40, **cfg))  # type: ignore[arg-type]
    one = simulate(SimConfig(generators=1, **cfg))  # type: ignore[arg-type]
    assert many.samples_per_s <= 256
    # at most 40 waiting x 1e-3; at least the ~33 generators the trainer cannot use
    assert 0.025 < many.redis_idle_utilisation <= 0.04
    assert one.redis_idle_utilisation < 0.001
