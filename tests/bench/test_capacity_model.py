"""The capacity model against hand-computed values (bench/capacity_model.py)."""

from __future__ import annotations

import pytest

from bench import capacity_model as cm
from bench.capacity import prompt_group, rollout_template
from shared.schema import Scored, encode

W = cm.Workload(prompt_tokens=256, completion_tokens=1024, group_size=8, samples_per_step=1024)


def test_rollout_bytes_by_hand() -> None:
    # 400 + 256 * (4 ids + 4 text) + 1024 * (4 id + 4 logprob + 4 text)
    assert cm.rollout_bytes(W) == 400 + 2048 + 12288 == 14736
    # two rollout copies, the scored extra, 1/8 of a prompt group of 300 + 256 * 8 bytes
    assert cm.redis_bytes_per_sample(W) == pytest.approx(2 * 14736 + 145 + (300 + 2048) / 8)


@pytest.mark.parametrize("tokens", [256, 1024, 4096])
def test_rollout_bytes_match_the_codec(tokens: int) -> None:
    """The size formula holds for the real msgpack encoding of realistic messages."""
    w = cm.Workload(prompt_tokens=256, completion_tokens=tokens)
    r = rollout_template("job-0123456789", 256, tokens)
    assert len(encode(r)) == pytest.approx(cm.rollout_bytes(w), rel=0.03)
    scored = Scored(job_id=r.job_id, msg_id=r.msg_id, group_id=r.group_id, policy_version=0, rollout=r, reward=1.0)
    pg = prompt_group(r.job_id, 0, 256, tokens, 0)
    real = 2 * len(encode(r)) + (len(encode(scored)) - len(encode(r))) + len(encode(pg)) / 8
    assert real == pytest.approx(cm.redis_bytes_per_sample(w), rel=0.03)


def test_trainer_step_time_by_hand() -> None:
    # 8 * 8e9 params * 1024 samples * 1280 tokens / (64 ranks * 989e12 * 0.35)
    t = cm.Trainer(ranks=64, peak_flops=989e12, mfu=0.35, flops_per_token_factor=8)
    assert t.step_s(cm.ModelSize("8B", 8e9), W) == pytest.approx(8.388608e16 / 2.21536e16)
    assert t.step_s(cm.ModelSize("8B", 8e9), W) == pytest.approx(3.78654, rel=1e-5)


def test_load_and_max_generators_by_hand() -> None:
    costs = cm.UnitCosts(
        redis_cpu_s_per_sample_base=1e-4,
        redis_cpu_s_per_sample_per_byte=0.0,
        ledger_s_per_sample=2e-4,
        link_bytes_per_s=1e9,
    )
    ld = cm.load(100.0, W, costs)
    assert ld.redis_msgs_per_s == pytest.approx(212.5)  # (2 + 1/8) XADDs per sample
    assert ld.redis_utilisation == pytest.approx(0.01)
    assert ld.ledger_rows_per_s == 400
    assert ld.ledger_utilisation == pytest.approx(0.02)
    assert ld.redis_bytes_per_s == pytest.approx(100 * cm.redis_bytes_per_sample(W))
    gen = cm.Generator(tokens_per_s=8000)  # 7.8125 samples/s of 1024 tokens
    # 0.7 / 1e-4 = 7000 samples/s per shard -> 896 generators; ledger 0.7 / 2e-4 = 3500 -> 448
    assert cm.max_generators_per_redis(W, costs, gen) == 896
    assert cm.max_generators_per_ledger(W, costs, gen) == 448
    # the network caps it lower: 0.7 * 1e8 B/s / (2 * 29910.5 B) = 1170.2 samples/s -> 149 generators
    assert cm.max_generators_per_redis(W, costs, gen, nic_bytes_per_s=1e8) == 149


def test_generators_to_feed_trainer_by_hand() -> None:
    # 1024 samples per 3.78654 s step = 270.43 samples/s; 7.8125 samples/s each -> 34.6 -> 35
    assert cm.generators_to_feed_trainer(cm.ModelSize("8B", 8e9), W, cm.Generator(8000), cm.Trainer()) == 35


def test_broadcast_star_and_tree_by_hand() -> None:
    m = cm.ModelSize("8B", 8e9)  # 16 GB in bf16
    assert cm.broadcast_s(m, 10, 1e9) == pytest.approx(160.0)  # the trainer's link sends 10 copies
    # fan-out 4 to 10 receivers: two levels; the root sends 4 copies, the second level adds one chunk
    assert cm.broadcast_s(m, 10, 1e9, fanout=4) == pytest.approx(64 + 4 * 64 * 2**20 / 1e9)
    assert cm.broadcast_s(m, 1, 1e9, fanout=4) == pytest.approx(16.0)  # one receiver: one copy
    assert cm.broadcast_s(m, 1000, 1e9, fanout=4) < cm.broadcast_s(m, 10, 1e9)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: cm.Workload(completion_tokens=0),
        lambda: cm.Workload(prompt_tokens=-1),
        lambda: cm.Trainer(mfu=1.5),
        lambda: cm.ModelSize("x", 0),
        lambda: cm.UnitCosts(0.0, 0.0, 1e-4, 1e9),
        lambda: cm.broadcast_s(cm.ModelSize("x", 1e9), 0, 1e9),
        lambda: cm.load(-1.0, W, cm.UnitCosts(1e-4, 0.0, 1e-4, 1e9)),
    ],
)
def test_bad_input_is_refused(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        bad()


def test_idle_consumers_and_ledger_per_token_by_hand() -> None:
    costs = cm.UnitCosts(
        redis_cpu_s_per_sample_base=1e-4,
        redis_cpu_s_per_sample_per_byte=0.0,
        ledger_s_per_sample=1e-4,
        link_bytes_per_s=1e9,
        redis_idle_cpu_per_consumer=2e-3,
        ledger_s_per_completion_token=1e-7,
    )
    # ledger: 1e-4 + 1e-7 * 1024 = 2.024e-4 s per sample
    assert costs.ledger_s(W) == pytest.approx(2.024e-4)
    ld = cm.load(100.0, W, costs, idle_consumers=50)
    assert ld.redis_utilisation == pytest.approx(100 * 1e-4 + 50 * 2e-3)  # 0.01 + 0.1
    assert ld.ledger_utilisation == pytest.approx(100 * 2.024e-4)
    # 0.7 / 2.024e-4 = 3458.5 samples/s; / 7.8125 = 442.7 -> 442 generators
    assert cm.max_generators_per_ledger(W, costs, cm.Generator(8000)) == 442
    with pytest.raises(ValueError):
        cm.load(1.0, W, costs, idle_consumers=-1)
