"""Admission by version: the feeder's version slots, the generator's floor, and the sink training
in feed order, so a group that finishes late is not pushed past its staleness bound (the case
that dropped 9 % of the demo's samples with two generators)."""

import msgpack
import pytest

from asyncrl.tiny_model import build_tokenizer
from broker.streams import POLICY, PROMPTS, Delivery
from generator_svc.service import PolicyFollower
from shared.jobspec import JobSpec
from shared.prompts import renderer
from shared.schema import (
    EvalRound,
    Manifest,
    PolicyAnnouncement,
    PromptGroup,
    Rollout,
    SamplingParams,
    Scored,
    TensorEntry,
    decode,
    encode,
    pack_f32,
    pack_i32,
)
from shared.staleness_bound import admission_floor, min_generation_version, slot_versions
from shared.tasks import Problem
from trainer_svc.evaluation import Evaluator
from trainer_svc.feeder import Feeder, Group
from trainer_svc.guard import CollapseGuard
from trainer_svc.sink import LOST_LOOK_S, ORDER_WAIT_MIN_S, TrainSink, dead_streak_limit

RENDER = renderer(build_tokenizer())


# --- the pure rule --------------------------------------------------------------------------


def test_slot_versions_fill_the_next_k_plus_one_versions_in_feed_order():
    # k = 1, P = 2, trainer at v5: slots v5, v5, v6, v6 (positions 0..3)
    assert slot_versions(5, 1, 2, 0) == [5, 5, 6, 6]
    assert slot_versions(5, 1, 2, 1) == [5, 6, 6]  # position 0 taken: the next group sits at 1 (v5)
    assert slot_versions(5, 1, 2, 3) == [6]
    assert slot_versions(5, 1, 2, 4) == []  # full
    assert slot_versions(5, 0, 3, 0) == [5, 5, 5]  # sync: one batch, all for the version now
    assert slot_versions(0, 2, 1, 0) == [0, 1, 2]
    # the bound was lowered from 2 to 0 with 3 batches of 1 in flight: no slot until they are used
    assert slot_versions(7, 0, 1, 3) == []


def test_admission_floor_and_the_generators_minimum_version():
    assert admission_floor(6, 1) == 5  # trained at v6 under k = 1: v5 or newer is fresh (6 - 5 <= 1)
    assert admission_floor(6, 0) == 6
    # a slot is at most k versions ahead of the feed, so the floor is never past the fed version
    assert min_generation_version(4, 5, 1) == 4  # fed at v4 for v5, k = 1: floor 4
    assert min_generation_version(4, 4, 1) == 4  # floor 3 < fed 4: the fed version (sync's rule)
    # k lowered 2 -> 0 after the group was fed at v4 for v6: floor 6; v5 is the newest: v5
    assert min_generation_version(4, 6, 0) == 6
    assert min_generation_version(4, 6, 0, newest=5) == 5
    assert min_generation_version(4, 6, 0, newest=3) == 4  # never older than the fed version
    # an evaluation group, or an old feeder / trainer: the fed version alone
    assert min_generation_version(4, None, 1) == 4 and min_generation_version(4, 6, None) == 4


def test_a_prompt_group_without_train_version_still_decodes():
    g = PromptGroup(
        job_id="job1",
        msg_id="job1/g0",
        group_id="job1/g0",
        policy_version=2,
        prompt_index=0,
        prompt="1+1=",
        answer="2",
        n=2,
        sampling=SamplingParams(),
    )
    body = msgpack.unpackb(encode(g))
    del body["train_version"]  # as a feeder from before admission by version wrote it
    old = decode(msgpack.packb(body), (PromptGroup,))
    assert old.train_version is None and old.policy_version == 2
    assert decode(encode(g.model_copy(update={"train_version": 3})), (PromptGroup,)).train_version == 3


# --- the feeder: one slot per group, P per version -------------------------------------------


def _spec(**kw) -> JobSpec:
    return JobSpec(model_path="m", prompts_per_step=2, group_size=2, **kw)


def _problems(n):
    return [Problem(i, f"{i}+1=", str(i + 1)) for i in range(n)]


def _fed(streams) -> list[PromptGroup]:
    return streams.read_broadcast(PROMPTS, "0", PromptGroup)[1]


def test_feeder_stamps_each_group_with_its_slots_version(streams):
    feeder = Feeder(streams, _spec(max_staleness=1), _problems(20), RENDER)
    assert feeder.top_up(0, 1) == 4
    assert [(m.policy_version, m.train_version) for m in _fed(streams)] == [(0, 0), (0, 0), (0, 1), (0, 1)]
    order = feeder.feed_order()
    feeder.done(order[0])
    feeder.done(order[1])  # step 1 trained the first two
    assert feeder.top_up(1, 1) == 2
    assert [(m.policy_version, m.train_version) for m in _fed(streams)[4:]] == [(1, 2), (1, 2)]
    # a group of the step at v1 was dropped: the rest move up one slot, the refill takes the last one
    feeder.done(feeder.feed_order()[0])
    assert feeder.top_up(1, 1) == 1 and _fed(streams)[-1].train_version == 2
    # bound lowered 1 -> 0 with 4 in flight: nothing fed until fewer than one batch is left
    assert feeder.top_up(2, 0) == 0
    for gid in feeder.feed_order()[:3]:
        feeder.done(gid)
    assert feeder.top_up(3, 0) == 1 and _fed(streams)[-1].train_version == 3
    # the journal's keys are unchanged: a feeder from before restores
    st = feeder.state()
    assert set(st) == {
        "seq",
        "epochs",
        "cursor",
        "eval_rounds",
        "in_flight",
        "open_evals",
        "temperature",
        "top_p",
        "top_k",
        "fed",
    }
    # [prompt index, version fed at, tokens, temperature]
    assert st["fed"] == {g: feeder.fed[g] for g in feeder.feed_order()}
    again = Feeder(streams, _spec(max_staleness=1), _problems(20), RENDER)
    again.restore(st)
    assert again.feed_order() == feeder.feed_order() and again.fed == feeder.fed
    del st["fed"]  # a journal from before the key restores, knowing no more than it says
    again.restore(st)
    assert again.feed_order() == feeder.feed_order() and again.fed == {}


def test_feeder_stamps_the_live_sampler_on_each_group(streams):
    feeder = Feeder(streams, _spec(max_staleness=0, sampling={"top_p": 0.9, "top_k": 20}), _problems(20), RENDER)
    feeder.top_up(0, 0)
    assert {(m.sampling.top_p, m.sampling.top_k) for m in _fed(streams)} == {(0.9, 20)}
    for gid in feeder.feed_order():
        feeder.done(gid)
    feeder.top_k, feeder.top_p = 0, 1.0  # live knobs: the groups fed from now on
    feeder.top_up(1, 0)
    assert {(m.sampling.top_p, m.sampling.top_k) for m in _fed(streams)[2:]} == {(1.0, 0)}
    st = feeder.state()
    assert (st["top_p"], st["top_k"]) == (1.0, 0)
    del st["top_k"]  # a journal from before top_k: the spec's
    feeder.restore(st)
    assert feeder.top_k == 20


# --- the sink: feed order, never arrival order -----------------------------------------------


def _scored(gid: str, i: int, version: int, reward: float, feeder: Feeder | None = None) -> Scored:
    """Sample `i` of group `gid`; of the prompt `feeder` fed the group, when given (the trainer
    holds a sample to it: trainer_svc/validation.py)."""
    index, ids = 0, [1, 5]
    if feeder is not None and gid in feeder.fed:
        index = int(feeder.fed[gid][0])
        ids = feeder.prompt_ids(index).tolist()
    r = Rollout(
        job_id="job1",
        msg_id=f"{gid}/{i}",
        group_id=gid,
        policy_version=version,
        policy_version_max=version,
        prompt_index=index,
        sample_index=i,
        group_size=2,
        generator_id="g",
        prompt_ids=pack_i32(ids),
        completion_ids=pack_i32([6]),
        logprobs=pack_f32([-0.1]),
        completion="2",
        answer="2",
    )
    return Scored(job_id="job1", msg_id=r.msg_id, group_id=gid, policy_version=version, rollout=r, reward=reward)


class _Job:
    """A feeder and a sink on real Redis streams; groups are 'generated' by hand at chosen versions."""

    def __init__(self, streams, spec: JobSpec):
        self.spec, self.version, self.n = spec, 0, 0
        self.feeder = Feeder(streams, spec, _problems(50), RENDER)
        evaluator = Evaluator(spec, {}, self.feeder, streams, None, "job1")
        self.sink = TrainSink(spec, streams, None, self.feeder, evaluator, CollapseGuard(spec.guard, "aipo"), 100)
        self.k = spec.staleness_bound

    def arrive(self, gid: str, gen_version: int) -> None:
        self.sink.add(
            [Delivery(f"{self.n}-{i}", _scored(gid, i, gen_version, float(i), self.feeder)) for i in range(2)],
            self.version,
        )
        self.n += 1

    def step(self):
        """Begin the next step; the batch (then the version advances and the feeder tops up), or None."""
        self.sink.begin(self.version + 1, self.version, self.k)
        return self.take()

    def take(self):
        b = self.sink.take()
        if b is not None:
            self.sink.release(b)
            self.version += 1
            self.feeder.top_up(self.version, self.k)
        return b


def test_a_group_that_finishes_late_is_trained_in_its_turn_not_dropped(streams):
    """Two generators, k = 1, P = 2: generator A (slow) holds the step-1 groups g0 g1, generator B
    the step-2 groups g2 g3 and then g4 g5. Taking groups as they complete (the code before
    admission by version) trained g2 g3 at v0 and g4 g5 at v1, and dropped g0 g1 at v2 (generated
    at v0: staleness 2 > 1). In feed order every group is trained by its slot's version."""
    job = _Job(streams, _spec(max_staleness=1))
    job.feeder.top_up(0, job.k)
    g0, g1, g2, g3 = job.feeder.feed_order()
    job.arrive(g2, 0)
    job.arrive(g3, 0)  # B is done first
    assert job.step() is None  # g0 g1 are the step's: it waits for them instead of taking g2 g3
    job.arrive(g0, 0)
    assert job.take() is None  # g1 still generating
    job.arrive(g1, 0)
    b1 = job.take()
    assert b1 is not None and [g.group_id for g in b1.groups] == [g0, g1] and b1.dropped == []
    g4, g5 = job.feeder.feed_order()[2:]
    job.arrive(g4, 1)
    job.arrive(g5, 1)
    b2 = job.step()
    assert [g.group_id for g in b2.groups] == [g2, g3] and b2.dropped == []  # generated at v0, trained at v1
    b3 = job.step()
    assert [g.group_id for g in b3.groups] == [g4, g5] and b3.dropped == []


def test_a_group_whose_generator_died_is_trained_around_after_a_bounded_wait(streams):
    """The head-of-line group g0 never arrives (its generator was SIGKILLed; another reclaims it
    only later): the step waits ORDER_WAIT_MIN_S after a later group was ready, then trains the
    next groups in feed order; g0 is trained in its turn when it comes, or dropped if too stale."""
    job = _Job(streams, _spec(max_staleness=1))
    now = [100.0]
    job.sink.clock = lambda: now[0]
    job.feeder.top_up(0, job.k)
    g0, g1, g2, g3 = job.feeder.feed_order()
    assert job.step() is None  # nothing ready: no clock runs (a pipeline bubble is no gap)
    now[0] += 60
    assert job.take() is None and not job.sink.overtaken_since
    for gid in (g1, g2):
        job.arrive(gid, 0)
    assert job.take() is None  # g1 took its turn; g2 is ready behind missing g0: the clock starts
    now[0] += ORDER_WAIT_MIN_S - 0.1
    assert job.take() is None
    now[0] += 0.2
    b1 = job.take()
    assert [g.group_id for g in b1.groups] == [g1, g2] and b1.dropped == []
    assert g0 in job.feeder.in_flight and g0 in job.sink.overtaken_since  # still in flight, first in line
    job.arrive(g0, 0)  # reclaimed and generated at v0: staleness 1 at v1, fresh
    job.arrive(g3, 1)
    b2 = job.step()
    assert [g.group_id for g in b2.groups] == [g0, g3] and b2.dropped == []
    assert not job.sink.overtaken_since and not job.sink.trained_around
    # the wait grows with the step interval: twice its median, never below the floor
    job.sink.taken_at.clear()
    job.sink.taken_at.extend([0.0, 5.0, 10.0, 15.0])
    assert job.sink.order_wait_s() == 10.0


class _Rows:
    """The ledger's record_used, counted."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def record_used(self, items: list[dict]) -> int:
        self.rows += items
        return len(items)


def test_a_job_whose_every_group_dead_letters_fails_saying_why(streams):
    """An environment that cannot start its episodes (or an opening longer than the context)
    dead-letters every group: the trainer would feed and wait forever. After dead_streak_limit
    groups in a row with none complete it fails, the reason in the error; one completed group
    between restarts the count, so a healthy run that loses a group now and then never trips."""
    job = _Job(streams, _spec(max_staleness=1))
    job.sink.ledger = _Rows()
    limit = dead_streak_limit(job.spec)
    assert limit == 32  # 4 steps of 2 prompts, floored at DEAD_STREAK_MIN

    def dead(i: int, why: str) -> Group:
        return Group(f"job1/dead{i}", 2, dead={0: why, 1: why})

    for i in range(limit - 1):
        job.sink._route(dead(i, "env_error: start failed"), 0)
    job.feeder.top_up(0, job.k)
    job.arrive(job.feeder.feed_order()[0], 0)  # one completes
    assert job.sink.dead_streak == []
    for i in range(limit - 1):
        job.sink._route(dead(100 + i, "env_error: the opening is 821 tokens"), 0)
    with pytest.raises(
        RuntimeError,
        match=r"last 32 training groups were all dead-lettered .* 32 x dead-lettered: "
        r"env_error: the opening is 821 tokens",
    ):
        job.sink._route(dead(999, "env_error: the opening is 821 tokens"), 0)
    assert len(job.sink.ledger.rows) == 2 * (2 * limit - 1)  # every dead group's samples dropped in the ledger
    # reasons naming their group (the generator's do) are counted together, the group left out
    job.sink.dead_streak.clear()
    with pytest.raises(RuntimeError, match=r"32 x dead-lettered: env_error: episode 0 of group <group> never"):
        for i in range(limit):
            job.sink._route(dead(200 + i, f"env_error: episode 0 of group job1/dead{200 + i} never reached a turn"), 0)


def test_a_dropped_group_lets_the_next_in_feed_order_move_up(streams):
    job = _Job(streams, _spec(max_staleness=1, algorithm={"dynamic_sampling": True}))
    job.feeder.top_up(0, job.k)
    g0, g1, g2, g3 = job.feeder.feed_order()
    flat = [Delivery(f"f-{i}", _scored(g0, i, 0, 1.0, job.feeder)) for i in range(2)]  # equal rewards: no signal
    job.sink.add(flat, 0)
    job.arrive(g1, 0)
    job.arrive(g2, 0)
    b = job.step()
    assert [g.group_id for g in b.groups] == [g1, g2] and len(b.dropped) == 2 and b.filtered == 1
    # trainer at v1 with g3 in flight: the refills take slots v1, v2, v2 (positions 1..3)
    assert [m.train_version for m in _fed(streams)[4:]] == [1, 2, 2]
    assert _fed(streams)[-1].train_version == 2


def test_a_lowered_bound_strands_nothing(streams):
    """k 2 -> 0 with three steps' groups in flight: they are trained in their turn (or dropped, the
    safety net, when too stale for the new bound), nothing is fed until they are gone, then
    feeding resumes: no group is left behind and no step waits for one that cannot come."""
    job = _Job(streams, JobSpec(model_path="m", prompts_per_step=1, group_size=2, max_staleness=2))
    job.feeder.top_up(0, job.k)
    g0, g1, g2 = job.feeder.feed_order()
    assert [m.train_version for m in _fed(streams)] == [0, 1, 2]
    for gid in (g0, g1, g2):
        job.arrive(gid, 0)
    job.k = 0  # the guard tightened it (or the adaptive bound, or a live knob)
    b1 = job.step()
    assert [g.group_id for g in b1.groups] == [g0] and len(_fed(streams)) == 3  # still 2 in flight >= 1
    # g1 (v0) at v1: too stale for k = 0, dropped; g2 likewise; the step waits for the refill
    assert job.step() is None
    assert len(job.sink.pending.dropped) == 4 and not job.feeder.in_flight
    job.feeder.top_up(job.version, job.k)  # the loop refills what the drops freed
    (g3,) = job.feeder.feed_order()
    assert _fed(streams)[-1].train_version == 1
    job.arrive(g3, 1)
    b2 = job.take()
    assert [g.group_id for g in b2.groups] == [g3] and b2.bound == 0


def _announce(streams, version: int, k: int | None) -> None:
    m = Manifest(
        version=version,
        tensors=[TensorEntry(name="w", shape=[1], dtype="float32", offset=0, nbytes=4)],
        total_bytes=4,
        chunk_bytes=4,
        chunk_checksums=["0" * 16],
        checksum="1" * 16,
    )
    streams.publish(
        POLICY,
        PolicyAnnouncement(
            job_id="job1",
            msg_id=f"job1/v{version}",
            policy_version=version,
            manifest=m,
            transport="tcp",
            address="127.0.0.1:1",
            max_staleness=k,
        ),
    )


def test_the_generator_admits_by_the_newest_announced_bound(streams):
    def group(fed: int, train: int | None) -> PromptGroup:
        return PromptGroup(
            job_id="job1",
            msg_id="job1/g0",
            group_id="job1/g0",
            policy_version=fed,
            prompt_index=0,
            prompt="1+1=",
            answer="2",
            n=2,
            sampling=SamplingParams(),
            train_version=train,
        )

    follower = PolicyFollower(streams, None, None, "gen-0")
    _announce(streams, 3, None)  # a trainer from before: the fed version alone
    follower.poll()
    assert follower.admission_version([group(2, 3)]) == 2
    _announce(streams, 4, 2)
    _announce(streams, 5, 0)  # the bound lowered to 0
    follower.poll()
    # fed at v3 for v5, now k = 0: v5 (exists); a group for v7 caps at the newest, v5
    assert follower.admission_version([group(3, 5)]) == 5
    assert follower.admission_version([group(3, 7), group(1, None)]) == 5
    assert follower.admission_version([group(5, None)]) == 5


def _drop_entries(streams, stream: str, gids: set[str]) -> None:
    """What a failover to a replica that never received them does: the entries of `gids` are gone."""
    key = streams.key(stream)
    for eid, fields in streams.r.xrange(key):
        if decode(fields[b"d"], (PromptGroup, EvalRound, Rollout, Scored)).group_id in gids:
            streams.r.xdel(key, eid)


def _lost_job(streams, tmp_path, k: int):
    """A job with a real ledger and a hand-moved clock, its first slots fed: (job, ledger, now)."""
    from broker.ledger import Ledger

    job = _Job(streams, _spec(max_staleness=k))
    job.sink.ledger = ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    now = [100.0]
    job.sink.clock = lambda: now[0]
    job.feeder.top_up(0, job.k)
    return job, ledger, now


def test_groups_redis_lost_are_recorded_lost_and_their_slots_freed(streams, tmp_path):
    """A failover lost g0's prompt before anyone read it (no ledger row), and g1's prompt and
    rollouts after a generator had written its rows; g2's prompt is still in the stream (being
    generated), g3 is on its way as rollouts. Only g0 and g1 are lost: their samples end `lost` in
    the ledger (g0's rows written, g1's moved), their slots are freed, and g2 and g3 stay in flight."""
    from broker.streams import ROLLOUTS

    job, ledger, now = _lost_job(streams, tmp_path, 1)
    g0, g1, g2, g3 = job.feeder.feed_order()
    index0, fed_at0, tokens0, _ = job.feeder.fed[g0]
    ledger.record_generated(
        [
            {
                "msg_id": f"{g}/{i}",
                "job_id": "job1",
                "group_id": g,
                "sample_index": i,
                "prompt_index": 0,
                "generator_id": "gen-a",
                "gen_version_min": 0,
                "num_prompt_tokens": 2,
                "num_completion_tokens": 1,
                "completion": "2",
            }
            for g in (g1, g3)
            for i in range(2)
        ]
    )
    streams.publish_many(ROLLOUTS, [_scored(g3, i, 0, 0.0).rollout for i in range(2)])
    _drop_entries(streams, PROMPTS, {g0, g1, g3})  # g3's prompt was acked and trimmed: it is a rollout now

    # nothing was trained around yet: a running job does not look
    assert job.step() is None and job.sink.settle_lost(0) == 0
    assert job.sink.settle_lost(0, every=True, min_interval_s=0) == 2
    rows = {r["msg_id"]: r for r in ledger.samples("job1", limit=100)}
    assert {m: r["status"] for m, r in rows.items()} == {
        f"{g0}/0": "lost",
        f"{g0}/1": "lost",
        f"{g1}/0": "lost",
        f"{g1}/1": "lost",
        f"{g3}/0": "generated",
        f"{g3}/1": "generated",
    }
    assert rows[f"{g0}/0"]["generator_id"] == "" and rows[f"{g1}/0"]["generator_id"] == "gen-a"
    r0 = rows[f"{g0}/1"]
    assert (r0["prompt_index"], r0["gen_version_min"], r0["num_prompt_tokens"]) == (
        index0,
        fed_at0,
        tokens0,
    ) and tokens0 > 0
    assert all(
        r["trainer_version"] == 0 and "lost by Redis" in r["drop_reason"] for m, r in rows.items() if m[:-2] in (g0, g1)
    )
    assert job.feeder.feed_order() == [g2, g3]
    assert job.feeder.top_up(0, job.k) == 2  # the freed slots are fed again
    # at most once per interval; a later look finds nothing new
    assert job.sink.settle_lost(0, every=True) == 0
    now[0] += 60
    assert job.sink.settle_lost(0, every=True) == 0


def test_a_missing_group_is_looked_for_once_trained_around(streams, tmp_path):
    """In a running job the streams are read only for groups a step went past: g0 is missing while
    g1 and g2 are ready; once the step trained around it, the next look finds it lost."""
    job, ledger, now = _lost_job(streams, tmp_path, 1)
    g0, g1, g2, _ = job.feeder.feed_order()
    _drop_entries(streams, PROMPTS, {g0})
    for gid in (g1, g2):
        job.arrive(gid, 0)
    assert job.step() is None and job.sink.settle_lost(0) == 0  # not trained around yet
    now[0] += ORDER_WAIT_MIN_S + 0.1
    b1 = job.take()
    assert [g.group_id for g in b1.groups] == [g1, g2] and g0 in job.sink.trained_around
    assert job.sink.settle_lost(1) == 1
    assert ledger.status_counts("job1") == {"lost": 2}
    assert g0 not in job.feeder.in_flight and g0 not in job.sink.trained_around and g0 not in job.sink.overtaken_since


def test_a_step_that_waits_long_looks_whether_its_groups_were_lost(streams, tmp_path):
    """Every group of the step was lost (nothing later completes, so none is trained around): after
    LOST_LOOK_S of waiting the step looks, settles both, and the refill lets the job go on."""
    job, ledger, now = _lost_job(streams, tmp_path, 0)
    g0, g1 = job.feeder.feed_order()
    _drop_entries(streams, PROMPTS, {g0, g1})
    assert job.step() is None
    now[0] += LOST_LOOK_S - 1
    assert job.sink.settle_lost(0) == 0 and job.take() is None
    now[0] += 1
    assert job.sink.settle_lost(0) == 2 and ledger.status_counts("job1") == {"lost": 4}
    assert job.feeder.top_up(0, job.k) == 2
    g2, g3 = job.feeder.feed_order()
    job.arrive(g2, 0)
    job.arrive(g3, 0)
    assert [g.group_id for g in job.take().groups] == [g2, g3]


def test_an_evaluation_round_waits_only_for_problems_redis_did_not_lose(streams, tmp_path):
    """The final round of 3 problems: its entry is gone from the prompts stream (generated from),
    problem 0 arrived, problem 1 is on its way as rollouts, problem 2's outputs were lost. The look
    settles problem 2 `lost` and the round waits only for problem 1, then is recorded."""
    from broker.streams import ROLLOUTS
    from shared.ids import eval_group_id
    from trainer_svc.evaluation import build_sets

    job, ledger, now = _lost_job(streams, tmp_path, 1)
    ledger.create_job("job1", "t", {"model_path": "m"})
    evaluator = job.sink.evaluator
    evaluator.ledger = ledger
    evaluator.sets = build_sets(job.spec, {"held_out": _problems(3)}, RENDER)
    evaluator.start_due(0, 0, final=True)
    (rid,) = evaluator.rounds
    n = evaluator.sets["held_out"].spec.sampling.n
    p0, p1, p2 = (eval_group_id(rid, i) for i in range(3))

    def sample(gid: str, i: int) -> Scored:
        r = _scored(gid, i, 0, 1.0).rollout.model_copy(
            update={"group_size": n, "purpose": "eval", "eval_set": "held_out", "prompt_index": int(gid[-1])}
        )
        return Scored(job_id="job1", msg_id=r.msg_id, group_id=gid, policy_version=0, rollout=r, reward=1.0)

    job.sink.add([Delivery(f"9-{i}", sample(p0, i)) for i in range(n)], 0)
    streams.publish_many(ROLLOUTS, [sample(p1, i).rollout for i in range(n)])
    _drop_entries(streams, PROMPTS, {rid})
    assert job.sink.settle_lost(0, every=True, min_interval_s=0) == 1
    assert ledger.status_counts("job1") == {"lost": n}
    assert evaluator.rounds[rid].expected == 2 and rid in job.feeder.open_evals  # still waiting for p1
    job.sink.add([Delivery(f"8-{i}", sample(p1, i)) for i in range(n)], 0)
    assert not evaluator.pending and rid not in job.feeder.open_evals
    assert ledger.status_counts("job1") == {"lost": n}  # p0 and p1 have no generated rows here: nothing moved
    (ev,) = ledger.evals("job1")
    assert ev["n"] == 2 * n and ev["name"] == "held_out"  # the two problems that arrived
