"""The reward service against real Redis and a SQLite ledger: scoring hostile programs with the
sandboxed `python_exec` reward, it scores what can be scored, dead-letters what cannot (with the
reason and a per-reason metric), and keeps running until the job drains; with a user plug-in that
hangs or raises on some rollouts, the others are scored anyway and the failures follow the
reward's on_failure (reward 0.0 with the status in the ledger and on the wire, or dead letters);
a plug-in's outputs are bounded (named components; a scored message over MAX_MESSAGE_BYTES is
dead-lettered, never published); a plug-in that does not import (raises, exits, crashes, hangs)
fails its job with the reason."""

from __future__ import annotations

import os
import textwrap
import threading
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from broker.streams import CONTROL, FIELD, ROLLOUTS, SCORED, JobStreams, connect
from reward_svc import service
from shared.entry import JobOver
from shared.jobspec import JobSpec
from shared.rewards import RewardLoadError
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


def rollout(job: str, name: str, completion: str, *, tokens: int = 3, group: str = "g") -> Rollout:
    return Rollout(
        job_id=job,
        msg_id=f"{job}/{group}/{name}",
        group_id=f"{job}/{group}",
        policy_version=0,
        policy_version_max=0,
        prompt_index=0,
        sample_index=0,
        group_size=1,
        generator_id="gen",
        prompt_ids=pack_i32([1, 2]),
        completion_ids=pack_i32(range(tokens)),
        logprobs=pack_f32([-0.5] * tokens),
        completion=completion,
        answer="55",
        prompt="what is 1+...+10?",
        metadata={"row": name},
    )


def open_setup(tmp_path, reward, eval_sets=(), spec_kw=None, **settings_kw):
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    job = f"rw-{uuid.uuid4().hex[:8]}"
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    spec = JobSpec(model_path="/nonexistent", reward=reward, eval_sets=list(eval_sets), **(spec_kw or {}))
    spec = spec.model_dump(mode="json")
    ledger.create_job(job, "reward-test", spec, state="running")
    streams = JobStreams(connect(redis_url), job, prefix=prefix, max_message_bytes=4096)
    settings = RewardSettings(
        redis_url=redis_url,
        database_url=str(ledger.url),
        job_id=job,
        stream_prefix=prefix,
        max_message_bytes=4096,
        block_ms=100,
        batch=4,
        job_wait_s=5,
        **settings_kw,
    )
    return job, ledger, streams, settings


@pytest.fixture
def setup(tmp_path):
    job, ledger, streams, settings = open_setup(tmp_path, "python_exec")
    yield job, ledger, streams, settings
    streams.delete_all()
    ledger.close()


def test_reward_service_survives_hostile_programs_and_bad_input(setup, monkeypatch) -> None:
    job, ledger, streams, settings = setup
    good = [rollout(job, name, prog) for name, (prog, _) in PROGRAMS.items()]
    empty = rollout(job, "empty", "", tokens=0)
    ledger.record_generated(
        [
            {
                "msg_id": r.msg_id,
                "job_id": job,
                "group_id": r.group_id,
                "sample_index": 0,
                "prompt_index": 0,
                "generator_id": "gen",
                "gen_version_min": 0,
                "num_prompt_tokens": 2,
                "num_completion_tokens": len(r.completion_ids) // 4,
                "completion": r.completion,
            }
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
    assert all(rows[n]["reward_status"] == "ok" for n in PROGRAMS)
    assert rows["empty"]["status"] == "generated"

    dead = {d.code: d for d in streams.dead_letters()}
    assert set(dead) == {"malformed", "empty_completion", "oversized"}
    assert "no completion tokens" in dead["empty_completion"].reason
    assert "exceeds the limit of 4096 bytes" in dead["oversized"].reason
    assert sorted(counted) == sorted([(ROLLOUTS, c) for c in dead])
    assert streams.pending_count(ROLLOUTS, "rewarders") == 0
    assert not os.path.exists("/tmp/asyncrl-reward-escape")


PLUGIN = textwrap.dedent(
    """
    import time

    def score(completion, answer, *, metadata):
        if completion == "hang":
            time.sleep(10**6)
        if completion == "boom":
            raise RuntimeError("scorer bug on " + metadata["row"])
        return {"correct": 1.0, "row_len": float(len(metadata["row"]))}
    """
)
BUDGET = 2.0


def serve_until(streams, settings, n_scored: int, n_dead: int = 0, limit_s: float = 60) -> float:
    """Run the service in a thread until n_scored are published and n_dead dead-lettered; drain it.
    Returns the seconds that took."""
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            service.run(settings)
        except BaseException as exc:  # the test reports it below
            errors.append(exc)

    t = threading.Thread(target=serve, daemon=True)
    t0 = time.monotonic()
    t.start()
    deadline = t0 + limit_s
    while (streams.length(SCORED) < n_scored or len(streams.dead_letters()) < n_dead) and time.monotonic() < deadline:
        assert t.is_alive(), errors
        time.sleep(0.1)
    took = time.monotonic() - t0
    streams.publish(CONTROL, Control(job_id=streams.job_id, msg_id="end", policy_version=0, command="drain"))
    t.join(30)
    assert not t.is_alive() and errors == []
    return took


@pytest.mark.parametrize("workers", [1, 0])
def test_a_hung_or_raising_reward_does_not_stop_the_others_and_scores_zero(tmp_path, workers) -> None:
    path = tmp_path / "user_rewards.py"
    path.write_text(PLUGIN)
    reward = {"kind": "python", "function": f"{path}:score", "timeout_s": BUDGET}
    job, ledger, streams, settings = open_setup(tmp_path, reward, workers=workers)
    try:
        names = ["a", "hang", "boom", "b", "c", "d", "e", "f"]  # batches of 4: the hang is in the first
        streams.publish_many(ROLLOUTS, [rollout(job, n, n) for n in names])
        took = serve_until(streams, settings, n_scored=len(names))
        assert took < BUDGET + 30  # one budget for the hang, not one per batch, nor forever

        scored = {
            s.msg_id.rsplit("/", 1)[1]: s
            for s in (decode(f[FIELD], Scored) for _, f in streams.r.xrange(streams.key(SCORED)))
        }
        assert set(scored) == set(names)
        fine = [n for n in names if n not in ("hang", "boom")]
        assert all(scored[n].reward == 1.0 + len(n) and scored[n].reward_status == "ok" for n in fine)
        assert scored["a"].details == {"correct": 1.0, "row_len": 1.0}
        assert (scored["hang"].reward, scored["hang"].reward_status) == (0.0, "timeout")
        assert "over the time budget of 2 s" in scored["hang"].reward_reason
        assert (scored["boom"].reward, scored["boom"].reward_status) == (0.0, "error")
        assert "RuntimeError: scorer bug on boom" in scored["boom"].reward_reason

        rows = {r["msg_id"].rsplit("/", 1)[1]: r for r in ledger.samples(job)}
        assert rows["hang"]["status"] == "scored" and rows["hang"]["reward_status"] == "timeout"
        assert rows["boom"]["reward_status"] == "error"
        assert "scorer bug on boom" in rows["boom"]["reward_details"]["reason"]
        assert rows["a"]["reward_status"] == "ok" and rows["a"]["reward_details"]["components"] == {
            "correct": 1.0,
            "row_len": 1.0,
        }
        assert streams.pending_count(ROLLOUTS, "rewarders") == 0  # nothing left pending for redelivery
    finally:
        streams.delete_all()
        ledger.close()


def test_on_failure_drop_dead_letters_the_failed_rollouts(tmp_path) -> None:
    path = tmp_path / "user_rewards.py"
    path.write_text(PLUGIN)
    reward = {"kind": "python", "function": f"{path}:score", "timeout_s": BUDGET, "on_failure": "drop"}
    job, ledger, streams, settings = open_setup(tmp_path, reward, workers=1)
    try:
        streams.publish_many(ROLLOUTS, [rollout(job, n, n, group=n) for n in ("hang", "boom", "ok")])
        serve_until(streams, settings, n_scored=1, n_dead=2)
        assert [decode(f[FIELD], Scored).msg_id for _, f in streams.r.xrange(streams.key(SCORED))] == [f"{job}/ok/ok"]
        dead = {d.code: d for d in streams.dead_letters()}
        assert set(dead) == {"reward_timeout", "reward_error"}
        assert dead["reward_timeout"].reason.startswith("reward timeout: ")
        assert "scorer bug on boom" in dead["reward_error"].reason
        rows = {r["msg_id"].rsplit("/", 1)[1]: r for r in ledger.samples(job)}
        assert rows["hang"]["status"] == rows["boom"]["status"] == "generated"  # the trainer drops the groups
        assert streams.pending_count(ROLLOUTS, "rewarders") == 0
    finally:
        streams.delete_all()
        ledger.close()


OUT_OF_RANGE = textwrap.dedent(
    """
    def score(completion, answer):
        rewards = {"huge": 1e308, "inf": float("inf"), "nan": float("nan"), "low": -1.5}
        if completion == "parts":
            return {"a": -0.5, "b": 1.25}
        return rewards.get(completion, 0.5)
    """
)


def test_a_reward_outside_the_jobs_range_is_the_samples_reward_error(tmp_path) -> None:
    """reward_limits.bounds [-1, 1]: 1e308 (which overflowed the trainer's advantages into `loss is
    nan`), inf, NaN, -1.5 and a component of 1.25 (of a sum 0.75) are each that sample's reward error (reward 0.0 under
    on_failure zero, status error, the value in the reason), on the wire and in the ledger; an
    in-range reward is scored as usual."""
    path = tmp_path / "range_rewards.py"
    path.write_text(OUT_OF_RANGE)
    spec_kw = {"reward_limits": {"bounds": [-1, 1]}}
    job, ledger, streams, settings = open_setup(tmp_path, f"{path}:score", spec_kw=spec_kw)
    try:
        names = ["huge", "inf", "nan", "low", "parts", "fine"]
        streams.publish_many(ROLLOUTS, [rollout(job, n, n, group=n) for n in names])
        serve_until(streams, settings, n_scored=len(names))
        scored = {
            s.msg_id.rsplit("/", 1)[1]: s
            for s in (decode(f[FIELD], Scored) for _, f in streams.r.xrange(streams.key(SCORED)))
        }
        assert (scored["fine"].reward, scored["fine"].reward_status) == (0.5, "ok")
        says = {
            "huge": "reward 1e+308 is outside the job's range [-1, 1]",
            "inf": "reward inf is outside",
            "nan": "reward nan is outside",
            "low": "reward -1.5 is outside",
            "parts": "reward component 'b' 1.25 is outside",
        }
        for name, why in says.items():
            s = scored[name]
            assert (s.reward, s.reward_status, s.details) == (0.0, "error", {}), name
            assert s.reward_reason.startswith(why), (name, s.reward_reason)
        rows = {r["msg_id"].rsplit("/", 1)[1]: r for r in ledger.samples(job)}
        assert {n: rows[n]["reward_status"] for n in names} == {**dict.fromkeys(says, "error"), "fine": "ok"}
        assert ledger.reward_status_counts(job) == {"error": 5, "ok": 1}
        assert streams.dead_letters() == []
    finally:
        streams.delete_all()
        ledger.close()


def test_an_eval_set_with_its_own_reward_is_scored_with_it(tmp_path) -> None:
    path = tmp_path / "user_rewards.py"
    path.write_text(PLUGIN + "\n\ndef strict(completion, answer):\n    return -1.0\n")
    eval_sets = [{"name": "hard", "reward": f"{path}:strict"}, {"name": "held_out"}]  # held_out: the job's reward
    job, ledger, streams, settings = open_setup(tmp_path, f"{path}:score", eval_sets, workers=1)
    try:
        train, held, hard = (rollout(job, n, "xy", group=n) for n in ("train", "held", "hard"))
        held = held.model_copy(update={"purpose": "eval", "eval_set": "held_out"})
        hard = hard.model_copy(update={"purpose": "eval", "eval_set": "hard"})
        streams.publish_many(ROLLOUTS, [train, held, hard])
        serve_until(streams, settings, n_scored=3)
        rewards = {
            s.msg_id.rsplit("/", 1)[1]: s.reward
            for s in (decode(f[FIELD], Scored) for _, f in streams.r.xrange(streams.key(SCORED)))
        }
        assert rewards == {"train": 1.0 + len("train"), "held": 1.0 + len("held"), "hard": -1.0}
    finally:
        streams.delete_all()
        ledger.close()


@pytest.mark.parametrize(
    ("source", "says"),
    [
        (None, "missing_rewards.py' does not exist"),
        ("import sys\nsys.exit(0)\n", "failed: it called sys.exit(0)"),
        ("import os\nos._exit(0)\n", "ended while loading the reward (exit code 0)"),
        ("import ctypes\nctypes.string_at(0)\n", "ended while loading the reward (killed by SIGSEGV)"),
        ("import time\ntime.sleep(600)\n", "did not load the reward within 2 s"),
    ],
)
def test_a_plugin_that_does_not_import_fails_its_job_with_the_reason(tmp_path, source, says) -> None:
    path = tmp_path / "missing_rewards.py"
    if source is not None:
        path.write_text(source + "\ndef score(completion, answer):\n    return 1.0\n")
    limit = 2.0 if "within" in says else 60.0  # the others end when the child does
    job, ledger, streams, settings = open_setup(tmp_path, f"{path}:score", import_timeout_s=limit)
    try:
        with pytest.raises(JobOver, match="reward cannot be built") as exc:
            service.run(settings)  # JOB_ID's one job fails, the service exits 0 (a fleet's goes on)
        assert says in str(exc.value) and isinstance(exc.value.__cause__, RewardLoadError)
        row = ledger.get_job(job)
        assert row["state"] == "failed" and says in row["error"] and row["error"].startswith("reward: ")
        assert [m.command for m in streams.read_broadcast(CONTROL, "0", Control)[1]] == ["cancel"]
    finally:
        streams.delete_all()
        ledger.close()


def test_a_plugins_outputs_are_bounded_components_and_message_size(tmp_path) -> None:
    path = tmp_path / "wide_rewards.py"
    path.write_text(
        "def score(completion, answer):\n"
        "    n = {'huge': 200_000, 'wide': 100}.get(completion, 1)\n"
        "    return {f'{completion}-{i:06d}-' + 'x' * 80: 0.0 for i in range(n)}\n"
    )
    job, ledger, streams, settings = open_setup(tmp_path, f"{path}:score", workers=0)  # messages of 4096 bytes
    try:
        streams.publish_many(ROLLOUTS, [rollout(job, n, n, group=n) for n in ("huge", "wide", "ok")])
        serve_until(streams, settings, n_scored=2, n_dead=1)
        scored = {
            s.msg_id.rsplit("/", 1)[1]: s
            for s in (decode(f[FIELD], Scored) for _, f in streams.r.xrange(streams.key(SCORED)))
        }
        assert set(scored) == {"huge", "ok"}
        assert (
            scored["huge"].reward_status == "error"
            and "200000 named components; at most 256" in scored["huge"].reward_reason
        )
        assert scored["huge"].details == {} and len(scored["ok"].details) == 1
        (dead,) = streams.dead_letters()
        assert dead.code == "oversized" and "over MAX_MESSAGE_BYTES (4096)" in dead.reason
        assert all(len(raw) <= 4096 for _, f in streams.r.xrange(streams.key(SCORED)) for raw in [f[FIELD]])
        assert streams.pending_count(ROLLOUTS, "rewarders") == 0
    finally:
        streams.delete_all()
        ledger.close()


def test_reward_metrics_count_outcomes_by_status() -> None:
    registry = CollectorRegistry()
    metrics = service.RewardMetrics(registry, "j")
    metrics.statuses({"ok": 3, "timeout": 1, "error": 0})
    metrics.statuses({"ok": 1})

    def value(status: str) -> float | None:
        return registry.get_sample_value("asyncrl_reward_status_total", {"job_id": "j", "status": status})

    assert (value("ok"), value("timeout"), value("error")) == (4.0, 1.0, None)
