"""The trainer's side of the drop skew (shared/drop_skew.py): each way the sink drops a training
group notes its samples under the right reason (staleness bound, dynamic sampling, a dead member
whose reward failed, another dead letter), and a step's samples split into those trained on their
reward and those kept from it (over-long masked, reward failed). Real Redis streams, as in
test_admission."""

from __future__ import annotations

from broker.streams import Delivery
from shared.jobspec import JobSpec
from shared.schema import pack_f32, pack_i32
from tests.trainer_svc.test_admission import _Job, _Rows, _scored, _spec
from trainer_svc.feeder import Group
from trainer_svc.sink import split_trained


def test_a_flat_group_is_noted_as_dynamic_sampling(streams):
    job = _Job(streams, _spec(max_staleness=1, algorithm={"dynamic_sampling": True}))
    job.feeder.top_up(0, job.k)
    g0, g1, g2, _ = job.feeder.feed_order()
    job.sink.add([Delivery(f"f-{i}", _scored(g0, i, 0, 1.0, job.feeder)) for i in range(2)], 0)  # equal rewards
    job.arrive(g1, 0)
    job.arrive(g2, 0)
    assert job.step() is not None
    assert job.sink.take_drops() == {"dynamic_sampling": [(1, 1.0), (1, 1.0)]}  # one completion token each
    assert job.sink.take_drops() == {}  # taken: the next step starts from none


def test_a_group_past_the_bound_is_noted_as_stale(streams):
    job = _Job(streams, JobSpec(model_path="m", prompts_per_step=1, group_size=2, max_staleness=2))
    job.feeder.top_up(0, job.k)
    g0, g1, g2 = job.feeder.feed_order()
    for gid in (g0, g1, g2):
        job.arrive(gid, 0)  # rewards 0.0 and 1.0
    job.k = 0
    assert job.step() is not None  # g0 trained; then g1, g2 (v0) are too stale at v1
    assert job.step() is None
    assert job.sink.take_drops() == {"stale": [(1, 0.0), (1, 1.0)] * 2}


def test_a_dead_groups_members_are_noted_by_why_it_died(streams):
    job = _Job(streams, _spec(max_staleness=1))
    job.sink.ledger = _Rows()
    job.feeder.top_up(0, job.k)
    g0, g1, *_ = job.feeder.feed_order()
    alive = _scored(g0, 0, 0, 0.5, job.feeder)
    job.sink._settle_dead(Group(g0, 2, samples={alive.msg_id: alive}, dead={1: "reward_timeout: 30 s"}), 0)
    job.sink._settle_dead(Group(g1, 2, dead={0: "empty_completion: no tokens", 1: "empty_completion: x"}), 0)
    assert job.sink.take_drops() == {"reward_failure": [(1, 0.5)]}  # no member of g1 arrived: nothing to count


def test_a_steps_samples_split_into_trained_and_kept(streams):
    def sample(i: int, tokens: int, finish: str, status: str = "ok", reward: float = 1.0):
        s = _scored(f"job1/g{i}", 0, 0, reward)
        r = s.rollout.model_copy(
            update={
                "completion_ids": pack_i32([6] * tokens),
                "logprobs": pack_f32([-0.1] * tokens),
                "finish_reason": finish,
            }
        )
        return s.model_copy(update={"rollout": r, "reward_status": status})

    batch = [sample(0, 3, "stop"), sample(1, 8, "length"), sample(2, 5, "stop", "timeout", 0.0)]
    masked = JobSpec(model_path="m", algorithm={"overlong": "mask"})
    assert split_trained(batch, masked) == ([(3, 1.0)], {"overlong": [(8, 1.0)], "reward_failure": [(5, None)]})
    # kept or penalised, a cut sample trains on its reward
    assert split_trained(batch, JobSpec(model_path="m")) == ([(3, 1.0), (8, 1.0)], {"reward_failure": [(5, None)]})
