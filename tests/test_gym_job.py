"""A reasoning-gym dataset trained by name on the session's standing fleet (real generator, reward
service and trainer processes, the vLLM CPU engine, Redis, the SQLite ledger): the spec names the
dataset and its config and nothing else about the task; the reward service scores every sample with
the dataset's own score_answer (each recorded reward equals it, recomputed here from the problem);
the held-out set is evaluated from seeds disjoint from the training ones; the ledger verifies."""

from __future__ import annotations

import httpx
import pytest
from shared_fleet import Fleet  # tests/ is on sys.path

from shared.datasets import load_task
from shared.gym import score_completion
from shared.jobspec import JobSpec

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("reasoning_gym")


def test_a_reasoning_gym_dataset_by_name_trains_and_is_scored_by_its_own_score_answer(fleet: Fleet) -> None:
    task = {
        "name": "reasoning_gym",
        "dataset": "letter_counting",
        "config": {"min_words": 1, "max_words": 1},
        "size": 16,
        "n_test": 4,
    }
    spec = fleet.spec("gym-letter-counting", steps=2, task=task, mode="sync")
    bad = httpx.post(f"{fleet.api}/jobs", json={**spec, "task": {**task, "dataset": "letter_countin"}}, timeout=30)
    assert bad.status_code == 422 and "e.g. letter_counting" in bad.text, bad.text
    job_id = fleet.post(spec)
    job = fleet.wait(job_id)
    assert job["state"] == "finished", (job, fleet.sup.tail("trainer"), fleet.sup.tail("reward"))
    train, test = load_task(JobSpec.model_validate(spec).task, 0)
    samples = fleet.ledger.samples(job_id)
    scored = [s for s in samples if s["reward_status"] is not None]
    assert {s["kind"] for s in scored} == {"train", "eval"}
    assert {s["reward_status"] for s in scored} == {"ok"}
    for s in scored:
        problem = (train if s["kind"] == "train" else test)[s["prompt_index"]]
        assert s["reward"] == pytest.approx(score_completion(s["completion"], problem.metadata)), s
    evals = [e for e in fleet.ledger.evals(job_id) if e["source"] == "pipeline"]
    assert {(e["name"], e["step"], e["n"]) for e in evals} == {("held_out", 0, 4), ("held_out", 2, 4)}
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    v = httpx.get(f"{fleet.api}/jobs/{job_id}/verify", timeout=60).json()
    assert v["ok"], v
