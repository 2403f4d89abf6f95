"""The service loop (broker.service.ServiceLoop) against the local Redis, with a recording handler:
own pending entries first and alone, top-up reads, pause/resume, drain and cancel; live knobs
taken once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from uuid import uuid4

import pytest

from broker.runtime import ControlWatcher
from broker.service import ServiceLoop
from broker.streams import (
    CONTROL,
    FIELD,
    GROUP_GENERATORS,
    PROMPTS,
    Consumer,
    Delivery,
    JobStreams,
    connect,
)
from shared.entry import Drained
from shared.schema import Control, PromptGroup, SamplingParams

JOB = "job-loop"
C = Consumer(PROMPTS, GROUP_GENERATORS, "gen-0", PromptGroup)


def prompt(i: int) -> PromptGroup:
    return PromptGroup(
        job_id=JOB,
        msg_id=f"{JOB}/g{i}",
        group_id=f"{JOB}/g{i}",
        policy_version=0,
        prompt_index=i,
        prompt="1+1=",
        answer="2",
        n=1,
        sampling=SamplingParams(),
    )


def control(js: JobStreams, command: str) -> None:
    js.publish(CONTROL, Control(job_id=JOB, msg_id=f"{command}-{uuid4().hex[:6]}", policy_version=0, command=command))


class Recorder:
    """Acks every delivery and records each batch; asks for a top-up until `want` entries."""

    def __init__(self, js: JobStreams, *, batch: int = 10, want: int = 0):
        self.js, self.batch, self.want = js, batch, want
        self.batches: list[list[str]] = []
        self.idles = self.ticks = 0

    def batch_size(self, control: ControlWatcher) -> int:
        return self.batch

    def more(self, deliveries: list[Delivery]) -> int:
        return max(0, self.want - len(deliveries))

    def handle(self, deliveries: list[Delivery]) -> None:
        self.batches.append([d.entry_id for d in deliveries])
        self.js.ack(C.stream, C.group, [d.entry_id for d in deliveries])

    def idle(self) -> None:
        self.idles += 1

    def tick(self) -> None:
        self.ticks += 1


@pytest.fixture
def js() -> Iterator[JobStreams]:
    s = JobStreams(connect("redis://127.0.0.1:6379/0"), JOB, prefix=f"test-{uuid4().hex}:")
    yield s
    s.delete_all()


def run_until(loop: ServiceLoop, cond, timeout_s: float = 10) -> threading.Thread:
    """Run `loop` in a thread and wait for `cond()`; the caller stops the loop."""
    t = threading.Thread(target=loop.run, daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.02)
    return t


def test_own_pending_first_one_at_a_time_then_new_entries_in_a_batch(js: JobStreams) -> None:
    js.ensure_group(C.stream, C.group)
    left = js.publish_many(PROMPTS, [prompt(i) for i in range(2)])
    js.consume(C, block_ms=None)  # a predecessor of the same name took them and died
    new = js.publish_many(PROMPTS, [prompt(i) for i in range(2, 5)])
    rec = Recorder(js)
    loop = ServiceLoop(js, C, rec, block_ms=50)
    t = run_until(loop, lambda: sum(map(len, rec.batches)) == 5)
    control(js, "drain")
    t.join(5)
    assert not t.is_alive()
    assert rec.batches == [[left[0]], [left[1]], new]
    assert js.pending_count(PROMPTS, GROUP_GENERATORS) == 0
    assert rec.ticks >= 3


def test_top_up_takes_what_is_already_waiting(js: JobStreams) -> None:
    js.ensure_group(C.stream, C.group)
    ids = js.publish_many(PROMPTS, [prompt(i) for i in range(4)])
    rec = Recorder(js, batch=1, want=3)
    loop = ServiceLoop(js, C, rec, block_ms=50)
    got = loop.read()  # no own pending entries: 1 new one, topped up to 3
    assert [d.entry_id for d in got] == ids[:3]
    assert [d.entry_id for d in loop.read()] == ids[3:]  # what is left: fewer than wanted


def test_pause_holds_the_batch_and_resume_serves_it(js: JobStreams) -> None:
    js.ensure_group(C.stream, C.group)
    control(js, "pause")
    (eid,) = js.publish_many(PROMPTS, [prompt(0)])
    rec = Recorder(js)
    loop = ServiceLoop(js, C, rec, block_ms=50)
    t = run_until(loop, lambda: rec.ticks >= 5)
    assert rec.batches == [] and loop.control.state == "paused"
    control(js, "resume")
    deadline = time.monotonic() + 10
    while not rec.batches and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rec.batches == [[eid]]
    control(js, "cancel")
    t.join(5)
    assert not t.is_alive() and loop.control.state == "cancelled"


def test_a_stop_is_not_for_this_service_a_drain_is(js: JobStreams) -> None:
    control(js, "stop")
    rec = Recorder(js)
    loop = ServiceLoop(js, C, rec, block_ms=20)
    t = run_until(loop, lambda: rec.idles >= 2)
    assert loop.control.state == "running"
    control(js, "drain")
    t.join(5)
    assert not t.is_alive() and loop.control.state == "stopping"


def test_garbage_never_reaches_the_handler_and_is_counted(js: JobStreams) -> None:
    js.ensure_group(C.stream, C.group)
    js.publish_raw(PROMPTS, {FIELD: b"\xc1"})
    ok = js.publish(PROMPTS, prompt(1))
    counted: list[tuple[str, str]] = []
    rec = Recorder(js)
    loop = ServiceLoop(js, C, rec, block_ms=50, on_dead_letter=lambda s, code: counted.append((s, code)))
    t = run_until(loop, lambda: rec.batches)
    control(js, "drain")
    t.join(5)
    assert rec.batches == [[ok]] and counted == [(PROMPTS, "malformed")]


def test_a_wait_cut_short_by_sigterm_exits_drained_and_leaves_the_batch_pending(js: JobStreams) -> None:
    class Waits(Recorder):
        def handle(self, deliveries: list[Delivery]) -> None:  # e.g. waiting for a policy version
            self.batches.append([d.entry_id for d in deliveries])
            raise Drained("SIGTERM while waiting for policy version 3")

    ids = js.publish_many(PROMPTS, [prompt(0), prompt(1)])
    loop = ServiceLoop(js, C, Waits(js), block_ms=50)
    assert loop.run() == "terminating"
    # Nothing acked: the entries are this consumer's pending ones, first for its successor.
    again = ServiceLoop(js, C, Recorder(js), block_ms=50)
    assert [d.entry_id for d in again.read()] == ids[:1]


def test_live_knobs_are_taken_once(js):
    """The trainer applies the knobs set since it last took them: two sets merge (the later value
    wins), and a take hands them over once; `settings` keeps every knob set so far."""
    w = ControlWatcher(js)
    for i, knobs in enumerate(({"lr": 1e-4, "temperature": 0.7}, {"lr": 2e-4})):
        js.publish(CONTROL, Control(job_id=JOB, msg_id=f"set-{i}", policy_version=0, command="set", settings=knobs))
    w.poll()
    assert w.take_changes() == {"lr": 2e-4, "temperature": 0.7} and w.take_changes() == {}
    js.publish(CONTROL, Control(job_id=JOB, msg_id="set-2", policy_version=0, command="set", settings={"top_p": 0.9}))
    w.poll()
    assert w.take_changes() == {"top_p": 0.9}
    assert w.settings == {"lr": 2e-4, "temperature": 0.7, "top_p": 0.9}
