"""Per-job accounting in the ledger (migration 0010): which adapter produced each sample, its
generator-seconds, and `Ledger.usage`, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
from alembic import command
from sqlalchemy import inspect, text

from broker.ledger import Ledger
from broker.ledger.engine import _alembic_config
from broker.ledger.rows import UsageGroup
from broker.ledger.samples import fold_usage
from broker.runtime import sample_row
from shared.schema import Rollout, pack_f32, pack_i32
from tests.broker.test_ledger import HEAD, sample


def test_0010_adds_nullable_adapter_and_gen_seconds_and_keeps_old_rows(ledger_url: str) -> None:
    old = Ledger(ledger_url, migrate=False)
    old.upgrade("0009")
    with old.engine.begin() as conn:  # a sample as 0009 stored it
        conn.execute(
            text(
                "INSERT INTO samples (msg_id, job_id, group_id, sample_index, kind, prompt_index, generator_id, "
                "gen_version_min, gen_version_max, num_prompt_tokens, num_completion_tokens, completion, status, "
                "created_at) VALUES ('j1/g0/0', 'j1', 'j1/g0', 0, 'train', 0, 'gen-0', 0, 0, 3, 2, '42', "
                "'generated', :t)"
            ),
            {"t": datetime.now(timezone.utc)},
        )
    old.close()
    with Ledger(ledger_url) as new:  # upgrades to head on open
        assert new.current_revision() == HEAD
        columns = {c["name"]: c for c in inspect(new.engine).get_columns("samples")}
        assert columns["adapter"]["nullable"] and columns["gen_seconds"]["nullable"]
        assert getattr(columns["adapter"]["type"], "length", None) == 200
        (row,) = new.samples("j1")
        assert (row["adapter"], row["gen_seconds"]) == (None, None)
        # an old sample counts, with 0 seconds
        usage = new.usage("j1")
        assert (usage["samples"], usage["generator_seconds"], usage["completion_tokens"]) == (1, 0.0, 2)
        # and down again: the columns go, the row stays
        with new.engine.begin() as conn:
            command.downgrade(_alembic_config(conn), "0009")
        assert {"adapter", "gen_seconds"}.isdisjoint(c["name"] for c in inspect(new.engine).get_columns("samples"))
        new.upgrade()
        assert [s["msg_id"] for s in new.samples("j1")] == ["j1/g0/0"]


def test_usage_sums_a_jobs_samples_by_generator_and_kind(ledger: Ledger) -> None:
    ledger.record_generated(
        [
            sample("m1", job_id="j", generator_id="gen-0", adapter="job-j/v1#1", gen_seconds=0.25),
            sample(
                "m2", job_id="j", generator_id="gen-0", adapter="job-j/v1#1", gen_seconds=0.5, num_completion_tokens=3
            ),
            sample(
                "m3",
                job_id="j",
                generator_id="gen-1",
                adapter="job-j/v2#2",
                gen_seconds=1.0,
                num_prompt_tokens=4,
                num_completion_tokens=10,
            ),
            sample(
                "m4",
                job_id="j",
                generator_id="gen-1",
                kind="eval",
                gen_seconds=0.125,
                num_prompt_tokens=6,
                num_completion_tokens=2,
            ),
            sample("other", job_id="k", generator_id="gen-0", adapter="job-k/v1#3", gen_seconds=100.0),
        ]
    )
    # a dropped sample took its generate time too: still counted
    ledger.record_used([{"msg_id": "m3", "status": "dropped", "trainer_version": 5, "drop_reason": "stale"}])
    # By hand (sample() gives 5 prompt and 9 completion tokens):
    #   seconds 0.25 + 0.5 + 1.0 + 0.125 = 1.875; prompt 5 + 5 + 4 + 6 = 20; completion 9 + 3 + 10 + 2 = 24
    #   gen-0: m1, m2 -> 0.75 s, 12 tokens; gen-1: m3, m4 -> 1.125 s, 12 tokens
    #   train: m1..m3 -> 1.75 s, 14 prompt, 22 completion; eval: m4 -> 0.125 s, 6, 2
    #   adapters: job-j/v1#1 and job-j/v2#2 (m4 has none; job k's is not j's)
    assert ledger.usage("j") == {
        "generator_seconds": 1.875,
        "samples": 4,
        "prompt_tokens": 20,
        "completion_tokens": 24,
        "by_generator": {
            "gen-0": {"seconds": 0.75, "samples": 2, "completion_tokens": 12},
            "gen-1": {"seconds": 1.125, "samples": 2, "completion_tokens": 12},
        },
        "by_kind": {
            "train": {"generator_seconds": 1.75, "samples": 3, "prompt_tokens": 14, "completion_tokens": 22},
            "eval": {"generator_seconds": 0.125, "samples": 1, "prompt_tokens": 6, "completion_tokens": 2},
        },
        "adapters": 2,
    }


def test_usage_of_a_job_without_samples_is_zero(ledger: Ledger) -> None:
    zero = {"generator_seconds": 0.0, "samples": 0, "prompt_tokens": 0, "completion_tokens": 0}
    assert ledger.usage("none") == {**zero, "by_generator": {}, "by_kind": {"train": zero, "eval": zero}, "adapters": 0}


def test_fold_usage_adds_groups_up() -> None:
    groups = [
        UsageGroup("train", "gen-b", samples=4, seconds=2.5, prompt_tokens=40, completion_tokens=100),
        UsageGroup("eval", "gen-b", samples=2, seconds=0.5, prompt_tokens=20, completion_tokens=10),
        UsageGroup("train", "gen-a", samples=1, seconds=0.25, prompt_tokens=10, completion_tokens=7),
    ]
    got = fold_usage(groups, adapters=3)
    # 2.5 + 0.5 + 0.25 = 3.25 s; 4 + 2 + 1 = 7 samples; 40 + 20 + 10 = 70; 100 + 10 + 7 = 117
    assert (got["generator_seconds"], got["samples"], got["prompt_tokens"], got["completion_tokens"]) == (
        3.25,
        7,
        70,
        117,
    )
    assert list(got["by_generator"]) == ["gen-a", "gen-b"]  # sorted
    assert got["by_generator"]["gen-b"] == {"seconds": 3.0, "samples": 6, "completion_tokens": 110}
    assert got["by_kind"]["train"] == {
        "generator_seconds": 2.75,
        "samples": 5,
        "prompt_tokens": 50,
        "completion_tokens": 107,
    }
    assert got["adapters"] == 3


def _rollout(**extra: Any) -> Rollout:
    return Rollout(
        job_id="j",
        msg_id="j/g0/0",
        group_id="j/g0",
        policy_version=3,
        policy_version_max=3,
        prompt_index=0,
        sample_index=0,
        group_size=2,
        generator_id="gen-0",
        prompt_ids=pack_i32([1, 2]),
        completion_ids=pack_i32([3]),
        logprobs=pack_f32([-0.5]),
        completion="x",
        answer="x",
        **extra,
    )


@pytest.mark.parametrize(("adapter", "stored"), [("job-j/v3#7", "job-j/v3#7"), ("", None)])
def test_sample_row_records_the_adapter_and_seconds(ledger: Ledger, adapter: str, stored: str | None) -> None:
    r = _rollout(adapter=adapter, gen_seconds=0.375)
    row = sample_row(r)
    assert (row["adapter"], row["gen_seconds"]) == (stored, 0.375)
    assert ledger.record_generated([row]) == 1
    (got,) = ledger.samples("j")
    assert (got["adapter"], got["gen_seconds"]) == (stored, 0.375)
