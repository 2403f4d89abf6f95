"""A real sync job sampled with top_p and top_k (the session's standing fleet: the vLLM CPU engine,
the trainer, float32 on both sides): at staleness 0 the trainer scores every token under the
distribution it was sampled from, so every step's importance weights are 1 and the mismatch KL ~0
(ARCHITECTURE.md "The behaviour policy"). Scored under the full softmax, this random-init model's
flat distributions would put is/mean near the kept mass, far below 1."""

from __future__ import annotations

import pytest
from shared_fleet import Fleet  # tests/ is on sys.path

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_truncated_sampler_trains_on_policy_at_staleness_0(fleet: Fleet) -> None:
    job = fleet.submit(
        "top-p-top-k", steps=3, mode="sync", max_staleness=0, sampling={"max_tokens": 8, "top_p": 0.8, "top_k": 20}
    )
    assert fleet.wait(job)["state"] == "finished"
    steps = [r["metrics"] for r in fleet.ledger.train_steps(job)]
    assert len(steps) == 3
    for m in steps:
        assert m["is/mean"] == pytest.approx(1.0, abs=1e-4), m
        assert m["is/max"] == pytest.approx(1.0, abs=1e-3), m
        assert m["mismatch_kl"] < 1e-6, m
