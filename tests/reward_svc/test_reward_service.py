"""The reward service against real Redis and a SQLite ledger, scoring hostile programs with the
sandboxed `python_exec` reward: it scores what can be scored, dead-letters what cannot (with the
reason and a per-reason metric), and keeps running until the job drains."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest

from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from broker.streams import CONTROL, FIELD, ROLLOUTS, SCORED, JobStreams, connect
from reward_svc import service
from shared.jobspec import JobSpec
from shared.schema import Control, Rollout, Scored, decode, pack_f32, pack_i32
from shared.settings import RewardSettings

PROGRAMS = {
    "right": ("```python\nprint(sum(range(11)))\n```", 1.0),
    "wrong": ("```python\nprint(54)\n```", 0.0),
    "loop": ("```python\nwhile True:\n    pass\n```", 0.0),
    "memory": ("```python\nx = bytearray(10 ** 10)\nprint(55)\n```", 0.0),
    "fork": ("```python\nimport os\nwhile True:\n    os.fork()\n```", 0.0),
    "network": ("```python\nimport socket\nsocket.create_connection(('127.0.0.1', 6379))\nprint(55)\n```", 0.0),
    "escape": ("```python\nopen('/tmp/asyncrl-reward-escape', 'w').write('x')\nprint(55)\n```", 0.0),
}


def rollout(job: str, name: str, completion: str, *, tokens: int = 3) -> Rollout:
    return Rollout(
        job_id=job, msg_id=f"{job}/g/{name}", group_id=f"{job}/g", policy_version=0, policy_version_max=0,
        prompt_index=0, sample_index=0, group_size=1, generator_id="gen", prompt_ids=pack_i32([1, 2]),
        completion_ids=pack_i32(range(tokens)), logprobs=pack_f32([-0.5] * tokens), completion=completion,
        answer="55",
    )


@pytest.fixture
def setup(tmp_path):
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    job = f"rw-{uuid.uuid4().hex[:8]}"
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    spec = JobSpec(model_path="/nonexistent", reward="python_exec").model_dump(mode="json")
    ledger.create_job(job, "reward-test", spec, state="running")
    streams = JobStreams(connect(redis_url), job, prefix=prefix, max_message_bytes=4096)
    settings = RewardSettings(
        redis_url=redis_url, database_url=str(ledger.url), job_id=job, stream_prefix=prefix,
        max_message_bytes=4096, block_ms=100, batch=4, job_wait_s=5,
    )
    yield job, ledger, streams, settings
    streams.delete_all()
    ledger.close()


def test_reward_service_survives_hostile_programs_and_bad_input(setup, monkeypatch) -> None:
    job, ledger, streams, settings = setup
    good = [rollout(job, name, prog) for name, (prog, _) in PROGRAMS.items()]
    empty = rollout(job, "empty", "", tokens=0)
    ledger.record_generated(
        [
            {"msg_id": r.msg_id, "job_id": job, "group_id": r.group_id, "sample_index": 0, "prompt_index": 0,
             "generator_id": "gen", "gen_version_min": 0, "num_prompt_tokens": 2,
             "num_completion_tokens": len(r.completion_ids) // 4, "completion": r.completion}
            for r in [*good, empty]
        ]
    )
    streams.publish_many(ROLLOUTS, good[:3])
    streams.publish_raw(ROLLOUTS, {FIELD: b"\xc1 not msgpack"})
    streams.publish(ROLLOUTS, empty)
    streams.publish(ROLLOUTS, rollout(job, "huge", "x" * 8000))  # over the 4096-byte limit
    streams.publish_many(ROLLOUTS, good[3:])

    counted: list[tuple[str, str]] = []
    real = service.RewardMetrics.dead_letter
    errors: list[BaseException] = []

    def spy(self, stream: str, reason: str) -> None:
        counted.append((stream, reason))
        real(self, stream, reason)

    def serve() -> None:
        try:
            service.run(settings)
        except BaseException as exc:  # the test reports it below
            errors.append(exc)

    monkeypatch.setattr(service.RewardMetrics, "dead_letter", spy)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while streams.length(SCORED) < len(good) and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.2)
    assert t.is_alive(), errors  # still serving after every hostile program
    streams.publish(CONTROL, Control(job_id=job, msg_id="end", policy_version=0, command="drain"))
    t.join(15)
    assert not t.is_alive() and errors == []

    scored = [decode(f[FIELD], Scored) for _, f in streams.r.xrange(streams.key(SCORED))]
    rewards = {s.msg_id.rsplit("/", 1)[1]: s.reward for s in scored}
    assert rewards == {name: want for name, (_, want) in PROGRAMS.items()}
    rows = {r["msg_id"].rsplit("/", 1)[1]: r for r in ledger.samples(job)}
    assert all(rows[n]["status"] == "scored" and rows[n]["reward"] == w for n, (_, w) in PROGRAMS.items())
    assert rows["empty"]["status"] == "generated"

    dead = {d.code: d for d in streams.dead_letters()}
    assert set(dead) == {"malformed", "empty_completion", "oversized"}
    assert "no completion tokens" in dead["empty_completion"].reason
    assert "exceeds the limit of 4096 bytes" in dead["oversized"].reason
    assert sorted(counted) == sorted([(ROLLOUTS, c) for c in dead])
    assert streams.pending_count(ROLLOUTS, "rewarders") == 0
    assert not os.path.exists("/tmp/asyncrl-reward-escape")


def test_a_raising_reward_function_leaves_the_message_pending(setup, monkeypatch) -> None:
    job, ledger, streams, settings = setup

    def broken(completion: str, answer: str) -> float:
        if "boom" in completion:
            raise RuntimeError("scorer bug")
        return 1.0

    monkeypatch.setattr(service, "get_reward_fn", lambda name: broken)
    streams.publish_many(ROLLOUTS, [rollout(job, "boom", "boom"), rollout(job, "fine", "fine")])
    t = threading.Thread(target=service.run, args=(settings,), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while streams.length(SCORED) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert t.is_alive()
    streams.publish(CONTROL, Control(job_id=job, msg_id="end", policy_version=0, command="drain"))
    t.join(15)
    assert not t.is_alive()
    assert [decode(f[FIELD], Scored).msg_id for _, f in streams.r.xrange(streams.key(SCORED))] == [f"{job}/g/fine"]
    # Not acked: redelivery (XAUTOCLAIM), then after max_deliveries the dead stream, decides.
    assert streams.pending_count(ROLLOUTS, "rewarders") == 1
