"""The trainer's check of each scored sample against its job and group (trainer_svc/validation.py),
one rule at a time on hand-made samples, and what the train sink does with a sample that breaks
one: dead-lettered alone when it holds no member's place (the group trains whole), its group
dropped with the reason when it does, counted either way (issue 31)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from asyncrl.tiny_model import build_tokenizer
from broker.streams import DEAD, Delivery, JobStreams
from shared.jobspec import JobSpec
from shared.prompts import renderer
from shared.schema import DeadLetter, Rollout, Scored, pack_f32, pack_i32
from shared.tasks import Problem
from trainer_svc.evaluation import Evaluator
from trainer_svc.feeder import NOT_A_LOSS, DeadMember, Feeder, Group, dead_members
from trainer_svc.guard import CollapseGuard
from trainer_svc.sink import TrainSink
from trainer_svc.validation import (
    INVALID_SAMPLE,
    NOT_A_MEMBER,
    RULES,
    Fed,
    JobLimits,
    check,
)

JOB = JobLimits(job_id="job1", group_size=4, max_tokens=8, max_total_tokens=None, context=64)
GROUP = "job1/r1/g3"
PROMPT = [1, 5, 6]
FED = Fed(4, prompt_index=3, prompt_ids=np.array(PROMPT, dtype=np.int32), temperature=0.7)


def _sample(group: str = GROUP, i: int = 1, job: str = "job1", **rollout: Any) -> Scored:
    """Sample `i` of `group` as the job fed it; `rollout` overrides fields of the rollout."""
    fields: dict[str, Any] = {
        "job_id": job,
        "msg_id": f"{group}/{i}",
        "group_id": group,
        "policy_version": 2,
        "policy_version_max": 2,
        "prompt_index": 3,
        "sample_index": i,
        "group_size": 4,
        "generator_id": "gen-0",
        "prompt_ids": pack_i32(PROMPT),
        "completion_ids": pack_i32([7, 8]),
        "logprobs": pack_f32([-0.5, -1.0]),
        "completion": "78",
        "answer": "4",
        "temperature": 0.7,
        **rollout,
    }
    r = Rollout(**fields)
    return Scored(job_id=r.job_id, msg_id=r.msg_id, group_id=r.group_id, policy_version=2, rollout=r, reward=1.0)


def _rule(s: Scored, job: JobLimits = JOB, fed: Fed | None = FED, newest: int | None = 5, peer=None) -> str | None:
    why = check(s, job, fed, newest, peer)
    return None if why is None else why.rule


def test_a_sample_as_fed_passes_every_rule():
    assert _rule(_sample()) is None
    assert _rule(_sample(), fed=None, newest=None) is None  # a group this run did not feed: job-wide rules only


# --- one rule at a time -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sample, rule",
    [
        # job: another job's sample on this job's stream, or this job's id on another job's group
        (_sample(job="job2", group="job2/r1/g3"), "job"),
        (_sample(group="job2/r1/g3"), "job"),
        (_sample(group="job10/r1/g3"), "job"),  # a job id that merely starts with this one's
        # ids: the msg_id is not {group}/{index}: a second sample under index 1 with a fresh msg_id
        (_sample(msg_id=f"{GROUP}/extra"), "ids"),
        (_sample(msg_id=f"{GROUP}/2"), "ids"),
        # version: from a policy the job has not published
        (_sample(policy_version=6, policy_version_max=6), "version"),
        (_sample(policy_version=2, policy_version_max=9), "version"),
        # temperature: greedy, vanishing, or another temperature than its group's
        (_sample(temperature=0.0), "temperature"),
        (_sample(temperature=1e-30), "temperature"),
        (_sample(temperature=0.71), "temperature"),
        # group_size: a member that disagrees with the job's groups (and one past its own group)
        (_sample(group_size=5), "group_size"),
        (_sample(i=4, group_size=5), "group_size"),
        (_sample(group_size=1, i=0), "group_size"),
        # tokens: no prompt, no completion, past max_tokens, past the model's context
        (_sample(prompt_ids=b""), "tokens"),
        (_sample(completion_ids=b"", logprobs=b""), "tokens"),
        (_sample(completion_ids=pack_i32([7] * 9), logprobs=pack_f32([-1.0] * 9)), "tokens"),
        (_sample(prompt_ids=pack_i32([1] * 200_000)), "tokens"),
        # prompt: another problem, or other ids than the group was fed
        (_sample(prompt_index=2), "prompt"),
        (_sample(prompt_ids=pack_i32([1, 5, 9])), "prompt"),
        (_sample(prompt_ids=pack_i32([*PROMPT, 2])), "prompt"),
        # episode: environment tokens or turns in a job without an environment
        (_sample(model_mask=bytes([1, 0]), logprobs=pack_f32([-0.5, 0.0])), "episode"),
        (_sample(turns=2), "episode"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_each_rule_names_what_the_sample_contradicts(sample: Scored, rule: str):
    assert rule in RULES
    why = check(sample, JOB, FED, 5)
    assert why is not None and why.rule == rule, why
    assert why.reason.startswith(f"{rule}: ") and len(why.detail) > 10


def test_the_temperature_tolerance_and_an_unknown_feed_temperature():
    # float64 on the wire, float32 in an engine: 1e-7 relative is the same temperature
    assert _rule(_sample(temperature=float(np.float32(0.7)))) is None
    assert _rule(_sample(temperature=0.7 * (1 + 2e-6))) == "temperature"
    # a group whose feed temperature the trainer does not know (a re-done step of a predecessor):
    # the job spec's range (0, 10]
    unknown = Fed(4, prompt_index=3, prompt_ids=FED.prompt_ids)
    assert _rule(_sample(temperature=2.5), fed=unknown) is None
    assert _rule(_sample(temperature=0.0), fed=unknown) == "temperature"
    assert _rule(_sample(temperature=10.5), fed=unknown) == "temperature"
    # an evaluation sample is not trained: greedy is its set's right
    ev = Fed(4, prompt_index=3, max_tokens=8)
    assert _rule(_sample(group="job1/r1/e0/3", i=0, temperature=0.0, purpose="eval"), fed=ev) is None


def test_evaluation_groups_are_held_to_their_sets_size_and_length():
    ev = Fed(2, prompt_index=3, max_tokens=16)
    s = _sample(group="job1/r1/e0/3", i=0, group_size=2, purpose="eval")
    assert _rule(s, fed=ev) is None
    assert _rule(_sample(group="job1/r1/e0/3", i=0, group_size=4, purpose="eval"), fed=ev) == "group_size"
    long = _sample(
        group="job1/r1/e0/3",
        i=0,
        group_size=2,
        purpose="eval",
        completion_ids=pack_i32([7] * 12),
        logprobs=pack_f32([-1.0] * 12),
    )
    assert _rule(long, fed=ev) is None  # within the set's own max_tokens of 16
    assert _rule(long, fed=Fed(2, prompt_index=3, max_tokens=8)) == "tokens"


def test_an_environments_episode_is_held_to_its_total_not_max_tokens():
    env = JobLimits(job_id="job1", group_size=4, max_tokens=8, max_total_tokens=20, context=64)
    episode = _sample(
        completion_ids=pack_i32([7] * 12),
        logprobs=pack_f32([-1.0] * 6 + [0.0] * 6),
        model_mask=bytes([1] * 6 + [0] * 6),
        turns=2,
        prompt_ids=pack_i32([1, 2, 3, 4]),  # the environment rendered its own opening
    )
    assert _rule(episode, job=env) is None
    assert _rule(_sample(completion_ids=pack_i32([7] * 18), logprobs=pack_f32([-1.0] * 18)), job=env) == "tokens"


def test_the_models_context_is_its_positions_times_a_rope_scaling_factor():
    from types import SimpleNamespace

    from trainer_svc.learner import model_context

    assert model_context(SimpleNamespace(max_position_embeddings=256)) == 256
    yarn = SimpleNamespace(max_position_embeddings=32768, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert model_context(yarn) == 131072  # what an engine serves: never refuse what it generated
    assert (
        model_context(SimpleNamespace()) is None
        and model_context(SimpleNamespace(max_position_embeddings=None)) is None
    )


def test_a_member_of_a_group_nobody_fed_must_agree_with_the_others():
    peer = _sample(i=0).rollout
    assert _rule(_sample(), fed=None, peer=peer) is None
    assert _rule(_sample(prompt_index=2), fed=None, peer=peer) == "group"
    assert _rule(_sample(purpose="eval"), fed=None, peer=peer) == "group"


# --- the sink: alone, or its group dropped ------------------------------------------------------


class _Rows:
    """The ledger's record_used, kept."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def record_used(self, items: list[dict]) -> int:
        self.rows += items
        return len(items)


class _Job:
    """A feeder and a sink on real Redis streams (trainer at version 0, k = 1, groups of 2)."""

    def __init__(self, streams: JobStreams):
        self.spec = JobSpec(
            model_path="m", prompts_per_step=2, group_size=2, max_staleness=1, sampling={"max_tokens": 8}
        )
        render = renderer(build_tokenizer())
        self.feeder = Feeder(streams, self.spec, [Problem(i, f"{i}+1=", str(i + 1)) for i in range(20)], render)
        evaluator = Evaluator(self.spec, {}, self.feeder, streams, None, "job1")
        self.ledger = _Rows()
        self.sink = TrainSink(
            self.spec, streams, self.ledger, self.feeder, evaluator, CollapseGuard(self.spec.guard, "aipo"), 100, 64
        )
        self.sink.newest_version = 0
        self.streams, self.n = streams, 0
        self.index: dict[str, int] = {}  # each group's problem, as it was fed
        self.feeder.top_up(0, 1)

    def sample(self, gid: str, i: int, **rollout: Any) -> Scored:
        if gid not in self.index:
            self.index[gid] = int(self.feeder.fed[gid][0])
        index = self.index[gid]
        fields = {
            "job_id": "job1",
            "msg_id": f"{gid}/{i}",
            "group_id": gid,
            "policy_version": 0,
            "policy_version_max": 0,
            "prompt_index": index,
            "sample_index": i,
            "group_size": 2,
            "generator_id": "gen-0",
            "prompt_ids": pack_i32(self.feeder.prompt_ids(index)),
            "completion_ids": pack_i32([7, 8]),
            "logprobs": pack_f32([-0.5, -1.0]),
            "completion": "78",
            "answer": "1",
            **rollout,
        }
        r = Rollout(**fields)
        return Scored(
            job_id=r.job_id, msg_id=r.msg_id, group_id=r.group_id, policy_version=0, rollout=r, reward=float(i)
        )

    def add(self, *samples: Scored) -> None:
        self.sink.add([Delivery(f"{self.n}-{k}", s) for k, s in enumerate(samples)], 0)
        self.n += 1

    def dead(self) -> list[DeadLetter]:
        return self.streams.read_broadcast(DEAD, "0", DeadLetter)[1]


def test_forged_copies_and_extra_members_are_dead_lettered_alone_and_the_group_trains_whole(streams):
    job = _Job(streams)
    g0, g1, *_ = job.feeder.feed_order()
    job.add(job.sample(g0, 0))
    job.add(
        job.sample(g0, 0, temperature=0.0),  # a forged copy of a member that arrived
        job.sample(g0, 1, msg_id=f"{g0}/1b"),  # a second sample under index 1
        job.sample(g0, 3, group_size=4),  # an extra member claiming a larger group
        job.sample(g1, 0, job_id="job2", group_id="job2/g1", msg_id="job2/g1/0"),  # another job's
    )
    job.add(job.sample(g0, 1))
    job.add(job.sample(g1, 0), job.sample(g1, 1))
    job.sink.begin(1, 0, 1)
    b = job.sink.take()
    assert b is not None and [g.group_id for g in b.groups] == [g0, g1] and len(b.samples) == 4
    assert all(s.rollout.temperature == 1.0 and s.rollout.group_size == 2 for s in b.samples)
    dead = job.dead()
    assert [d.code for d in dead] == [NOT_A_MEMBER] * 4
    assert [d.reason.split(":")[0] for d in dead] == ["temperature", "ids", "group_size", "job"]
    assert all(dead_members(d) == [] for d in dead) and NOT_A_MEMBER in NOT_A_LOSS  # they lose nothing
    assert job.sink.rejected == {"temperature": 1, "ids": 1, "group_size": 1, "job": 1}
    assert job.sink.take_rejected() == 4 and job.sink.take_rejected() == 0
    assert job.ledger.rows == []  # no row touched: none of them is a sample the job fed
    # a late copy of a group already used: held to what the group was fed as all the same
    job.sink.release(b)
    assert g0 not in job.feeder.in_flight
    job.add(job.sample(g0, 1, temperature=1e-30), job.sample(g0, 1))
    late = job.dead()[4:]
    assert [(d.code, d.reason.split(":")[0]) for d in late] == [(NOT_A_MEMBER, "temperature")]


def test_a_bad_sample_in_a_members_place_drops_its_group_with_the_reason(streams):
    job = _Job(streams)
    g0, g1, g2, g3 = job.feeder.feed_order()
    job.add(job.sample(g0, 0, temperature=0.0))  # first in its place: the member as far as anyone knows
    job.add(job.sample(g0, 1), job.sample(g0, 0))  # the good copy comes too late: its group is gone
    (d,) = job.dead()
    assert d.code == INVALID_SAMPLE and d.reason.startswith("temperature: sampled at temperature 0.0")
    assert {r["msg_id"] for r in job.ledger.rows} == {f"{g0}/0", f"{g0}/1"}
    assert all(r["status"] == "dropped" and "invalid_sample: temperature" in r["drop_reason"] for r in job.ledger.rows)
    assert g0 not in job.feeder.in_flight  # its slot is free for a refill
    assert job.sink.assembler.strays  # the late good copy is acked with the next release
    # a prompt of 200,000 tokens in g1's place, a group size that disagrees in g2's
    job.add(job.sample(g1, 1, prompt_ids=pack_i32([1] * 200_000)), job.sample(g1, 0))
    job.add(job.sample(g2, 0), job.sample(g2, 1, group_size=3))
    assert [d.code for d in job.dead()] == [INVALID_SAMPLE] * 3
    assert {g1, g2}.isdisjoint(job.feeder.in_flight)
    # the other groups go on: g3 and the refills make the step
    job.add(job.sample(g3, 0), job.sample(g3, 1))
    job.feeder.top_up(0, 1)
    g4 = job.feeder.feed_order()[1]
    job.add(job.sample(g4, 0), job.sample(g4, 1))
    job.sink.begin(1, 0, 1)
    b = job.sink.take()
    assert b is not None and [g.group_id for g in b.groups] == [g3, g4]


def test_a_dead_letter_cannot_resize_a_training_group(streams):
    """Anyone may write a dead letter: one whose payload claims another group size, or an index
    outside the group, neither closes a real group early nor makes it wait for members it lacks."""
    job = _Job(streams)
    g0, g1, *_ = job.feeder.feed_order()
    assert job.sink._as_fed([DeadMember(g0, 9, 7, "train", "x: y")]) == []
    assert job.sink._as_fed([DeadMember(g0, 9, 1, "train", "x: y")]) == [DeadMember(g0, 2, 1, "train", "x: y")]
    # an index outside the group never stands in for a missing member
    g = Group(g1, 2, dead={5: "x"})
    assert not g.complete
    g.dead[1] = "x"
    g.dead[0] = "x"
    assert g.complete


def test_a_resume_that_cannot_be_exact_names_the_dead_letter_not_redis(streams):
    job = _Job(streams)
    g0, g1, *_ = job.feeder.feed_order()
    job.sink.expect_replay({1: [g0, g1]})
    job.add(job.sample(g1, 0), job.sample(g1, 1))
    job.add(job.sample(g0, 0, temperature=0.0), job.sample(g0, 1))
    with pytest.raises(RuntimeError, match=rf"first: {g0}\); it was dead-lettered: invalid_sample: temperature"):
        job.sink.check_replay(0)
    other = _Job(streams)
    h0 = other.feeder.feed_order()[0]
    other.sink.expect_replay({1: [h0]})
    with pytest.raises(RuntimeError, match="no dead letter names it: Redis lost it"):
        other.sink.check_replay(0)


def test_slots_of_groups_dropped_for_a_rejected_member_are_fed_again(streams):
    """Every group in flight loses its member 0 to a forgery: the four are dropped as they complete,
    and the read that dropped them feeds four more (otherwise the step would wait for ever)."""
    from types import SimpleNamespace

    from shared.metrics import Phases
    from trainer_svc.parts import Parts

    job = _Job(streams)
    groups = job.feeder.feed_order()
    got = [
        Delivery(f"9-{k}-{i}", job.sample(g, i, temperature=0.0 if i == 0 else 1.0))
        for k, g in enumerate(groups)
        for i in range(2)
    ]
    fed: list[int] = []
    parts = SimpleNamespace(
        ranks=SimpleNamespace(keepalive=lambda: None),
        prom=SimpleNamespace(phases=Phases("trainer")),
        scored_in=SimpleNamespace(consume=lambda *a, **k: got),
        reader=None,
        sink=job.sink,
        feeder=job.feeder,
        state=SimpleNamespace(version=0, step=0),
        spec=job.spec,
        control=SimpleNamespace(done=False),
        feed=lambda: fed.append(job.feeder.top_up(0, 1)),
        redis=None,  # no watch on Redis losing the job's state (trainer_svc/redis_state.py)
    )
    assert Parts.take_scored(parts, 0) == 8
    assert not set(groups) & job.feeder.in_flight and fed == [4] and len(job.feeder.in_flight) == 4
