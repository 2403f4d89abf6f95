"""A job per framework from that framework's own files, on the session's standing fleet (its
reward service runs plug-ins in worker processes): a verl-layout parquet with a verl compute_score
file, a TRL conversational dataset with a TRL reward_func file, a verifiers-style rubric file. Each
finishes with `verify` ok, every reward is ok, and the samples carry what the convention logs.
The files are bench/ecosystem.py's (`python -m bench ecosystem` runs the same jobs). About 20 s for
the three on a warm fleet (13 s, 2 s, 2.5 s measured)."""

from __future__ import annotations

import pytest
from shared_fleet import Fleet

from bench.ecosystem import CASES, COMPONENTS, Target, job_spec, run_job

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("convention", list(CASES))
def test_a_job_from_the_frameworks_own_files_finishes_verified(fleet: Fleet, convention: str) -> None:
    d = fleet.tmp / f"ecosystem-{convention}"
    d.mkdir(exist_ok=True)
    r = run_job(
        Target(fleet.api, fleet.ledger, fleet.model), job_spec(convention, fleet.model, CASES[convention](d), 2)
    )
    assert r["ok"], r
    assert r["steps"] == 2 and r["verify"]["ok"]
    assert r["reward_status"]["error"] == 0 and r["reward_status"]["timeout"] == 0, r
    assert COMPONENTS[convention] <= set(r["components"]), r
    log = fleet.log("reward")
    if convention == "verifiers":  # recognised: a list of functions
        assert "called by the verifiers convention (a rubric" in log
    else:
        assert f"called by the {convention} convention (its signature names" in log
