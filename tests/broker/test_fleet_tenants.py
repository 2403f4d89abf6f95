"""Several jobs on one fleet, the coordination part (broker/fleet.py): the trainers' leases (several
trainers, never one job twice), which jobs a follower joins first, on the real Redis and a SQLite
ledger."""

from __future__ import annotations

import time
from pathlib import Path
from uuid import uuid4

import pytest

from broker import fleet as fleet_mod
from broker.fleet import Beacon, Fleet, JobLease
from broker.ledger import Ledger
from broker.streams import connect
from shared.settings import GeneratorSettings, TrainerSettings

REDIS_URL = "redis://127.0.0.1:6379/0"
SPEC = {"model_path": "/nonexistent/model", "steps": 2}


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path}/ledger.db"
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("REDIS_URL", REDIS_URL)
    monkeypatch.setenv("STREAM_PREFIX", f"t-{uuid4().hex[:8]}:")
    monkeypatch.delenv("JOB_ID", raising=False)
    return url


def test_a_lease_is_one_trainers_until_released_or_lapsed(monkeypatch: pytest.MonkeyPatch) -> None:
    redis, prefix = connect(REDIS_URL), f"t-{uuid4().hex[:8]}:"
    a, b = JobLease(redis, prefix, "trainer-a"), JobLease(redis, prefix, "trainer-b")
    assert a.take("j1")
    assert not b.take("j1") and b.holder("j1") == "trainer-a"
    assert a.take("j1")  # its own lease again: a trainer restarted under its id takes its job back at once
    a.renew()
    a.release()
    assert b.take("j1") and b.holder("j1") == "trainer-b"
    a.job = "j1"
    a.release()  # not a's any more: nothing happens
    assert b.holder("j1") == "trainer-b"
    monkeypatch.setattr(fleet_mod, "LEASE_S", 0.3)
    c = JobLease(redis, prefix, "trainer-c")
    assert c.take("j2")
    time.sleep(0.5)  # c died: its lease lapses
    assert b.take("j2")
    b.redis.delete(b.key("j2"))  # Redis came back empty
    b.renew()
    assert b.holder("j2") == "trainer-b"  # taken again


def test_two_trainers_take_two_jobs_and_a_dead_ones_job_after_its_lease(env: str) -> None:
    with Ledger(env) as ledger:
        ledger.create_job("first", "first", SPEC)
        time.sleep(0.01)
        ledger.create_job("second", "second", SPEC)
    t0, t1 = Fleet(TrainerSettings(), "trainer", "t0"), Fleet(TrainerSettings(), "trainer", "t1")
    try:
        assert t0._take()["id"] == "first"
        # "first" is running and leased to t0: t1 takes the queue's next, not t0's job
        assert t1._take()["id"] == "second"
        assert t0.lease.holder("first") == "t0" and t1.lease.holder("second") == "t1"
        assert t1._take() is None or t1.lease.job == "second"
        # t0 dies without a word (no release): its job waits for the lease to lapse, then a trainer resumes it
        t2 = Fleet(TrainerSettings(), "trainer", "t2")
        try:
            assert t2._take() is None
            t0.redis.pexpire(t0.lease.key("first"), 1)
            time.sleep(0.05)
            assert t2._take()["id"] == "first"
        finally:
            t2.close()
        # t1 finishes its job: the lease goes with it
        t1.served("second")
        assert t1.lease.holder("second") is None
    finally:
        t0.beacon._stop.set()  # a dead trainer releases nothing
        t1.close()


def test_a_claimed_job_another_trainer_leased_first_is_left_to_it(env: str) -> None:
    with Ledger(env) as ledger:
        ledger.create_job("only", "only", SPEC)
    t0 = Fleet(TrainerSettings(), "trainer", "t0")
    other = JobLease(t0.redis, t0.settings.stream_prefix, "t-other")
    try:
        assert other.take("only")  # the race: another trainer saw it running and leased it first
        assert t0._take() is None
        assert t0.ledger.get_job("only")["state"] == "running"  # claimed, and the other trains it
    finally:
        t0.close()


def test_followers_join_the_jobs_fewest_of_their_role_serve_first(env: str) -> None:
    with Ledger(env) as ledger:
        for name in ("old", "new"):
            ledger.create_job(name, name, SPEC, state="running")
            time.sleep(0.01)
    g = Fleet(GeneratorSettings(), "generator", "g0")
    other = Beacon(g.redis, g.settings.stream_prefix, "generator", "g1")
    try:
        assert [j["id"] for j in g._joinable_jobs(set())] == ["old", "new"]  # nobody serves either: oldest first
        other.set_jobs(["old"])
        assert [j["id"] for j in g._joinable_jobs(set())] == ["new", "old"]
        assert [j["id"] for j in g._joinable_jobs({"new"})] == ["old"]
        g.served("old")
        assert [j["id"] for j in g._joinable_jobs(set())] == ["new"]  # one it served to its end: never again
    finally:
        other.close()
        g.close()


def test_the_beacon_shows_every_job_and_the_load(env: str) -> None:
    g = Fleet(GeneratorSettings(), "generator", "g0")
    try:
        g.beacon.load = lambda: {"a": {"share": 2.0, "seconds": 1.5, "tokens": 10, "calls": 1}}
        g.beacon.set_jobs(["a", "b"])
        (entry,) = fleet_mod.fleet_members(g.redis, g.settings.stream_prefix)
        assert entry["jobs"] == ["a", "b"] and entry["job"] == "a" and entry["state"] == "serving"
        assert entry["load"]["a"]["tokens"] == 10
        g.beacon.set_jobs([])
        (entry,) = fleet_mod.fleet_members(g.redis, g.settings.stream_prefix)
        assert entry["jobs"] == [] and entry["job"] is None and entry["state"] == "idle"
    finally:
        g.close()
