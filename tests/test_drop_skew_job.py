"""What dropping skews, on real jobs of the session's standing fleet (shared/drop_skew.py).

A job whose drops follow length by construction: `algorithm.overlong: mask` keeps every completion
cut at `max_tokens` out of the loss, so every dropped sample is exactly `max_tokens` long and every
trained one stopped earlier (a stop token, ten of the tiny model's 104, ends about half the
completions within 6 tokens). Its reward is a constant, so the reward cannot skew. The job's
summary shows the over-long drops, a length shift and the warning (GET /jobs/{id}, `asyncrl
status`, the trainer's log); a job that drops nothing shows neither."""

from __future__ import annotations

import pytest
from shared_fleet import Fleet
from typer.testing import CliRunner

from asyncrl.cli import app

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_TOKENS = 6
STOP_IDS = list(range(4, 14))  # the digits' ids: the tiny tokenizer's 4 special tokens come first


def test_a_job_that_masks_overlong_samples_warns_that_dropping_biases_length(fleet: Fleet) -> None:
    plugin = fleet.tmp / "constant_reward.py"
    plugin.write_text("def score(completion, answer):\n    return 0.5\n")
    job_id = fleet.submit(
        "drop-skew",
        steps=3,
        sampling={"max_tokens": MAX_TOKENS, "stop_token_ids": STOP_IDS, "seeded": True},  # the same drops every run
        algorithm={"overlong": "mask"},
        reward=f"{plugin}:score",
        drop_skew={"max_shift": 0.1, "min_dropped": 8},
    )
    job = fleet.wait(job_id)
    assert job["state"] == "finished", job
    skew = job["drop_skew"]
    dropped, trained = skew["dropped"], skew["trained"]
    assert set(skew["by_reason"]) == {"overlong"}, skew  # nothing else drops in this job
    assert dropped["count"] >= 8 and trained["count"] >= 1, skew
    assert dropped["count"] + trained["count"] == 3 * 4 * 4  # 3 steps of 4 groups of 4
    assert dropped["length"]["p10"] == dropped["length"]["p90"] == MAX_TOKENS  # every one cut at max_tokens
    assert trained["length"]["mean"] < MAX_TOKENS
    assert skew["shift"]["length"]["mean"] > 0.1 and skew["shift"]["length"]["quantile"] > 0
    assert skew["shift"]["reward"] == {"mean": 0.0, "quantile": 0.0}  # a constant reward: no skew
    (warning,) = skew["warnings"]
    assert warning.startswith(f"dropping biases completion length: the {dropped['count']} dropped samples average 6 ")
    # per step, as recorded: the last step's counts and the ledger's over-long rows agree
    metrics = job["last_metrics"]
    assert metrics["drop_skew/overlong/count"] == metrics["drop_skew/dropped/count"]
    assert metrics["drop_skew/trained/count"] + metrics["drop_skew/dropped/count"] == 16
    assert "dropping biases completion length" in fleet.log("trainer")
    shown = CliRunner().invoke(app, ["status", job_id, "--api", fleet.api])
    assert shown.exit_code == 0, shown.output
    assert f"drop skew: {dropped['count']} dropped (overlong {dropped['count']})" in shown.stderr
    assert "warning: dropping biases completion length" in shown.stderr


def test_a_job_that_drops_nothing_shows_no_skew(fleet: Fleet) -> None:
    job = fleet.wait(fleet.submit("no-drops", steps=2))
    assert job["state"] == "finished", job
    assert "dropped" not in job["samples"], job["samples"]
    skew = job["drop_skew"]
    assert (skew["trained"]["count"], skew["dropped"]["count"]) == (2 * 4 * 4, 0)
    assert skew["by_reason"] == {} and skew["warnings"] == []
    assert skew["shift"] == {"length": None, "reward": None}
    shown = CliRunner().invoke(app, ["status", job["id"], "--api", fleet.api])
    assert shown.exit_code == 0 and "drop skew" not in shown.stderr, shown.output
