"""verifiers environments trained by module name on the session's standing fleet (real broker,
generator, reward service and trainer processes, the vLLM CPU engine, Redis, the SQLite ledger): the
spec names the environment's module (tests/vf_envs, on every service's PYTHONPATH) and its args and
nothing else about the task. Single-turn: the reward service scores each completion with the task's
own rubric. Multi-turn (a task with tools): the generator plays episodes in the `verifiers`
environment, which scores the whole trace. Either way each reward function is its own term in the
ledger, the reward their weighted sum, and the ledger verifies."""

from __future__ import annotations

import sys

import httpx
import pytest
from shared_fleet import VF_ENVS, Fleet  # tests/ is on sys.path

from shared.datasets import load_task
from shared.jobspec import JobSpec
from shared.vfenv import COLUMN

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("verifiers.v1")
sys.path.insert(0, str(VF_ENVS))  # this process validates and loads the task too


def scored(fleet: Fleet, job_id: str) -> list[dict]:
    return [s for s in fleet.ledger.samples(job_id, limit=10_000) if s["reward_status"] is not None]


def terms(s: dict) -> dict[str, float]:
    return dict((s["reward_details"] or {}).get("components") or {})


def test_a_single_turn_verifiers_environment_trains_scored_by_its_own_rubric(fleet: Fleet) -> None:
    task = {"name": "verifiers", "env": "vf_tiny_reverse", "args": {"num_tasks": 24}, "n_test": 4}
    spec = fleet.spec("vf-reverse", steps=2, task=task, mode="sync")
    bad = httpx.post(f"{fleet.api}/jobs", json={**spec, "task": {**task, "args": {"num_taks": 3}}}, timeout=30)
    assert bad.status_code == 422 and "refuses task.args" in bad.text, bad.text
    job_id = fleet.post(spec)
    job = fleet.wait(job_id)
    assert job["state"] == "finished", (job, fleet.sup.tail("trainer"), fleet.sup.tail("reward"))
    train, test = load_task(JobSpec.model_validate(spec).task, 0)
    samples = scored(fleet, job_id)
    assert {s["kind"] for s in samples} == {"train", "eval"} and {s["reward_status"] for s in samples} == {"ok"}
    for s in samples:
        problem = (train if s["kind"] == "train" else test)[s["prompt_index"]]
        t = terms(s)
        assert set(t) == {"reversed_exactly", "short_reply"}, s
        # the rubric's weights: reversed_exactly 1.0, short_reply 0.5
        assert s["reward"] == pytest.approx(t["reversed_exactly"] + 0.5 * t["short_reply"])
        answer = problem.metadata[COLUMN]["task"]["answer"]
        assert t["short_reply"] == float(len(s["completion"].strip()) <= 2 * len(answer)), s
    steps = fleet.ledger.train_steps(job_id)
    # each rubric function is a term of the step's metrics (reward/<name>)
    assert all({"reward/reversed_exactly", "reward/short_reply"} <= set(r["metrics"]) for r in steps), steps[0]
    v = httpx.get(f"{fleet.api}/jobs/{job_id}/verify", timeout=60).json()
    assert v["ok"], v


def test_a_verifiers_environment_with_tools_plays_episodes_scored_by_its_rubric(fleet: Fleet) -> None:
    task = {"name": "verifiers", "env": "vf_tiny_tools", "args": {"num_tasks": 24}, "n_test": 4}
    # the tools' instructions would not fit the tiny model's 256 positions: the opening is the task's
    # own; a turn ends at a digit or lowercase letter (ids 4..39 of the tiny tokenizer), so it is
    # answered (a reply without a tool call is the final one) rather than cut at max_tokens
    spec = fleet.spec(
        "vf-tools",
        steps=2,
        task=task,
        mode="sync",
        sampling={"max_tokens": 16, "stop_token_ids": list(range(4, 40))},
        environment={"name": "verifiers", "kwargs": {"system_prompt": False}, "limits": {"max_total_tokens": 200}},
    )
    assert JobSpec.model_validate({k: v for k, v in spec.items() if k != "environment"}).environment is not None
    job_id = fleet.post(spec)
    job = fleet.wait(job_id)
    assert job["state"] == "finished", (job, fleet.sup.tail("generator"), fleet.sup.tail("reward"))
    samples = scored(fleet, job_id)
    assert {s["kind"] for s in samples} == {"train", "eval"} and {s["reward_status"] for s in samples} == {"ok"}
    for s in samples:
        t = terms(s)
        assert set(t) == {"correct", "used_tool"}, s
        assert s["reward"] == pytest.approx(t["correct"] + 0.25 * t["used_tool"])
        assert s["stop_reason"] == "done" and s["turns"] >= 1, s
    steps = fleet.ledger.train_steps(job_id)
    # the episodes' metrics: the rubric the environment computed, per step (env/<key>)
    want = {"reward/correct", "reward/used_tool", "env/rubric_reward", "env/tool_call"}
    assert all(want <= set(r["metrics"]) for r in steps), steps[0]
    v = httpx.get(f"{fleet.api}/jobs/{job_id}/verify", timeout=60).json()
    assert v["ok"], v
