"""The capacity bench's measurements run end to end on a small scale (bench/capacity.py): real
redis-server, real PostgreSQL, the services' stream and ledger code."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from bench.capacity import bench_ledger_queries, bench_ledger_writes, redis_shard, run_chain


def test_the_three_streams_carry_every_sample() -> None:
    with redis_shard() as url:
        r = run_chain(url, tokens=64, prompt_tokens=16, samples=128, generators=2, samples_per_step=32, idle_s=0.2)
    assert r["samples"] == 128 and r["steps"] == 4
    assert r["redis_cpu_s"] > 0 and r["redis_cpu_s_per_sample"] >= 0  # tiny runs are within the idle noise
    assert r["rollout_bytes"] < r["scored_bytes"] < 2 * r["rollout_bytes"]
    # the feeder keeps k + 1 = 2 steps in flight: nothing trained is older than that
    assert 0 <= r["staleness_mean"] <= r["staleness_max"] <= 2


def test_ledger_writes_and_queries(postgres_database: Callable[[], AbstractContextManager[str]]) -> None:
    with postgres_database() as url:
        w = bench_ledger_writes(url, tokens=64, samples=256)
    assert set(w["phases"]) == {"generated", "generated_again", "scored", "trained"}
    assert all(p["rows"] == 256 and p["rows_per_s"] > 0 for p in w["phases"].values())
    # the second insert of each row is a no-op: it writes (almost) no WAL, the first one does
    assert w["phases"]["generated"]["wal_bytes_per_row"] > 10 * w["phases"]["generated_again"]["wal_bytes_per_row"]
    with postgres_database() as url:
        q = bench_ledger_queries(url, rows=2000)
    for state in ("without_job_id_id_index", "with_job_id_id_index"):
        assert set(q["queries"][state]) == {"big", "small"}
        assert all(t > 0 for t in q["queries"][state]["big"].values())
