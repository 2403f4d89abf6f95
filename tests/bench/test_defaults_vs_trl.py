"""bench/own_task.py's defaults-against-TRL comparison without running it: the job spec sets only
what a user must (every other field resolves to this system's default), candidates override by
name, the gap's arithmetic by hand, and the section keeps earlier candidates."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench.own_task import (
    CANDIDATES,
    DEFAULTS_FIELDS,
    deep_merge,
    defaults_markdown,
    defaults_section,
    defaults_spec,
    ours_defaults,
    seed_gap,
)
from shared.jobspec import AlgorithmSpec, JobSpec

REPO = Path(__file__).resolve().parents[2]
M, D, R = Path("/m"), Path("/d/addsub.jsonl"), Path("/u/reward.py")


def _paths(d: dict, prefix: str = "") -> set[str]:
    """Dotted paths of the leaves of `d`, a dict's own dicts opened except task (one field)."""
    out: set[str] = set()
    for k, v in d.items():
        if isinstance(v, dict) and k != "task":
            out |= _paths(v, f"{prefix}{k}.")
        else:
            out.add(prefix + k)
    return out


def test_the_defaults_spec_sets_only_what_a_user_must() -> None:
    spec = defaults_spec(M, D, R, seed=2, steps=150)
    assert _paths(spec) == set(DEFAULTS_FIELDS)
    js = JobSpec.model_validate(spec)
    # the rest is the job spec's defaults, resolved as a user's job resolves them
    assert js.mode == JobSpec.model_fields["mode"].default
    assert js.algorithm.lr_schedule == AlgorithmSpec.model_fields["lr_schedule"].default
    assert ours_defaults(spec)["lr_schedule"] == AlgorithmSpec.model_fields["lr_schedule"].default
    assert (js.group_size, js.prompts_per_step, js.algorithm.lr, js.steps, js.seed) == (8, 8, 1e-4, 150, 2)


@pytest.mark.parametrize("name", sorted(CANDIDATES))
def test_each_candidate_is_a_valid_job_with_its_overrides(name: str) -> None:
    js = JobSpec.model_validate(defaults_spec(M, D, R, seed=0, steps=150, candidate=name))
    over = CANDIDATES[name]
    assert js.mode == over.get("mode", JobSpec.model_fields["mode"].default)
    for k, v in over.get("algorithm", {}).items():
        assert getattr(js.algorithm, k) == v
    assert js.algorithm.lr == 1e-4  # an override never drops a field the user set


def test_an_unknown_candidate_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: .*'linear'"):
        defaults_spec(M, D, R, seed=0, steps=10, candidate="linaer")


def test_deep_merge_merges_nested_keys_and_changes_neither() -> None:
    base = {"a": {"x": 1, "y": 2}, "b": 3}
    over = {"a": {"y": 5}, "c": 4}
    assert deep_merge(base, over) == {"a": {"x": 1, "y": 5}, "b": 3, "c": 4}
    assert base == {"a": {"x": 1, "y": 2}, "b": 3} and over == {"a": {"y": 5}, "c": 4}


def test_seed_gap_by_hand() -> None:
    # ours 0.4, 0.5, 0.6: mean 0.5, sample variance ((-.1)^2 + 0 + .1^2) / 2 = 0.01
    # TRL 0.5, 0.7: mean 0.6, sample variance (.1^2 + .1^2) / 1 = 0.02
    # gap 0.5 - 0.6 = -0.1; se = sqrt(0.01 / 3 + 0.02 / 2) = sqrt(0.013333) = 0.11547
    g = seed_gap([0.4, 0.5, 0.6], [0.5, 0.7])
    assert g["ours_mean"] == pytest.approx(0.5) and g["trl_mean"] == pytest.approx(0.6)
    assert g["gap"] == pytest.approx(-0.1)
    assert g["gap_se"] == pytest.approx(0.115470, abs=1e-6)
    assert seed_gap([0.5], [0.5, 0.7])["gap_se"] is None  # one seed: no spread to take


def _settings() -> dict:
    return {
        "ours_fields_set": list(DEFAULTS_FIELDS),
        "ours_defaults": {"lr_schedule": "linear"},
        "trl": {"version": "1.16.0", "fields_set": ["bf16"], "defaults": {"lr_scheduler_type": "linear"}},
        "shape": {"group_size": 8, "prompts_per_step": 8, "lr": 1e-4, "max_tokens": 8},
        "stop": ["\n"],
        "held_out": "greedy",
        "trl_step_s_median": 0.1,
        "machine": {"cores": 2},
        "loadavg_start": [2.0, 2.0, 2.0],
        "loadavg_end": [2.0, 2.0, 2.0],
        "wall_s": 100.0,
        "date": "2026-01-01",
    }


def _cand(xs: list[float]) -> dict:
    return {"overrides": {}, "held_out": xs, "step_s_median": [0.1] * len(xs)}


def test_the_section_keeps_earlier_candidates_and_heads_with_the_defaults() -> None:
    first = defaults_section(None, [0.6, 0.6, 0.6], {"constant": _cand([0.4, 0.5, 0.6])}, _settings(), 150)
    assert "gap" not in first  # no defaults run yet: no headline
    second = defaults_section(first, [0.5, 0.6, 0.7], {"defaults": _cand([0.6, 0.6, 0.6])}, _settings(), 150)
    assert set(second["candidates"]) == {"constant", "defaults"}
    # every gap against this run's TRL: 0.5 - 0.6 and 0.6 - 0.6
    assert second["candidates"]["constant"]["gap"] == pytest.approx(-0.1)
    assert second["gap"] == pytest.approx(0.0) and second["ours"] == [0.6, 0.6, 0.6]
    assert second["goal_met"] is True
    worse = defaults_section(None, [0.6, 0.6, 0.6], {"defaults": _cand([0.55, 0.58, 0.58])}, _settings(), 150)
    assert worse["gap"] == pytest.approx(-0.03) and worse["goal_met"] is False
    md = defaults_markdown(second)
    assert "**gap +0.000**" in md and "| ours constant |" in md and "goal >= -0.02: met" in md


def test_trl_defaults_config_sets_only_the_listed_fields() -> None:
    # The peer script runs in TRL's own environment; read its grpo_config_defaults call instead:
    # the keyword arguments it passes are exactly DEFAULTS_SET, so nothing else departs from TRL.
    tree = ast.parse((REPO / "bench" / "peers" / "trl_grpo.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "grpo_config_defaults")
    call = next(n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "GRPOConfig")
    listed = next(
        n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "DEFAULTS_SET"
    )
    assert {k.arg for k in call.keywords} == set(ast.literal_eval(listed))


def test_the_sync_candidate_gives_the_issues_comparison_beside_the_headline() -> None:
    d = defaults_section(None, [0.6, 0.6], {"defaults": _cand([0.5, 0.5]), "sync": _cand([0.7, 0.5])}, _settings(), 150)
    assert d["gap"] == pytest.approx(-0.1) and d["gap_sync"] == pytest.approx(0.0)
    assert "With mode sync (the issue's comparison): gap +0.000." in defaults_markdown(d)
