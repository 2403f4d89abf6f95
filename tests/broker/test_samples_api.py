"""GET /jobs/{id}/samples: filters, pagination, and errors, over a ledger filled directly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from uuid import uuid4

import pytest
from fastapi.testclient import TestClient

from broker.api import create_app
from broker.ledger import Ledger
from broker.streams import connect
from shared.settings import BrokerSettings

REDIS_URL = "redis://127.0.0.1:6379/0"
SPEC = {"name": "tiny", "model_path": "models/tiny", "group_size": 4, "steps": 3, "max_staleness": 1}
RW, RO = "rw-secret-token", "ro-secret-token"
FIELDS = {
    "msg_id",
    "group_id",
    "sample_index",
    "kind",
    "prompt_index",
    "generator_id",
    "adapter",
    "gen_seconds",
    "gen_version_min",
    "gen_version_max",
    "trainer_version",
    "staleness",
    "reward",
    "status",
    "completion",
    "num_completion_tokens",
    "created_at",
}
TRAIN = [f"s{i:02d}" for i in range(12)]
# Inserted after TRAIN although their msg_ids sort first: pages follow insertion order.
EVAL = ["a-eval-0", "a-eval-1"]


@pytest.fixture
def client(tmp_path) -> Iterator[tuple[TestClient, Ledger]]:
    prefix = f"test-{uuid4().hex}:"
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    settings = BrokerSettings(redis_url=REDIS_URL, stream_prefix=prefix, tokens=RW, read_only_tokens=RO)
    r = connect(REDIS_URL)
    try:
        with TestClient(create_app(settings, ledger=ledger), headers={"Authorization": f"Bearer {RW}"}) as c:
            yield c, ledger
    finally:
        keys = list(r.scan_iter(match=f"{prefix}*"))
        if keys:
            r.delete(*keys)
        ledger.close()


def _sample(msg_id: str, job_id: str, gen_version: int, **extra: Any) -> dict[str, Any]:
    return {
        "msg_id": msg_id,
        "job_id": job_id,
        "group_id": f"g-{msg_id}",
        "sample_index": 0,
        "prompt_index": 7,
        "generator_id": "gen-0",
        "gen_version_min": gen_version,
        "num_prompt_tokens": 5,
        "num_completion_tokens": 9,
        "completion": f"completion of {msg_id}",
        **extra,
    }


def _fill(ledger: Ledger, job: str) -> None:
    """s00..s11 (gen version i % 3): s00..s05 trained at trainer version 1,1,2,2,3,3 (staleness
    1,0,0,2,2,1), s06 dropped at 3 (staleness 3), s07..s09 scored, s10..s11 generated; rewards
    i/10 for s00..s09; each made by adapter <job>/v<i % 3>#1 in 0.5 s. Two eval samples (no
    adapter) evaluated at 3 (staleness 3) with rewards 1.0 and 0.0."""
    ledger.record_generated(
        [_sample(m, job, i % 3, adapter=f"{job}/v{i % 3}#1", gen_seconds=0.5) for i, m in enumerate(TRAIN)]
    )
    ledger.record_generated([_sample(m, job, 0, kind="eval") for m in EVAL])
    ledger.record_generated([_sample("other", "another-job", 0)])
    ledger.record_scored([(m, i / 10) for i, m in enumerate(TRAIN[:10])] + [(EVAL[0], 1.0), (EVAL[1], 0.0)])
    ledger.record_used(
        [{"msg_id": m, "status": "trained", "trainer_version": 1 + i // 2} for i, m in enumerate(TRAIN[:6])]
        + [{"msg_id": "s06", "status": "dropped", "trainer_version": 3, "drop_reason": "stale"}]
        + [{"msg_id": m, "status": "evaluated", "trainer_version": 3} for m in EVAL]
    )


@pytest.fixture
def job(client) -> str:
    c, ledger = client
    r = c.post("/jobs", json=SPEC)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    _fill(ledger, job_id)
    return job_id


def _ids(body: dict[str, Any]) -> list[str]:
    return [s["msg_id"] for s in body["items"]]


def _get(c: TestClient, job: str, **params: Any) -> dict[str, Any]:
    r = c.get(f"/jobs/{job}/samples", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_lists_every_sample_of_the_job_in_insertion_order_with_its_fields(client, job):
    c, _ = client
    body = _get(c, job)
    assert _ids(body) == TRAIN + EVAL  # not msg_id order, and not the other job's sample
    assert (body["total"], body["limit"], body["offset"]) == (14, 100, 0)
    assert all(set(s) == FIELDS for s in body["items"])
    s03 = body["items"][3]
    assert {
        k: s03[k]
        for k in (
            "kind",
            "status",
            "gen_version_min",
            "gen_version_max",
            "adapter",
            "gen_seconds",
            "trainer_version",
            "staleness",
            "reward",
            "completion",
            "num_completion_tokens",
        )
    } == {
        "kind": "train",
        "status": "trained",
        "gen_version_min": 0,
        "gen_version_max": 0,
        "adapter": f"{job}/v0#1",
        "gen_seconds": 0.5,
        "trainer_version": 2,
        "staleness": 2,
        "reward": 0.3,
        "completion": "completion of s03",
        "num_completion_tokens": 9,
    }


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"status": "trained"}, TRAIN[:6]),
        ({"status": "dropped"}, ["s06"]),
        ({"status": "scored"}, ["s07", "s08", "s09"]),
        ({"status": "generated"}, ["s10", "s11"]),
        ({"status": "evaluated"}, EVAL),
        ({"kind": "eval"}, EVAL),
        ({"kind": "train"}, TRAIN),
        ({"min_step": 2, "max_step": 2}, ["s02", "s03"]),
        ({"min_step": 3}, ["s04", "s05", "s06", *EVAL]),
        ({"max_step": 1}, ["s00", "s01"]),  # unused samples have no step: never in a step range
        ({"min_staleness": 2}, ["s03", "s04", "s06", *EVAL]),
        ({"max_staleness": 0}, ["s01", "s02"]),
        ({"min_staleness": 1, "max_staleness": 1}, ["s00", "s05"]),
        ({"min_reward": 0.5}, ["s05", "s06", "s07", "s08", "s09", EVAL[0]]),
        ({"max_reward": 0.1}, ["s00", "s01", EVAL[1]]),  # unscored samples have no reward
        ({"kind": "train", "status": "trained", "min_reward": 0.3}, ["s03", "s04", "s05"]),
        ({"status": "trained", "min_step": 3, "max_staleness": 1}, ["s05"]),
        ({"min_reward": 0.95, "max_reward": 0.05}, []),
    ],
)
def test_filters(client, job, params, expected):
    c, _ = client
    body = _get(c, job, **params)
    assert _ids(body) == expected
    assert body["total"] == len(expected)


def test_pages_are_stable_and_total_counts_every_match(client, job):
    c, ledger = client
    pages = [_get(c, job, limit=5, offset=o) for o in (0, 5, 10, 15)]
    assert [len(p["items"]) for p in pages] == [5, 5, 4, 0]
    assert [p["total"] for p in pages] == [14] * 4
    assert [(p["limit"], p["offset"]) for p in pages] == [(5, 0), (5, 5), (5, 10), (5, 15)]
    assert [m for p in pages for m in _ids(p)] == TRAIN + EVAL
    # New samples append: earlier pages do not shift.
    ledger.record_generated([_sample("0-new", job, 4)])
    assert _ids(_get(c, job, limit=5, offset=5)) == _ids(pages[1])
    assert _get(c, job, limit=5, offset=10)["items"][-1]["msg_id"] == "0-new"
    # Filters and pages combine; total ignores the page.
    body = _get(c, job, status="trained", limit=4, offset=4)
    assert (_ids(body), body["total"]) == (["s04", "s05"], 6)


def test_unknown_job_is_404_and_bad_parameters_are_422_with_a_message(client, job):
    c, _ = client
    r = c.get("/jobs/nope/samples")
    assert r.status_code == 404 and "no job 'nope'" in r.json()["error"]
    for params, word in (
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"offset": -1}, "offset"),
        ({"min_step": "abc"}, "min_step"),
        ({"min_reward": "nan"}, "min_reward"),
        ({"status": "vanished"}, "generated, scored, trained, dropped, evaluated, lost"),
        ({"kind": "test"}, "train, eval"),
    ):
        r = c.get(f"/jobs/{job}/samples", params=params)
        assert r.status_code == 422, (params, r.text)
        assert word in r.json()["error"], (params, r.text)
    assert _get(c, job, limit=1000)["limit"] == 1000


def test_read_only_tokens_may_browse_and_anonymous_callers_may_not(client, job):
    c, _ = client
    r = c.get(f"/jobs/{job}/samples", headers={"Authorization": f"Bearer {RO}"})
    assert r.status_code == 200 and r.json()["total"] == 14
    assert c.get(f"/jobs/{job}/samples", headers={"Authorization": ""}).status_code == 401
