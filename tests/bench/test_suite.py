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
import os
import random
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from bench import scratchpad
from bench import suite as bench_suite
from bench.peers import trl_grpo
from shared.rewards import exact_match

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("42", "42"),
        ("41", "42"),
        ("= 42", "42"),
        ("4 2", "42"),
        ("-7", "-7"),
        ("3-7", "-4"),
        ("1,234", "1234"),
        ("3.50", "3.5"),
        ("42.0", "42"),
        ("-0", "0"),
        ("", "1"),
        ("no idea", "1"),
        ("12</s>", "12"),
        ("x12y", "12"),
    ],
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
    curve = [
        {"step": 0, "t_s": 9.0, "reward": 0.2},
        {"step": 2, "t_s": 11.0, "reward": 0.8},
        {"step": 4, "t_s": 13.0, "reward": 0.9},
    ]
    s = bench_suite._ttr_summary(curve, ends, 0.85)
    assert bench_suite._ttr_summary(curve, ends, None)["time_to_target_s"] is None  # no target without TRL
    assert s["step_s_median"] == 1.0 and s["startup_s"] == 9.0
    assert s["time_to_target_s"] == 13.0 and s["steps_to_target"] == 4 and s["train_s_to_target"] == 4.0
    assert bench_suite._ttr_summary(curve, ends, 0.95)["time_to_target_s"] is None


def test_generator_rate_between_batches() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    # Batches of 2 rows x 50 tokens every 0.5 s; the first two are skipped (warm-up).
    rows = [
        {"created_at": t0 + timedelta(seconds=0.5 * b), "num_completion_tokens": 50} for b in range(6) for _ in range(2)
    ]
    rate, n = bench_suite.batch_rates(rows)
    assert n == 4 and rate == pytest.approx(3 * 100 / 1.5)


def _numbers(d: dict, keys: tuple[str, ...], where: str) -> None:
    for k in keys:
        v = d.get(k)
        assert isinstance(v, (int, float)) and math.isfinite(v), f"{where}.{k} = {v!r}"


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1800)  # two regimes beside TRL, co-located, stale drops, scaling: ~16 min on 2 cores
def test_ci_preset_writes_a_complete_result(tmp_path: Path) -> None:
    out = tmp_path / "results"
    r = bench_suite.run_suite(
        "ci", workdir=str(tmp_path / "work"), out_dir=str(out), trl_venv=str(REPO / "runs" / "bench" / "trl-venv")
    )
    saved = json.loads((out / "suite.json").read_text())
    assert saved["preset"] == "ci" and saved.keys() == json.loads(json.dumps(r, default=str)).keys()
    for f in ("suite.md", "suite_reward_time.png", "suite_scaling.png", "suite_broker_generator.png"):
        assert (out / f).stat().st_size > 0, f
    trl = saved["trl_env"]["error"] is None

    for key, modes in (("time_to_reward", ("ours_async",)), ("time_to_reward_long", ("ours_async",))):
        ttr = saved[key]
        for name in (*modes, *(("trl",) if trl else ())):
            assert ttr["runs"][name], (key, name)
            for run in ttr["runs"][name]:
                assert run["curve"] and all(math.isfinite(c["t_s"]) and 0 <= c["reward"] <= 1 for c in run["curve"])
            _numbers(
                ttr["summary"][name],
                ("time_to_target_s", "startup_s", "step_s_median", "final_reward", "completion_tokens_median"),
                f"{key}.summary.{name}",
            )
        assert ttr["breakdown"]["async"], key  # the trainer's time/* metrics, per mode
        _numbers(ttr["breakdown"]["async"], ("wait_s", "train_s"), f"{key}.breakdown.async")
    # Regime (b) is the generation-dominated one. The ci preset's 60-step warm start only half
    # learns the worked format (132-195 tokens), so only "far longer than regime (a)" is asserted.
    long_ = saved["time_to_reward_long"]["summary"]
    assert long_["ours_async"]["completion_tokens_median"] >= 32
    assert saved["time_to_reward"]["summary"]["ours_async"]["completion_tokens_median"] <= 8
    if trl:
        # TRL reaches its own final reward by definition; ours counts as its whole run when it never does.
        for key in ("time_to_reward_vs_trl", "time_to_reward_vs_trl_long", "startup_s", "trl_startup_s"):
            _numbers(saved, (key,), "top level")
        assert long_["trl"]["completion_tokens_median"] >= 32
        assert saved["time_to_reward"]["speedup_vs_trl"]["async"] == saved["time_to_reward_vs_trl"]
        assert len(saved["peer_scaling"]["gen_length"]) >= 3
        for pt in saved["peer_scaling"]["gen_length"]:
            _numbers(pt, ("ours_step_s", "trl_step_s", "trl_over_ours"), "peer_scaling")
    # Co-located: the job ran (no error under the section) and has its ratio to TRL.
    assert saved["colocated_error"] is None, saved["colocated_error"]
    if trl:
        _numbers(saved, ("colocated_vs_trl",), "top level")
    _numbers(saved, ("launcher_over_pinned",), "top level")
    assert saved["launcher_over_pinned"] == saved["launcher"]["launcher_over_pinned"]
    assert 0.0 <= saved["stale_dropped_fraction"] <= 1.0 and saved["stale_drops"]["generated"] > 0
    assert isinstance(saved["regime_scaling"]["points"], list)

    _numbers(
        saved["generator"],
        ("standalone_tokens_per_s", "in_system_tokens_per_s", "efficiency", "engine_only_efficiency"),
        "generator",
    )
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
    proc = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "gpu_bench.py"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "--lengths" in proc.stdout and "--dry-run" in proc.stdout


def test_gpu_variant_dry_run_checks_its_plan_on_cpu() -> None:
    # The prepared GPU script's plan and job specs, checked where there is no GPU.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "gpu_bench.py"), "--dry-run", "--lengths", "64,192", "--timeout", "300"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["phases"] == ["sleep_wake", "generator", "system", "regimes", "broker"] and plan["timeout_s"] == 300
    errors = plan["spec_errors"]
    assert set(errors) == {"async-64", "async-192", "sync-192", "colocated-192"}
    assert all(e is None for e in errors.values()), errors
    bad = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "gpu_bench.py"), "--dry-run", "--lengths", "300"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert bad.returncode == 2 and "--lengths" in bad.stderr


def test_scratchpad_chain_worked_by_hand() -> None:
    # 7+3-2 with the fixed digits: each line does one operation and copies the rest.
    class Fixed(random.Random):
        def __init__(self, draws: list[object]) -> None:
            super().__init__(0)
            self.draws = draws

        def randint(self, a: int, b: int) -> int:  # type: ignore[override]
            return int(self.draws.pop(0))  # type: ignore[call-overload]

        def choice(self, seq):  # type: ignore[no-untyped-def, override]
            return self.draws.pop(0)

    prompt, solution = scratchpad.chain(Fixed([7, 3, "+", 2, "-"]), 2)
    assert prompt == "7+3-2=" and solution == "10-2\n8"
    # Values stay in 0..99: 95 + 9 would leave it, so that operation takes the other sign.
    prompt, solution = scratchpad.chain(
        Fixed([5, 9, "+", 9, "+", 9, "+", 9, "+", 9, "+", 9, "+", 9, "+", 9, "+", 9, "+", 9, "+", 9, "+"]), 11
    )
    assert prompt == "5" + "+9" * 10 + "-9=" and solution.split("\n")[-1] == "86"


def test_scratchpad_reward_reads_the_last_line(tmp_path: Path) -> None:
    _data, reward = scratchpad.write_task(tmp_path, n=20)
    ns: dict = {}
    exec(reward.read_text(), ns)  # the user's file, as the reward service loads it
    score = ns["score"]
    assert score("10-2\n8", "10-2\n8", metadata={}) == 1.0
    assert score("11-2\n9\n8\n", "10-2\n8", metadata={}) == 1.0  # a wrong path to the right value still counts
    assert score("10-2\n9", "10-2\n8", metadata={}) == 0.0
    assert score("8\n10-2", "10-2\n8", metadata={}) == 0.0
    assert score("", "10-2\n8", metadata={}) == 0.0
    rows = [json.loads(x) for x in (tmp_path / "user" / "scratchpad.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and all(len(r["solution"]) + len(r["question"]) + 2 <= 256 for r in rows)
