"""Redis coming back empty mid-job, on real Redis (a unique prefix; the job's keys deleted, never the
server flushed) with a hand-moved clock: the trainer's RedisWatch sees the epoch key gone, stamps
anew, re-creates the consumer groups, publishes its last announcement again, and settles what was
in flight as lost, a partly delivered group included, so the freed slots are fed and the job goes
on. The full probe with real services and a real redis-server restarted empty is
tests/chaos/test_redis_empty.py."""

from __future__ import annotations

from broker.ledger import Ledger
from broker.streams import (
    GROUP_GENERATORS,
    GROUP_REWARDERS,
    GROUP_TRAINERS,
    POLICY,
    PROMPTS,
    ROLLOUTS,
    SCORED,
    Delivery,
    JobStreams,
)
from shared.jobspec import JobSpec
from shared.schema import Manifest, PolicyAnnouncement, TensorEntry
from tests.trainer_svc.test_admission import _Job, _scored
from trainer_svc.redis_state import EPOCH_CHECK_S, RedisWatch


def _announcement(version: int, run: str = "") -> PolicyAnnouncement:
    m = Manifest(
        version=version,
        total_bytes=4,
        chunk_bytes=4,
        tensors=[TensorEntry(name="w", shape=[1], dtype="float32", offset=0, nbytes=4)],
        chunk_checksums=["0" * 16],
        checksum="0" * 16,
    )
    return PolicyAnnouncement(
        job_id="job1",
        msg_id=f"job1/v{version}",
        policy_version=version,
        manifest=m,
        transport="tcp",
        address="a:1",
        trainer_run=run,
    )


def _groups(streams: JobStreams) -> set[tuple[str, str]]:
    out = set()
    for stream in (PROMPTS, ROLLOUTS, SCORED):
        for g in streams.r.xinfo_groups(streams.key(stream)):
            name = g["name"]
            out.add((stream, name.decode() if isinstance(name, bytes) else name))
    return out


def test_redis_emptied_mid_job_is_seen_and_the_job_goes_on(streams, tmp_path):
    """k = 1, P = 2, group size 2: four groups in flight. g0 is complete and ready (its entries are
    gone with the rest, but the trainer holds its samples), g1 is half delivered, g2 and g3 were
    still being generated. Then every key of the job goes. Within EPOCH_CHECK_S the watch sees the
    epoch key gone; the recovery settles g1, g2, g3 lost (g1's delivered sample too: its partner
    went with the flush), leaves g0, frees three slots, publishes version 3's announcement again
    and re-creates the three consumer groups."""
    job = _Job(streams, JobSpec(model_path="m", prompts_per_step=2, group_size=2, max_staleness=1))
    job.sink.ledger = ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    now = [100.0]
    watch = RedisWatch(streams, "run1", clock=lambda: now[0])
    assert not watch.lost()  # never stamped: nothing to lose
    watch.stamp()
    assert streams.epoch() == "run1.1"
    ann = _announcement(3)
    streams.publish(POLICY, ann)
    watch.announced(ann)
    job.feeder.top_up(0, 1)
    g0, g1, g2, g3 = job.feeder.feed_order()
    job.arrive(g0, 0)
    job.sink.add([Delivery("7-0", _scored(g1, 0, 0, 1.0, job.feeder))], 0)
    late = _scored(g1, 1, 0, 1.0, job.feeder)  # g1's other member, as fed
    assert g1 in job.sink.assembler.open

    now[0] += EPOCH_CHECK_S
    assert not watch.lost()  # all there
    streams.delete_all()  # what a restart without persistence (or a FLUSHALL) leaves of the job
    now[0] += EPOCH_CHECK_S - 0.5
    assert not watch.lost()  # looked at most every EPOCH_CHECK_S
    now[0] += 0.5
    assert watch.lost()

    assert watch.recover(job.sink, 0) == 3
    assert streams.epoch() == "run1.2" and watch.recoveries == 1 and not watch.lost()
    assert streams.latest(POLICY, PolicyAnnouncement)[1] == ann  # a restarted generator finds version 3
    assert _groups(streams) == {(PROMPTS, GROUP_GENERATORS), (ROLLOUTS, GROUP_REWARDERS), (SCORED, GROUP_TRAINERS)}
    assert job.feeder.feed_order() == [g0] and g1 not in job.sink.assembler.open
    assert ledger.status_counts("job1") == {"lost": 6}  # three groups of two
    # the freed slots are fed again, and the job steps: g0 with the first new group
    assert job.feeder.top_up(0, 1) == 3
    _, g4, _, _ = job.feeder.feed_order()
    job.arrive(g4, 0)
    b = job.step()
    assert b is not None and [g.group_id for g in b.groups] == [g0, g4]
    # a late copy of the lost half-group's sample (from a consumer that read it before the flush) is a stray
    job.sink.add([Delivery("8-0", late)], 1)
    assert job.sink.assembler.strays == ["8-0"] and g1 not in job.sink.assembler.open
    ledger.close()


def test_another_trainers_token_is_not_a_loss(streams):
    now = [0.0]
    watch = RedisWatch(streams, "old", clock=lambda: now[0])
    watch.stamp()
    streams.stamp_epoch("new.1")  # a successor took the job over
    now[0] += EPOCH_CHECK_S
    assert not watch.lost() and watch._foreign == "new.1"


def test_a_lost_announcement_is_published_again(streams):
    """A failover can lose the newest announcement alone (the epoch key, written long before,
    survives): generators then wait for the version the fed groups need, and the trainer waits for
    those groups. At its next look the watch finds the stream's newest is an older version of its
    own and publishes its newest again; an announcement that is there, or a newer one of the same
    run, is left alone."""
    now = [0.0]
    watch = RedisWatch(streams, "run1", clock=lambda: now[0])
    watch.stamp()
    v3, v4 = _announcement(3, "run1"), _announcement(4, "run1")
    streams.publish(POLICY, v3)
    watch.announced(v3)
    now[0] += EPOCH_CHECK_S
    assert not watch.lost() and watch.reannounced == 0  # v3 is there
    watch.announced(v4)  # published to a primary that then failed over: the stream has v3 only
    now[0] += EPOCH_CHECK_S
    assert not watch.lost() and watch.reannounced == 1
    assert streams.latest(POLICY, PolicyAnnouncement)[1] == v4
    now[0] += EPOCH_CHECK_S
    assert not watch.lost() and watch.reannounced == 1  # there now: once
    streams.publish(POLICY, _announcement(2, "run2"))  # another run's announcement on top
    now[0] += EPOCH_CHECK_S
    assert not watch.lost() and watch.reannounced == 2  # not this run's v4: published again
