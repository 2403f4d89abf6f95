"""A step that raises on its batch: bisected to the groups that raise on their own (isolation.py),
those dropped with the error and the rest kept for the step's next try (Parts.isolate,
TrainSink.isolate), the weights untouched meanwhile; an error no group alone raises stays the job's."""

from __future__ import annotations

import os
import uuid
from types import SimpleNamespace

import pytest
import torch

from bench.t_train import fake_batch
from broker.streams import DEAD, JobStreams, connect
from shared.jobspec import JobSpec
from shared.schema import DeadLetter
from trainer_svc.batch import TrainBatch
from trainer_svc.feeder import Group, dead_members
from trainer_svc.isolation import culprits
from trainer_svc.parts import Parts
from trainer_svc.sink import Batch, TrainSink, flatten_batch
from trainer_svc.validation import STEP_ERROR

# --- the bisection ------------------------------------------------------------------------------


def _probe(bad: set[int], calls: list[list[int]], pair: tuple[int, int] | None = None):
    def probe(items):
        calls.append(list(items))
        if bad & set(items) or (pair is not None and set(pair) <= set(items)):
            raise ValueError(f"bad {sorted(bad & set(items))}")

    return probe


def test_culprits_finds_each_item_that_fails_alone():
    calls: list[list[int]] = []
    found = culprits(list(range(8)), _probe({5}, calls))
    assert list(found) == [5] and str(found[5]) == "bad [5]"
    # the whole, then one half per level down to the culprit, each passing half cleared whole
    assert len(calls) == 1 + 2 * 3
    calls.clear()
    assert sorted(culprits(list(range(8)), _probe({0, 6}, calls))) == [0, 6]
    assert culprits(list(range(8)), _probe(set(), [])) == {}  # nothing fails: no culprit
    assert culprits([], _probe({1}, [])) == {}


def test_a_failure_that_needs_two_items_together_names_no_culprit():
    assert culprits(list(range(8)), _probe(set(), [], pair=(1, 6))) == {}


# --- the learner's probe, and the step that raises -----------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from asyncrl.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("m") / "tiny", layers=1, hidden=32, heads=2, intermediate=64, seed=0
    )


@pytest.fixture(scope="module")
def learner(tiny):
    from trainer_svc.learner import Learner

    spec = JobSpec(model_path=str(tiny), group_size=2, prompts_per_step=3, sampling={"max_tokens": 4})
    return Learner(spec, "cpu")


def _groups(learner, poisoned: int | None = None) -> list[Group]:
    """Three groups of two; group `poisoned` sampled at temperature 0 (what the sink refuses, made
    here by hand to reach the step): the logprobs cannot be taken at it, the step raises."""
    groups = fake_batch(3, 2, 4, learner.model.config.vocab_size)
    if poisoned is not None:
        g = groups[poisoned]
        g.samples = {
            m: s.model_copy(update={"rollout": s.rollout.model_copy(update={"temperature": 0.0})})
            for m, s in g.samples.items()
        }
    return groups


def _weights(learner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.model.parameters()]


def test_a_step_that_raises_and_the_probe_change_nothing(learner):
    before, opt = _weights(learner), dict(learner.optimizer.state)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        learner.step(TrainBatch.of(*flatten_batch(_groups(learner, poisoned=1))))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        learner.check(TrainBatch.of(*flatten_batch(_groups(learner, poisoned=1))))
    learner.check(TrainBatch.of(*flatten_batch(_groups(learner))))
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(learner), strict=True))
    assert dict(learner.optimizer.state) == opt and all(p.grad is None for p in learner.model.parameters())


class _Sink:
    def __init__(self) -> None:
        self.isolated: list[dict[str, str]] = []

    def isolate(self, b, bad) -> None:
        self.isolated.append(bad)


def _parts(learner) -> SimpleNamespace:
    """What Parts.isolate uses of the parts: the ranks, the learner and the sink."""
    return SimpleNamespace(ranks=learner.ranks, learner=learner, sink=_Sink())


def _batch(groups: list[Group], redo: list[str] | None = None) -> Batch:
    return Batch(step=1, version=0, bound=1, redo=redo, groups=groups)


def test_parts_isolate_drops_the_group_that_raises_alone(learner):
    before = _weights(learner)
    groups = _groups(learner, poisoned=2)
    p = _parts(learner)
    assert Parts.isolate(p, _batch(groups), ValueError("temperature must be > 0, got 0.0"))
    ((bad,),) = [list(d.items()) for d in p.sink.isolated]
    assert bad[0] == groups[2].group_id and "ValueError: temperature must be > 0" in bad[1]
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(learner), strict=True))


def test_an_error_no_group_raises_alone_stays_the_jobs(learner):
    p = _parts(learner)
    assert not Parts.isolate(p, _batch(_groups(learner)), RuntimeError("a transient failure"))
    every = _groups(learner)
    for g in every:  # every group of a batch of several raises alone: not one input's fault
        g.samples = {
            m: s.model_copy(update={"rollout": s.rollout.model_copy(update={"temperature": 0.0})})
            for m, s in g.samples.items()
        }
    assert not Parts.isolate(p, _batch(every), ValueError("temperature"))
    poisoned = _groups(learner, poisoned=0)  # a predecessor's step, re-done: its groups are fixed
    assert not Parts.isolate(p, _batch(poisoned, redo=[g.group_id for g in poisoned]), ValueError("x"))
    assert p.sink.isolated == []


# --- the sink: the culprits dropped, the others back in line --------------------------------------


class _Rows:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def record_used(self, items: list[dict]) -> int:
        self.rows += items
        return len(items)


class _Feeder:
    def __init__(self, groups: list[str]) -> None:
        self.in_flight = set(groups)

    def done(self, gid: str) -> None:
        self.in_flight.discard(gid)


def test_the_sink_drops_the_culprits_and_puts_the_rest_back(learner):
    streams = JobStreams(
        connect(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")), "bench", prefix=f"test-{uuid.uuid4().hex}:"
    )
    try:
        spec = JobSpec(model_path="m", group_size=2, prompts_per_step=3)
        groups = _groups(learner)
        for i, g in enumerate(groups):
            g.entries = [f"{i}-0", f"{i}-1"]
        feeder, rows = _Feeder([g.group_id for g in groups]), _Rows()
        sink = TrainSink(spec, streams, rows, feeder, None, None, 100)
        b = _batch(groups)
        b.dropped = [{"msg_id": "b/g9/0", "status": "dropped", "trainer_version": 0, "drop_reason": "staleness > 1"}]
        sink.isolate(b, {groups[1].group_id: "ValueError: temperature must be > 0, got 0.0"})
        assert set(sink.ready) == {groups[0].group_id, groups[2].group_id}
        assert feeder.in_flight == set(sink.ready)
        dropped = [r for r in rows.rows if r["msg_id"].startswith(groups[1].group_id + "/")]
        assert len(dropped) == 2 and all(r["status"] == "dropped" for r in dropped)
        assert dropped[0]["drop_reason"].startswith(f"{STEP_ERROR}: the training step raises on this group alone")
        assert any(r["msg_id"] == "b/g9/0" for r in rows.rows)  # what filling the batch dropped, recorded
        dead = streams.read_broadcast(DEAD, "0", DeadLetter)[1]
        assert [d.entry_id for d in dead] == ["1-0", "1-1"] and {d.code for d in dead} == {STEP_ERROR}
        assert all(dead_members(d) == [] for d in dead)  # the trainer settled the group itself
        assert sink.take_rejected() == 2
    finally:
        streams.delete_all()
