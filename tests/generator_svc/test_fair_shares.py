"""Several jobs' turns on one engine (generator_svc/tenants.py): fair shares by hand-computed
virtual times, the gate with threads, and each sample's bill (generator_svc/service.py `billed`)."""

from __future__ import annotations

import threading
import time

import pytest

from generator_svc.service import billed
from generator_svc.tenants import EngineView, FairGate, FairShares
from shared.schema import Rollout, pack_f32, pack_i32


def test_fair_shares_by_hand() -> None:
    f = FairShares()
    f.join("a", 1.0)
    f.join("b", 2.0)
    assert f.pick(["a", "b"]) == "a"  # both at 0: the first to arrive
    f.charge("a", 1.0)  # a: 1.0 / 1 = 1.0
    assert f.pick(["a", "b"]) == "b"
    f.charge("b", 1.0)  # b: 1.0 / 2 = 0.5
    assert f.pick(["a", "b"]) == "b"
    f.charge("b", 1.0)  # b: 1.0
    assert f.pick(["b", "a"]) == "b"  # a tie at 1.0: the first waiting
    f.charge("b", 1.0)  # b: 1.5
    assert f.pick(["a", "b"]) == "a"
    assert f.vtime == {"a": 1.0, "b": 1.5}


def test_a_job_that_idled_is_not_owed_the_time_it_did_not_use_but_a_busy_one_keeps_its_place() -> None:
    f = FairShares()
    f.join("busy", 1.0)
    f.join("idle", 1.0)
    f.join("between", 1.0)
    for _ in range(5):  # "idle" has nothing to generate: only the others come to the gate
        for job in ("busy", "between"):
            f.start(job)
            f.charge(job, 1.0)
    f.charge("between", -1.0)  # "between" is one call behind "busy": it was away between its calls
    f.start("idle", floor=5.0)  # back from idle: lifted to the least time of the jobs active meanwhile
    f.start("between")  # busy: no floor, it keeps its place (4.0) and goes first
    assert f.vtime == {"busy": 5.0, "idle": 5.0, "between": 4.0}
    assert f.pick(["busy", "idle", "between"]) == "between"
    f.charge("between", 1.0)
    assert f.pick(["busy", "idle", "between"]) == "busy"  # then level: not five turns owed to "idle"


def test_a_share_must_be_positive() -> None:
    with pytest.raises(ValueError, match="share must be > 0"):
        FairShares().join("a", 0.0)


class FakeEngine:
    """Records each call's tenants; a call 'takes' one second of a fake clock; 3 tokens a sample."""

    def __init__(self, clock: list[float]):
        self.clock, self.calls = clock, []

    def generate(self, prompts, params, n, tenant=""):
        self.calls.append(tenant)
        self.clock[0] += 1.0
        return [[type("S", (), {"completion_ids": [1, 2, 3]})()] for _ in prompts]

    def adapter_name(self, tenant=""):
        return f"{tenant}/v0#1"


def _queue_behind_holder(gate: FairGate, views: dict, jobs: tuple[str, ...]) -> list[threading.Thread]:
    """While "holder" has the engine, each of `jobs` comes to the gate (in that order) with a generate call."""
    threads = []
    with gate.turn("holder"):
        for job in jobs:
            threads.append(threading.Thread(target=views[job].generate, args=(["p"], [None], [1])))
            threads[-1].start()
            deadline = time.monotonic() + 10
            while len(gate._waiting) < len(threads) and time.monotonic() < deadline:
                time.sleep(0.001)
        assert [w.job for w in gate._waiting] == list(jobs)
    for t in threads:
        t.join(10)
    return threads


def _gate(*shares: tuple[str, float], hold: float = 0.1) -> tuple[FairGate, FakeEngine, dict]:
    clock = [0.0]
    gate = FairGate(clock=lambda: clock[0], max_hold_s=hold)
    engine = FakeEngine(clock)
    for job, share in (*shares, ("holder", 1.0)):
        gate.join(job, share)
    return gate, engine, {j: EngineView(engine, gate, j) for j, _ in shares}


def test_jobs_waiting_together_are_generated_in_one_call_each_with_its_adapter() -> None:
    gate, engine, views = _gate(("a", 1.0), ("b", 1.0))
    _queue_behind_holder(gate, views, ("a", "b"))
    assert engine.calls == [["a", "b"]]  # one engine call, each prompt its job's adapter
    load = gate.load()
    # the call's 1 s charged by tokens: 3 and 3
    assert load["a"] == {"share": 1.0, "seconds": 0.5, "tokens": 3, "calls": 1}
    assert load["b"] == load["a"] and load["holder"]["seconds"] == 0.0
    assert views["a"].busy_s == pytest.approx(0.5) and views["a"].adapter_name() == "a/v0#1"


def test_a_job_ahead_of_its_share_waits_out_a_call() -> None:
    gate, engine, views = _gate(("a", 1.0), ("b", 1.0))
    views["a"].generate(["p"], [None], [1])
    views["a"].generate(["p"], [None], [1])  # a alone: 2 s; the last call lasted 1 s
    assert engine.calls == ["a", "a"] and gate._fair.vtime["a"] == 2.0
    _queue_behind_holder(gate, views, ("a", "b"))
    # b (at 0, lifted to the last turn's 2.0? no: start() lifts to `now`, the last granted job's time)
    assert engine.calls[2:] == ["b", "a"] or engine.calls[2:] == [["a", "b"]]
    assert gate.load()["b"]["calls"] == 1 and gate.load()["a"]["calls"] == 3


@pytest.mark.parametrize("shares", [(1.0, 2.0, 4.0), (1.0, 1.0, 1.0), (3.0, 1.0, 1.0)])
def test_busy_jobs_get_engine_time_in_proportion_to_their_shares_however_calls_merge(shares) -> None:
    """FairShares' policy, simulated: three jobs always waiting, each call's head picked fairly,
    the jobs within the last call's duration merged with it, a call of k jobs lasting 0.2 + 0.1 k s
    (a merged call costs more but less than its parts), its seconds split evenly (equal tokens)."""
    f = FairShares()
    jobs = ["x", "y", "z"]
    for job, share in zip(jobs, shares, strict=True):
        f.join(job, share)
    used = dict.fromkeys(jobs, 0.0)
    window, merged_calls = 0.0, 0
    for _ in range(600):
        for job in jobs:
            f.start(job)
        head = f.pick(jobs)
        batch = f.merged(head, jobs, window)
        window = 0.2 + 0.1 * len(batch)
        merged_calls += len(batch) > 1
        for job in batch:
            f.charge(job, window / len(batch))
            used[job] += window / len(batch)
    total, total_share = sum(used.values()), sum(shares)
    for job, share in zip(jobs, shares, strict=True):
        assert used[job] / total == pytest.approx(share / total_share, rel=0.05), used
    assert merged_calls > 200  # and many calls were merged (the throughput)


def test_equal_shares_always_merge() -> None:
    f = FairShares()
    for job in "ab":
        f.join(job, 1.0)
    f.charge("a", 0.3)  # a 0.3 ahead; the last call lasted 0.5
    assert f.pick(["a", "b"]) == "b" and f.merged("b", ["a", "b"], 0.5) == ["a", "b"]
    assert f.merged("b", ["a", "b"], 0.2) == ["b"]  # a is further ahead than one call: it waits


def test_a_busy_job_on_its_way_back_is_waited_for_and_merged() -> None:
    gate, engine, views = _gate(("a", 1.0), ("b", 1.0), hold=30.0)
    _queue_behind_holder(gate, views, ("a", "b"))  # both generated just now: "busy"
    b = threading.Thread(target=views["b"].generate, args=(["p"], [None], [1]))
    b.start()  # b is back first; a is still publishing what it generated
    time.sleep(0.05)
    assert engine.calls == [["a", "b"]] and b.is_alive()  # the engine is held for a (up to half a call)
    views["a"].generate(["p"], [None], [1])
    b.join(10)
    assert engine.calls == [["a", "b"], ["b", "a"]]  # merged again


def test_a_job_that_stays_away_is_waited_for_no_longer_than_the_hold() -> None:
    gate, engine, views = _gate(("a", 1.0), ("b", 1.0), hold=0.2)
    _queue_behind_holder(gate, views, ("a", "b"))
    t0 = time.monotonic()
    views["b"].generate(["p"], [None], [1])  # a does not come back (its trainer has not fed it)
    assert 0.1 <= time.monotonic() - t0 < 5 and engine.calls == [["a", "b"], "b"]


def test_one_call_at_a_time() -> None:
    gate, inside, most = FairGate(), [0], [0]

    def call(job: str) -> None:
        with gate.turn(job):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            time.sleep(0.002)
            inside[0] -= 1

    threads = [threading.Thread(target=lambda j=j: [call(j) for _ in range(10)]) for j in "abc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert most[0] == 1


def _rollout(i: int, tokens: int) -> Rollout:
    return Rollout(
        job_id="job1",
        msg_id=f"job1/g{i}/0",
        group_id=f"job1/g{i}",
        policy_version=0,
        policy_version_max=0,
        purpose="train",
        prompt_index=i,
        sample_index=0,
        group_size=1,
        generator_id="gen-0",
        prompt_ids=pack_i32([1]),
        completion_ids=pack_i32(list(range(2, 2 + tokens))),
        logprobs=pack_f32([-0.5] * tokens),
        completion="x" * tokens,
        answer="x",
    )


def test_each_sample_is_billed_its_tokens_share_of_the_call() -> None:
    per_entry = [("1-0", [_rollout(0, 1), _rollout(1, 3)]), ("2-0", [_rollout(2, 4)])]
    out = billed(per_entry, "job1/v3#7", 2.0)
    seconds = [r.gen_seconds for _, rs in out for r in rs]
    assert seconds == pytest.approx([0.25, 0.75, 1.0])  # 1, 3 and 4 of 8 tokens, of 2 s
    assert {r.adapter for _, rs in out for r in rs} == {"job1/v3#7"}
    assert [e for e, _ in out] == ["1-0", "2-0"]
