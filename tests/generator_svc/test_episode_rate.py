"""`python -m bench episode-rate` at a tiny shape: the figures are there and sane, and episodes played
concurrently beat the same episodes played one after another by a wide margin (each tool call
sleeps 50 ms: one after another, the engine waits out every one of them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

KEYS = (
    "utilisation",
    "episodes_per_s_concurrent",
    "episodes_per_s_sequential",
    "model_tokens_per_s_concurrent",
    "model_tokens_per_s_single_turn",
    "speedup_vs_sequential",
    "engine_busy_fraction",
    "tool_sleep_s",
    "shape",
    "machine",
    "date",
)


@pytest.mark.integration
@pytest.mark.slow
def test_episode_rate_bench_at_a_tiny_shape(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from asyncrl.tiny_model import build_tiny_model
    from bench.episode_rate import bench_episode_rate

    model = build_tiny_model(
        tmp_path / "tiny", layers=1, hidden=64, heads=2, intermediate=128
    )  # vLLM CPU: head_dim >= 32
    r = bench_episode_rate(
        str(tmp_path / "results"),
        groups=2,
        n=8,
        turns=2,
        tokens_per_turn=8,
        reps=1,
        sequential_episodes=2,
        model_dir=str(model),
    )
    assert all(k in r for k in KEYS)
    assert r["shape"] | {"episodes": 16, "turns": 2, "tokens_per_turn": 8} == r["shape"]
    assert r["tool_sleep_s"] == 0.05
    rates = (
        "episodes_per_s_concurrent",
        "episodes_per_s_sequential",
        "model_tokens_per_s_concurrent",
        "model_tokens_per_s_single_turn",
        "model_tokens_per_s_single_turn_same_contexts",
    )
    assert all(r[k] > 0 for k in rates)
    assert 0 < r["engine_busy_fraction"] <= 1 and r["utilisation"] > 0
    # the 16 episodes' turns went to the engine together (one call per turn, but for a straggler
    # on a loaded machine)
    sizes = r["runs"]["concurrent"][0]["sequences_per_call"]
    assert sum(sizes) == 16 * 2 and len(sizes) <= 4, sizes
    assert r["speedup_vs_sequential"] > 3, r["speedup_vs_sequential"]
    on_disk = json.loads((tmp_path / "results" / "episode_rate.json").read_text())
    assert on_disk["utilisation"] == r["utilisation"]
    assert "utilisation" in (tmp_path / "results" / "episode_rate.md").read_text()
