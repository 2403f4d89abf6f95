"""JobStreams on a real local Redis Cluster (3 primaries + 3 replicas, broker.redis_server.LocalCluster):
every key of a job in one slot, jobs spread over the shards, and the multi-key operations (scripts,
MULTI/EXEC, deletes) that would fail with CROSSSLOT on untagged keys. Also the adoption of a job's
untagged keys from before hash tags, on the single server."""

from __future__ import annotations

import os
import uuid

import pytest
import redis

from broker.redis_server import LocalCluster, check_redis_url
from broker.streams import (
    CONTROL,
    DEAD,
    GROUP_GENERATORS,
    GROUP_REWARDERS,
    JOB_KEYS,
    POLICY,
    PROMPTS,
    ROLLOUTS,
    Consumer,
    JobStreams,
    OutageCluster,
    connect,
    is_cluster_url,
    plain_url,
    subscriber,
)
from shared.schema import Control, PromptGroup, Rollout, SamplingParams, pack_f32, pack_i32

pytestmark = pytest.mark.redis_cluster


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(3, 1, node_timeout_ms=2000) as cl:
        yield cl


def _group(job: str, i: int) -> PromptGroup:
    return PromptGroup(
        job_id=job,
        msg_id=f"g{i}",
        group_id=f"g{i}",
        policy_version=0,
        prompt_index=i,
        prompt="p",
        answer="a",
        n=2,
        sampling=SamplingParams(),
    )


def _rollout(job: str, gid: str, k: int) -> Rollout:
    return Rollout(
        job_id=job,
        msg_id=f"{gid}/{k}",
        group_id=gid,
        policy_version=0,
        policy_version_max=0,
        prompt_index=0,
        sample_index=k,
        group_size=2,
        generator_id="gen",
        prompt_ids=pack_i32([1]),
        completion_ids=pack_i32([2]),
        logprobs=pack_f32([-1.0]),
        completion="c",
        answer="a",
    )


def test_cluster_urls_are_recognised_and_checked():
    assert is_cluster_url("redis+cluster://h:7000") and is_cluster_url("rediss+cluster://u:p@h:7000")
    assert not is_cluster_url("redis://h:6379/0")
    assert plain_url("rediss+cluster://u:p@h:7000?ssl_cert_reqs=none") == "rediss://u:p@h:7000?ssl_cert_reqs=none"
    assert check_redis_url("redis+cluster://h:7000")["port"] == 7000
    with pytest.raises(ValueError, match="db 0 only"):
        check_redis_url("redis+cluster://h:7000/3")


def test_every_key_of_a_job_shares_one_slot_and_jobs_spread_over_the_primaries(cluster):
    node = cluster.node(cluster.ports[0])
    primaries = set()
    for i in range(24):
        s = JobStreams(redis.Redis(), f"job-{i}")
        slots = {node.cluster("keyslot", s.key(k)) for k in JOB_KEYS}
        slots.add(node.cluster("keyslot", s._wake_channel(PROMPTS)))
        assert len(slots) == 1, (s.job_id, slots)
        primaries.add(cluster.master_of(s.key(PROMPTS)))
    assert len(primaries) == 3  # 24 jobs land on all three shards


def test_a_job_s_stream_work_on_the_cluster(cluster):
    client = connect(cluster.url)
    assert isinstance(client, OutageCluster)
    job = f"j-{uuid.uuid4().hex[:8]}"
    s = JobStreams(client, job, prefix="t:")
    gen = Consumer(PROMPTS, GROUP_GENERATORS, "gen-0", PromptGroup)
    s.ensure_group(PROMPTS, GROUP_GENERATORS)
    s.ensure_group(ROLLOUTS, GROUP_REWARDERS)
    # publish_many: one script on a cluster (XADDs + the wake-up)
    ids = s.publish_many(PROMPTS, [_group(job, i) for i in range(3)])
    assert len(ids) == 3 and s.length(PROMPTS) == 3
    got = s.consume(gen, count=10, block_ms=500)
    assert [d.message.group_id for d in got] == ["g0", "g1", "g2"]
    # publish_if_owned: two keys of the job in one script (CROSSSLOT without the hash tag)
    done = s.publish_if_owned(gen, ROLLOUTS, [(got[0].entry_id, [_rollout(job, "g0", 0), _rollout(job, "g0", 1)])])
    assert done == [True] and s.length(ROLLOUTS) == 2 and s.pending_count(PROMPTS, GROUP_GENERATORS) == 2
    assert s.touch(gen, [got[1].entry_id]) == [True]
    assert s.ack(PROMPTS, GROUP_GENERATORS, [d.entry_id for d in got[1:]]) == 2
    assert s.trim_acked(PROMPTS, GROUP_GENERATORS) >= 2
    # a blocked reader is woken through the cluster's pub/sub by a publish
    rew = Consumer(ROLLOUTS, GROUP_REWARDERS, "rw-0", Rollout)
    assert len(s.consume(rew, count=10, block_ms=200)) == 2
    assert s.consume(rew, count=10, block_ms=300) == []
    s.publish(CONTROL, Control(job_id=job, msg_id="c1", policy_version=0, command="pause"))
    last, msgs = s.read_broadcast(CONTROL, "0", Control, block_ms=200)
    assert [m.command for m in msgs] == ["pause"]
    s.publish_raw(PROMPTS, {b"junk": b"1"})
    assert s.consume(gen, count=10, block_ms=200) == [] and s.dead_letters()[0].code == "malformed"
    s.heartbeat("gen-0", {"version": 0})
    assert "gen-0" in s.heartbeats()
    s.delete_all()  # one DEL of every key of the job
    assert all(client.exists(s.key(k)) == 0 for k in (PROMPTS, ROLLOUTS, CONTROL, DEAD, POLICY, "generators"))


def test_a_wake_up_reaches_a_plain_subscription_on_the_channel_s_node(cluster):
    # Wake-ups subscribe on the node serving the channel's slot with plain pub/sub (not redis-py's
    # cluster pub/sub and its topology machinery); a PUBLISH through the cluster client, which may
    # land on any node, reaches it (the cluster bus forwards it).
    client = connect(cluster.url)
    for i in range(4):
        channel = f"t:{{j-{uuid.uuid4().hex[:8]}}}:prompts:wake"
        sub = subscriber(client, channel)
        assert type(sub) is redis.client.PubSub, type(sub)
        sub.subscribe(channel)
        assert sub.get_message(timeout=1.0) is None  # the subscribe confirmation is ignored
        node = client.get_node_from_key(channel)
        assert sub.connection_pool is client.get_redis_connection(node).connection_pool
        for other in client.get_primaries():  # a publish on every primary reaches it
            client.get_redis_connection(other).publish(channel, f"{i}")
        got = [sub.get_message(timeout=1.0) for _ in client.get_primaries()]
        assert all(m is not None and m["data"] == f"{i}".encode() for m in got), got
        sub.close()


@pytest.fixture
def single():
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    prefix = f"legacy-{uuid.uuid4().hex[:8]}:"
    yield client, prefix
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)


def test_a_job_from_before_hash_tags_is_adopted_once(single):
    client, prefix = single
    s = JobStreams(client, "old-job", prefix=prefix)
    assert s.key(PROMPTS) == f"{prefix}{{old-job}}:prompts" and s.legacy_key(PROMPTS) == f"{prefix}old-job:prompts"
    # what a service of the old version left: a stream with a group and a pending entry, a heartbeat
    client.xgroup_create(s.legacy_key(PROMPTS), GROUP_GENERATORS, id="0", mkstream=True)
    client.xadd(s.legacy_key(PROMPTS), {b"d": b"x"})
    client.xreadgroup(GROUP_GENERATORS, "gen-0", {s.legacy_key(PROMPTS): ">"})
    client.hset(s.legacy_key("generators"), "gen-0", "{}")
    assert sorted(s.adopt_legacy_keys()) == sorted([s.legacy_key(PROMPTS), s.legacy_key("generators")])
    assert not client.exists(s.legacy_key(PROMPTS)) and s.length(PROMPTS) == 1
    assert s.pending_count(PROMPTS, GROUP_GENERATORS) == 1  # the group and its PEL came along
    assert s.adopt_legacy_keys() == []  # idempotent
    # both names present (an old-version service still writing): left alone
    client.xadd(s.legacy_key(ROLLOUTS), {b"d": b"y"})
    client.xadd(s.key(ROLLOUTS), {b"d": b"z"})
    assert s.adopt_legacy_keys() == [] and client.xlen(s.legacy_key(ROLLOUTS)) == 1


def test_adoption_is_a_no_op_on_a_cluster(cluster):
    assert JobStreams(connect(cluster.url), "x").adopt_legacy_keys() == []


def test_a_writer_rides_out_a_failover_and_the_loss_is_measured(tmp_path):
    """A feeder-like writer keeps publishing while the job's primary is killed (its replica
    partitioned over the 0.3 s before): every publish returns (OutageCluster waits out the
    promotion), and what the promoted replica lacks is counted twice, by entry ids and by XINFO's
    entries-added, alike."""
    import threading
    import time

    from bench.redis_cluster import failover

    with LocalCluster(3, 1, node_timeout_ms=1000, workdir=str(tmp_path / "cl")) as cl:
        job = f"w-{uuid.uuid4().hex[:8]}"
        s = JobStreams(connect(cl.url), job, prefix="t:")
        s.ensure_group(PROMPTS, GROUP_GENERATORS)
        published: list[str] = []
        stop = threading.Event()

        def feed() -> None:
            i = 0
            while not stop.is_set():
                published.extend(s.publish_many(PROMPTS, [_group(job, i)]))
                i += 1
                time.sleep(0.01)

        writer = threading.Thread(target=feed, daemon=True)
        writer.start()
        time.sleep(0.5)
        fo = failover(cl, s.key(PROMPTS), gap_s=0.3)
        n_at_promotion = len(published)
        time.sleep(0.5)
        stop.set()
        writer.join(30)
        assert not writer.is_alive()
        assert len(published) > n_at_promotion  # publishing went on on the promoted replica
        assert fo["entries_lost"] == fo["xadds_lost"]  # nothing was trimmed: the two counts agree
        lost = fo["entries_lost"][PROMPTS]
        assert lost > 0 and len(fo["lost_groups"][PROMPTS]) == lost  # the partition's writes, never replicated
        # the stream on the new primary: everything published, less exactly what was lost
        assert s.length(PROMPTS) == len(published) - lost
