"""The performance suite (bench.suite): its small pure parts, and the `ci` preset end to end.

The end-to-end test checks that the result file is complete (every section, numbers where numbers
belong), never the values: those depend on the machine. It creates the TRL environment under
runs/bench/trl-venv on first use (torch from the local wheel, about 150 MB of other downloads,
2-3 minutes) and reuses it afterwards; the TRL parts are required whenever that environment
could be created.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from bench import suite as bench_suite
from bench.peers import trl_grpo
from shared.rewards import exact_match

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "completion, answer",
    [("42", "42"), ("41", "42"), ("= 42", "42"), ("4 2", "42"), ("-7", "-7"), ("3-7", "-4"), ("1,234", "1234"),
     ("3.50", "3.5"), ("42.0", "42"), ("-0", "0"), ("", "1"), ("no idea", "1"), ("12</s>", "12"), ("x12y", "12")],
)
def test_peer_reward_rule_matches_ours(completion: str, answer: str) -> None:
    # The TRL script restates our exact-match rule (it cannot import the project): same verdicts.
    assert trl_grpo.exact_match(completion, answer) == exact_match(completion, answer)


def test_peer_script_imports_nothing_of_the_project() -> None:
    text = (REPO / "bench" / "peers" / "trl_grpo.py").read_text()
    for pkg in ("shared", "broker", "trainer_svc", "generator_svc", "reward_svc"):
        assert f"from {pkg}" not in text and f"import {pkg}" not in text, pkg


def test_time_to_target_from_a_curve() -> None:
    # Steps end at 10, 11, 12, 13 s after launch: a step takes 1 s, so start-up is 10 - 1 = 9 s.
    ends = [{"step": i + 1, "t_s": 10.0 + i} for i in range(4)]
    curve = [{"step": 0, "t_s": 9.0, "reward": 0.2}, {"step": 2, "t_s": 11.0, "reward": 0.8},
             {"step": 4, "t_s": 13.0, "reward": 0.9}]
    s = bench_suite._ttr_summary(curve, ends, 0.85)
    assert s["step_s_median"] == 1.0 and s["startup_s"] == 9.0
    assert s["time_to_target_s"] == 13.0 and s["steps_to_target"] == 4 and s["train_s_to_target"] == 4.0
    assert bench_suite._ttr_summary(curve, ends, 0.95)["time_to_target_s"] is None


def test_generator_rate_between_batches() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    # Batches of 2 rows x 50 tokens every 0.5 s; the first two are skipped (warm-up).
    rows = [{"created_at": t0 + timedelta(seconds=0.5 * b), "num_completion_tokens": 50}
            for b in range(6) for _ in range(2)]
    rate, n = bench_suite._batch_rates(rows)
    assert n == 4 and rate == pytest.approx(3 * 100 / 1.5)


def _numbers(d: dict, keys: tuple[str, ...], where: str) -> None:
    for k in keys:
        v = d.get(k)
        assert isinstance(v, (int, float)) and math.isfinite(v), f"{where}.{k} = {v!r}"


@pytest.mark.slow
@pytest.mark.integration
def test_ci_preset_writes_a_complete_result(tmp_path: Path) -> None:
    out = tmp_path / "results"
    r = bench_suite.run_suite("ci", workdir=str(tmp_path / "work"), out_dir=str(out),
                              trl_venv=str(REPO / "runs" / "bench" / "trl-venv"))
    saved = json.loads((out / "suite.json").read_text())
    assert saved["preset"] == "ci" and saved.keys() == json.loads(json.dumps(r, default=str)).keys()
    for f in ("suite.md", "suite_reward_time.png", "suite_scaling.png", "suite_broker_generator.png"):
        assert (out / f).stat().st_size > 0, f
    trl = saved["trl_env"]["error"] is None

    ttr = saved["time_to_reward"]
    for name in ("ours_async", "ours_sync", *(("trl",) if trl else ())):
        assert ttr["runs"][name], name
        for run in ttr["runs"][name]:
            assert run["curve"] and all(math.isfinite(c["t_s"]) and 0 <= c["reward"] <= 1 for c in run["curve"])
        _numbers(ttr["summary"][name], ("time_to_target_s", "startup_s", "step_s_median", "final_reward"),
                 f"time_to_reward.summary.{name}")
    if trl:
        # None only when a side never reached the target within the run; then it is the run's end.
        assert ttr["speedup_vs_trl"]["async"] is not None and ttr["step_speed_vs_trl"]["async"] is not None
        assert len(saved["peer_scaling"]["gen_length"]) >= 3
        for pt in saved["peer_scaling"]["gen_length"]:
            _numbers(pt, ("ours_step_s", "trl_step_s", "trl_over_ours"), "peer_scaling")

    _numbers(saved["generator"], ("standalone_tokens_per_s", "in_system_tokens_per_s", "efficiency",
                                  "engine_only_efficiency"), "generator")
    b = saved["broker"]
    _numbers(b, ("samples_per_s", "overhead_ms", "ours_over_raw"), "broker")
    _numbers(b["raw_streams"], ("samples_per_s",), "broker.raw_streams")
    for axis in ("gen_length", "group_size", "model_size"):
        assert len(saved["scaling"][axis]) >= 3, axis
        for pt in saved["scaling"][axis]:
            _numbers(pt, ("step_s", "tokens_per_step"), f"scaling.{axis}")
    assert saved["gpu"]["status"] in ("unrun", "run")
    _numbers(saved, ("generator_efficiency", "broker_samples_per_s", "broker_overhead_ms"), "top level")


def test_gpu_variant_answers_help() -> None:
    # deploy/gpu_bench.py is unrun here (no GPU); it must at least parse its arguments anywhere.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(REPO / "deploy" / "gpu_bench.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--lengths" in proc.stdout
