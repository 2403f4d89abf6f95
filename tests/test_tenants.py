"""Several jobs at once on one fleet (ARCHITECTURE.md, "Several jobs on one fleet"): a fleet of two
trainers, one generator and one reward service (real processes, the real vLLM CPU engine) runs two
LoRA jobs at the same time on one engine, each with its own adapter, and a third job whose reward
cannot load fails alone while the others go on."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from shared_fleet import END, Fleet, standing_fleet

from broker.verify import verify


@pytest.fixture(scope="module")
def two_trainers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with standing_fleet(tmp_path_factory.mktemp("tenants"), trainers=2) as f:
        yield f


def test_two_lora_jobs_run_at_once_on_one_engine_and_a_bad_one_fails_alone(two_trainers: Fleet, tmp_path: Path) -> None:
    f = two_trainers
    a = f.submit("lora-a", steps=6, lora={"rank": 8}, seed=1, algorithm={"lr": 1e-3})
    b = f.submit("lora-b", steps=6, lora={"rank": 8}, seed=2, algorithm={"lr": 1e-3}, share=2.0)
    broken = tmp_path / "broken_reward.py"
    broken.write_text("raise ImportError('the grader is not installed')\n")
    c = f.submit("bad-reward", steps=2, reward={"kind": "python", "function": f"{broken}:score"})
    served_together, jobs = False, {}
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        jobs = {j: f.job(j) for j in (a, b, c)}
        gens = [s for s in httpx.get(f"{f.api}/fleet", timeout=30).json()["services"] if s["role"] == "generator"]
        served_together |= any({a, b} <= set(s["jobs"]) for s in gens)
        if all(j["state"] in END for j in jobs.values()):
            break
        assert not f.sup.failed(), [p.name for p in f.sup.failed()]
        time.sleep(0.2)
    assert jobs[a]["state"] == "finished" and jobs[b]["state"] == "finished", jobs
    assert jobs[c]["state"] == "failed" and "the grader is not installed" in jobs[c]["error"], jobs[c]
    # at once: one generator served both, and each ran while the other did
    assert served_together
    sa, sb = ([s["created_at"] for s in f.ledger.train_steps(j)] for j in (a, b))
    assert min(sa) < max(sb) and min(sb) < max(sa)  # each trained steps while the other did
    gen_log = f.log("generator")
    assert (
        gen_log.count("engine ")
        and f"job {b}'s model is compatible" in gen_log
        or f"job {a}'s model is compatible" in gen_log
    )
    # each job's rollouts came from its own adapter, versioned on its own
    for job in (a, b):
        adapters = {r["adapter"] for r in f.ledger.samples(job) if r["kind"] == "train"}
        assert adapters and all(x.startswith(f"{job}/v") for x in adapters), adapters
        res = verify(f.ledger, job)
        assert res.ok and res.lost == 0, res.violations
        usage = f.job(job)["usage"]
        assert usage["generator_seconds"] > 0 and usage["completion_tokens"] > 0, usage
    trainers = {f.log("trainer").count(f"serving job {a}"), f.log("trainer-1").count(f"serving job {a}")}
    assert trainers == {0, 1}  # one trainer trained it, the other never did
