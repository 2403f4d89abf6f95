"""The pieces the chaos suite leans on, each alone against the real Redis (fast, not `chaos`):
SIGTERM as a drain flag, a restarted consumer's own pending entries, publishing only while the
entry is still held, and dead letters completing (and freeing) the groups they name."""

from __future__ import annotations

import os
import time
import uuid

import pytest

import shared.entry as entry
from broker.runtime import ControlWatcher
from broker.streams import (
    CONTROL,
    GROUP_GENERATORS,
    PROMPTS,
    ROLLOUTS,
    Consumer,
    JobStreams,
    connect,
)
from shared.schema import (
    Control,
    PromptGroup,
    Rollout,
    SamplingParams,
    Scored,
    encode,
    pack_f32,
    pack_i32,
)
from trainer_svc.feeder import DeadLetterWatch, DeadMember, GroupAssembler

JOB = "job1"


@pytest.fixture
def streams():
    s = JobStreams(
        connect(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")),
        JOB,
        prefix=f"test-{uuid.uuid4().hex}:",
        claim_idle_ms=50,
    )
    yield s
    s.delete_all()


@pytest.fixture
def clean_drain():
    entry._drain.clear()
    entry._accepting.clear()
    yield
    entry._drain.clear()
    entry._accepting.clear()


def _prompt(i: int, n: int = 2) -> PromptGroup:
    return PromptGroup(
        job_id=JOB,
        msg_id=f"{JOB}/g{i}",
        group_id=f"{JOB}/g{i}",
        policy_version=0,
        prompt_index=i,
        prompt="1+1=",
        answer="2",
        n=n,
        sampling=SamplingParams(),
    )


def _rollout(group: str, i: int, size: int = 2) -> Rollout:
    return Rollout(
        job_id=JOB,
        msg_id=f"{group}/{i}",
        group_id=group,
        policy_version=0,
        policy_version_max=0,
        prompt_index=0,
        sample_index=i,
        group_size=size,
        generator_id="gen-0",
        prompt_ids=pack_i32([1]),
        completion_ids=pack_i32([5]),
        logprobs=pack_f32([-0.1]),
        completion="2",
        answer="2",
    )


def _scored(group: str, i: int, size: int = 2) -> Scored:
    r = _rollout(group, i, size)
    return Scored(job_id=JOB, msg_id=r.msg_id, group_id=group, policy_version=0, rollout=r, reward=1.0)


def test_sigterm_drains_once_the_loop_runs_and_interrupts_before(streams, clean_drain):
    with pytest.raises(entry.Terminated):  # no loop yet (start-up): stop at once
        entry._on_sigterm(15, None)
    control = ControlWatcher(streams)  # the loop runs: SIGTERM now only asks it to finish
    assert control.poll() == "running"
    entry._on_sigterm(15, None)
    assert entry.drain_requested() and control.poll() == "terminating" and control.done
    # the job's own commands are for the successor: a later stop does not turn it into the user's stop
    streams.publish(CONTROL, Control(job_id=JOB, msg_id="s", policy_version=0, command="stop"))
    assert control.poll() == "terminating"
    with pytest.raises(entry.Terminated):  # a second SIGTERM: now
        entry._on_sigterm(15, None)


def test_restarted_consumer_reads_its_own_pending_first(streams):
    streams.ensure_group(PROMPTS, GROUP_GENERATORS)
    streams.publish_many(PROMPTS, [_prompt(0), _prompt(1)])
    first = streams.consume(Consumer(PROMPTS, GROUP_GENERATORS, "gen-0", PromptGroup), count=10, block_ms=None)
    assert len(first) == 2
    # the same consumer name after a kill: its pending entries, at once, with their delivery count
    again = streams.consume_own_pending(Consumer(PROMPTS, GROUP_GENERATORS, "gen-0", PromptGroup))
    assert [d.entry_id for d in again] == [d.entry_id for d in first]
    assert [d.deliveries for d in again] == [2, 2]
    assert streams.consume_own_pending(Consumer(PROMPTS, GROUP_GENERATORS, "gen-1", PromptGroup)) == []


def test_publish_only_while_the_entry_is_held(streams):
    streams.ensure_group(PROMPTS, GROUP_GENERATORS)
    streams.publish_many(PROMPTS, [_prompt(0), _prompt(1)])
    a, b = streams.consume(Consumer(PROMPTS, GROUP_GENERATORS, "gen-0", PromptGroup), count=2, block_ms=None)
    # gen-0 looks dead: gen-1 reclaims entry a (idle > claim_idle_ms) and generates it too
    time.sleep(0.1)
    streams._last_claim.clear()
    (taken,) = streams.consume(Consumer(PROMPTS, GROUP_GENERATORS, "gen-1", PromptGroup), count=1, block_ms=None)
    assert taken.entry_id == a.entry_id
    done = streams.publish_if_owned(
        Consumer(PROMPTS, GROUP_GENERATORS, "gen-0", PromptGroup),
        ROLLOUTS,
        [(a.entry_id, [_rollout("ga", 0)]), (b.entry_id, [_rollout("gb", 0)])],
    )
    assert done == [False, True]  # gen-0's late copy of a is not published; b still is, and acked
    assert streams.publish_if_owned(
        Consumer(PROMPTS, GROUP_GENERATORS, "gen-1", PromptGroup),
        ROLLOUTS,
        [(a.entry_id, [_rollout("ga", 0), _rollout("ga", 1)])],
    ) == [True]
    # a repeat (a retried call whose reply was lost) publishes nothing more
    assert streams.publish_if_owned(
        Consumer(PROMPTS, GROUP_GENERATORS, "gen-1", PromptGroup), ROLLOUTS, [(a.entry_id, [_rollout("ga", 0)])]
    ) == [False]
    assert streams.length(ROLLOUTS) == 3 and streams.pending_count(PROMPTS, GROUP_GENERATORS) == 0


def test_dead_letters_complete_the_groups_they_name(streams):
    streams.ensure_group(PROMPTS, GROUP_GENERATORS)
    streams.ensure_group(ROLLOUTS, "rewarders")
    watch, asm = DeadLetterWatch(streams, JOB), GroupAssembler()
    # a prompt group the generator refused, a sample the reward service refused, garbage
    (eid,) = streams.publish_many(PROMPTS, [_prompt(7, n=2)])
    streams.dead_letter(
        PROMPTS, GROUP_GENERATORS, eid, "prompt too long", encode(_prompt(7, n=2)), code="prompt_too_long"
    )
    (rid,) = streams.publish_many(ROLLOUTS, [_rollout(f"{JOB}/g8", 1)])
    streams.dead_letter(
        ROLLOUTS, "rewarders", rid, "empty completion", encode(_rollout(f"{JOB}/g8", 1)), code="empty_completion"
    )
    streams.dead_letter(ROLLOUTS, "rewarders", "1-1", "not msgpack", b"\xc1", code="malformed")
    members = watch.poll()
    assert [(m.group_id, m.sample_index) for m in members] == [(f"{JOB}/g7", None), (f"{JOB}/g8", 1)]
    g7 = asm.mark_dead(members[0])
    assert g7 is not None and g7.samples == {} and g7.msg_ids == [f"{JOB}/g7/0", f"{JOB}/g7/1"]
    assert "prompt_too_long" in g7.dead[0]
    assert asm.mark_dead(members[1]) is None  # g8 waits for its other sample
    g8 = asm.add("5-0", _scored(f"{JOB}/g8", 0))
    assert g8 is not None and g8.dead == {1: "empty_completion: empty completion"} and len(g8.samples) == 1
    assert watch.poll() == []  # each dead letter once
    # a dead copy of a sample of a group that already completed changes nothing
    assert asm.add("6-0", _scored(f"{JOB}/g9", 0)) is None and asm.add("6-1", _scored(f"{JOB}/g9", 1)) is not None
    assert asm.mark_dead(DeadMember(f"{JOB}/g9", 2, 0, "train", "x")) is None
