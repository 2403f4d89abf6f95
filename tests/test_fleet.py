"""A standing fleet serving a queue of jobs: one broker, generator, reward service and trainer,
started once without JOB_ID (broker/fleet.py), as real processes on the real Redis, the real vLLM
CPU engine and a SQLite ledger (the session's `fleet`, tests/shared_fleet.py). Every test submits
jobs to the same fleet, as users of one deployment would, and checks the order they ran in, how
each ended, and `verify` for each.
"""

from __future__ import annotations

import time

import httpx
import pytest
from shared_fleet import Fleet  # tests/ is on sys.path

from broker.verify import verify

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _verified(fleet: Fleet, *job_ids: str) -> None:
    for job_id in job_ids:
        result = verify(fleet.ledger, job_id)
        assert result.ok, (job_id, result.violations)


def test_jobs_submitted_while_one_runs_all_finish_in_order_on_one_engine(fleet: Fleet) -> None:
    gen = fleet.log("generator")
    built, kept = gen.count("built for job"), gen.count("keeping the engine")
    a = fleet.submit("A", steps=6)
    fleet.wait(a, ("running",))
    b, c = fleet.submit("B"), fleet.submit("C")
    queue = httpx.get(f"{fleet.api}/queue", timeout=30).json()
    assert [q["id"] for q in queue["queued"]] == [b, c]
    assert queue["queued"][0]["waiting_for"] == f"job {a} to end"
    jobs = [fleet.wait(j) for j in (a, b, c)]
    assert [j["state"] for j in jobs] == ["finished"] * 3, [j.get("error") for j in jobs]
    assert [j["step"] for j in jobs] == [6, 2, 2]
    started = [j["started_at"] for j in jobs]
    assert started == sorted(started)  # first in, first out
    _verified(fleet, a, b, c)
    # one process each for all three: the generator built its engine at most once (for the first,
    # when the fleet's last job had another model) and kept it for the rest
    gen = fleet.log("generator")
    assert gen.count("built for job") <= built + 1
    assert gen.count("keeping the engine") >= kept + 2
    assert fleet.alive()


def test_a_higher_priority_goes_first(fleet: Fleet) -> None:
    blocker = fleet.submit("blocker", steps=4)
    fleet.wait(blocker, ("running",))
    low, high = fleet.submit("low"), fleet.submit("high", priority=5)
    assert [q["id"] for q in httpx.get(f"{fleet.api}/queue", timeout=30).json()["queued"]] == [high, low]
    done = {j: fleet.wait(j) for j in (blocker, low, high)}
    assert all(d["state"] == "finished" for d in done.values())
    assert done[high]["started_at"] < done[low]["started_at"]
    _verified(fleet, blocker, low, high)


def test_a_job_whose_reward_cannot_load_fails_alone_and_the_next_runs(fleet: Fleet) -> None:
    broken = fleet.tmp / "broken_reward.py"
    broken.write_text("def score(completion, answer:\n    return 1.0\n")  # a syntax error
    bad = fleet.submit("bad-reward", reward={"kind": "python", "function": f"{broken}:score"})
    good = fleet.submit("after-bad")
    failed = fleet.wait(bad)
    assert failed["state"] == "failed"
    assert "reward" in failed["error"] and "broken_reward.py" in failed["error"], failed["error"]
    assert fleet.wait(good)["state"] == "finished"
    _verified(fleet, bad, good)


def test_cancelled_jobs_queued_never_start_running_free_the_fleet(fleet: Fleet) -> None:
    long = fleet.submit("long", steps=200)
    fleet.wait(long, ("running",))
    nxt, dropped = fleet.submit("next"), fleet.submit("dropped")
    r = httpx.post(f"{fleet.api}/jobs/{dropped}/cancel", timeout=30)
    assert r.status_code == 202 and r.json()["state"] == "cancelled"
    while fleet.job(long)["step"] < 1:  # cancel it mid-run
        time.sleep(0.2)
    assert httpx.post(f"{fleet.api}/jobs/{long}/cancel", timeout=30).status_code == 202
    assert fleet.wait(long)["state"] == "cancelled"
    after = fleet.wait(nxt)
    assert after["state"] == "finished"
    never = fleet.job(dropped)
    assert never["state"] == "cancelled" and never["started_at"] is None and never["samples"] == {}
    assert fleet.job(long)["step"] < 200
    _verified(fleet, long, nxt, dropped)
    assert fleet.alive()  # the fleet is still up


def test_an_incompatible_model_rebuilds_the_engine_in_the_same_process(fleet: Fleet) -> None:
    from asyncrl.tiny_model import build_tiny_model

    wider = build_tiny_model(fleet.tmp / "wider", layers=2, hidden=128, heads=4, intermediate=256, seed=1)
    (generator,) = [p for p in fleet.sup.procs if p.name == "generator"]
    builds = fleet.log("generator").count("built for job")
    job = fleet.submit("wider", model_path=str(wider))
    assert fleet.wait(job)["state"] == "finished"
    _verified(fleet, job)
    assert fleet.log("generator").count("built for job") == builds + 1  # another engine, same process
    assert generator.popen.poll() is None and generator in fleet.sup.procs
