"""bench/ecosystem_verifiers.py without running it: its job specs validate as a user's would (the
reward and, for the environment with tools, the episode environment left to the defaults), and the
section renders in results/ecosystem.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.ecosystem import markdown
from bench.ecosystem_verifiers import CASES, VF_ENVS, job_spec
from shared.jobspec import JobSpec

pytest.importorskip("verifiers.v1")


@pytest.mark.parametrize("env", sorted(CASES))
def test_each_bench_spec_is_a_valid_job_scored_by_the_environments_rubric(env: str, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(VF_ENVS))
    spec = JobSpec.model_validate(job_spec(env, Path("/m"), steps=3))
    assert spec.task.name == "verifiers" and spec.task.env == env and spec.reward == "verifiers"
    assert (spec.environment is not None) == (env == "vf_tiny_tools")


def test_the_section_renders_beside_the_others() -> None:
    run = {
        "ok": True,
        "job": "j1",
        "steps": 3,
        "verify": {"ok": True},
        "reward_status": {"ok": 80, "error": 0, "timeout": 0},
        "reward_mean": 0.1,
        "components": ["reversed_exactly", "short_reply"],
    }
    md = markdown({"conventions": {}, "verifiers_envs": {"vf_tiny_reverse": run}, "verifiers_envs_machine": {}})
    assert "| vf_tiny_reverse | True | `j1` | 3 | ok | 80/0/0 | 0.1 | reversed_exactly, short_reply |" in md
    assert "verifiers_envs_machine" not in md
