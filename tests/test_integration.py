"""The whole loop as separate OS processes: broker API, vLLM generator, reward, trainer.

Real Redis (REDIS_URL or the local server), real vLLM CPU engine on a tiny locally built model, the
ledger on SQLite (or DATABASE_URL). Malformed entries are injected on every stream while the job
runs; they must land in the dead-letter stream while the services keep going.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import httpx
import pytest

from broker.launch import Supervisor
from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from broker.streams import CONTROL, POLICY, PROMPTS, ROLLOUTS, SCORED, JobStreams, connect
from shared.schema import Control, encode

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from trainer_svc.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0)  # vLLM CPU attention needs head_dim >= 32


@pytest.fixture(scope="module")
def db_url(tmp_path_factory):
    """One ledger for both runs: jobs sharing a database must not collide on sample keys."""
    return os.environ.get("DATABASE_URL") or f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.db'}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inject_malformed(streams: JobStreams, job_id: str) -> int:
    """One bad entry per stream; returns how many were injected."""
    wrong_kind = encode(Control(job_id=job_id, msg_id="x", policy_version=0, command="pause"))
    streams.publish_raw(PROMPTS, {b"d": b"\xc1 not msgpack"})
    streams.publish_raw(ROLLOUTS, {b"d": wrong_kind})  # a control message on the rollouts stream
    streams.publish_raw(SCORED, {b"x": b"no d field"})
    streams.publish_raw(POLICY, {b"d": b"\x93\x01\x02\x03"})  # a msgpack list, not a map
    streams.publish_raw(CONTROL, {b"d": b"\xff" * 10})
    return 5


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_full_loop_as_processes(tmp_path, tiny_model, db_url, mode):
    sup, api, redis_url, prefix = _stack(tmp_path, db_url, "it")
    k = 1
    try:
        _start_broker(sup, api)
        spec = {"name": f"it-{mode}", "model_path": str(tiny_model), "mode": mode, "max_staleness": k,
                "steps": STEPS, "group_size": 4, "prompts_per_step": 4, "eval_every": 2,
                "task": {"n_train": 64, "n_test": 16}, "sampling": {"max_tokens": 8}}
        if mode == "async":  # the adaptive bound runs inside the loop and is logged per step
            spec["adaptive_staleness"] = {"k_min": 0, "k_max": k, "metric": "ess", "threshold": 0.5}
        r = httpx.post(f"{api}/jobs", json=spec, timeout=30)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        streams = JobStreams(connect(redis_url), job_id, prefix=prefix)
        ledger = Ledger(db_url)
        for name, module in (("trainer", "trainer_svc"), ("generator", "generator_svc")):
            sup.start(name, module, {"JOB_ID": job_id})
        # Once the generator follows the policy stream, and before the reward service exists (so no
        # step can run yet), put a malformed entry on every stream: each reader meets one mid-run.
        deadline = time.monotonic() + 300
        while not ledger.generator_loads(job_id):
            assert not sup.failed(), "\n".join(f"{p.name}:\n{sup.tail(p.name)}" for p in sup.failed())
            assert time.monotonic() < deadline, sup.tail("generator")
            time.sleep(0.2)
        injected = _inject_malformed(streams, job_id)
        sup.start("reward", "reward_svc", {"JOB_ID": job_id})
        deadline = time.monotonic() + 400
        while True:
            job = httpx.get(f"{api}/jobs/{job_id}", timeout=30).json()
            if job["state"] in ("finished", "failed", "stopped"):
                break
            assert not sup.failed(), "\n".join(f"{p.name}:\n{sup.tail(p.name)}" for p in sup.failed())
            assert time.monotonic() < deadline, f"job stuck at {job}\n{sup.tail('trainer')}\n{sup.tail('generator')}"
            time.sleep(1)
        assert job["state"] == "finished", f"{job}\n{sup.tail('trainer')}"
        # the trainer's end-of-job stop makes the other services exit on their own, cleanly
        assert sup.wait_all(60, exclude=("broker",)), "services did not exit after the job finished"
        assert [p.popen.returncode for p in sup.procs if p.name != "broker"] == [0, 0, 0], sup.tail("generator")
    finally:
        sup.stop_all()

    steps = ledger.train_steps(job_id)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:  # per-step algorithm and staleness metrics
        m = s["metrics"]
        assert 0 < m["is/ess"] <= 1.0 + 1e-6 and m["entropy"] > 0 and "mismatch_kl" in m
        assert 0 <= m["staleness/bound"] <= (0 if mode == "sync" else k)
    trained = ledger.samples(job_id, status="trained")
    # every trained sample has its row, reward and the step's trainer version
    assert len(trained) == STEPS * 4 * 4 == sum(s["metrics"]["samples"] for s in steps)
    assert all(s["reward"] is not None and s["status"] == "trained" for s in trained)
    for s in trained:
        assert s["staleness"] == s["trainer_version"] - s["gen_version_min"]
        assert 0 <= s["staleness"] <= (0 if mode == "sync" else k)  # within the bound
    # generation versions increase with the trainer's version
    per_step: dict[int, list[int]] = {}
    for s in trained:
        per_step.setdefault(s["trainer_version"], []).append(s["gen_version_min"])
    lows = [min(per_step[v]) for v in sorted(per_step)]
    highs = [max(per_step[v]) for v in sorted(per_step)]
    k_eff = 0 if mode == "sync" else k
    assert lows == sorted(lows) and highs == sorted(highs)
    assert STEPS - 1 - k_eff <= highs[-1] <= STEPS - 1
    # the generator loaded every version it generated with, and the final one
    loads = {(row["generator_id"], row["version"]) for row in ledger.generator_loads(job_id)}
    loaded = {v for _, v in loads}
    used_versions = {s["gen_version_min"] for s in ledger.samples(job_id)}
    assert used_versions <= loaded and STEPS in loaded
    if mode == "sync":
        assert loaded == set(range(STEPS + 1))  # sync: every version is loaded before its batch
    assert {v["version"] for v in ledger.policy_versions(job_id)} == set(range(STEPS + 1))
    # held-out evaluation ran through the same pipeline (steps 0, 2 and the final 4)
    assert [e["step"] for e in ledger.evals(job_id)] == [0, 2, 4]
    assert all(e["n"] == 16 for e in ledger.evals(job_id))
    # no sample is left unscored except ones still in flight when the job ended
    counts = ledger.status_counts(job_id)
    assert counts.get("generated", 0) <= 4 * 4 * (k + 1)
    # every malformed entry was dead-lettered with a reason (broadcast entries once per reader)
    dead = streams.dead_letters()
    by_stream = {d.stream for d in dead}
    assert by_stream == {PROMPTS, ROLLOUTS, SCORED, POLICY, CONTROL}, [(d.stream, d.reason) for d in dead]
    assert len(dead) >= injected
    assert all(d.reason for d in dead)
    reasons = " | ".join(d.reason for d in dead)
    assert "not valid msgpack" in reasons and "on a stream that carries 'rollout'" in reasons
    streams.delete_all()


def test_live_control_pause_resume_patch_stop(tmp_path, tiny_model, db_url):
    """Pause really stops steps and loses nothing; PATCHed knobs apply at the next step; stop drains."""
    sup, api, _, _ = _stack(tmp_path, db_url, "lc")
    ledger = Ledger(db_url)

    def job() -> dict:
        return httpx.get(f"{api}/jobs/{job_id}", timeout=30).json()

    def wait(cond, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert not sup.failed(), "\n".join(f"{p.name}:\n{sup.tail(p.name)}" for p in sup.failed())
            assert time.monotonic() < deadline, f"timed out: {what}\n{sup.tail('trainer')}"
            time.sleep(0.3)

    try:
        _start_broker(sup, api)
        spec = {"name": "live", "model_path": str(tiny_model), "steps": 500, "group_size": 4, "prompts_per_step": 4,
                "eval_every": 0, "task": {"n_train": 64, "n_test": 8}, "sampling": {"max_tokens": 8},
                "algorithm": {"lr": 1e-4}}
        job_id = httpx.post(f"{api}/jobs", json=spec, timeout=30).json()["id"]
        for name, module in (("generator", "generator_svc"), ("reward", "reward_svc"), ("trainer", "trainer_svc")):
            sup.start(name, module, {"JOB_ID": job_id})
        wait(lambda: job()["step"] >= 2, "two steps")

        assert httpx.post(f"{api}/jobs/{job_id}/pause", timeout=30).status_code == 202
        time.sleep(2)  # a step in progress may finish
        paused_at = job()["step"]
        counts = ledger.status_counts(job_id)
        time.sleep(4)
        assert job()["step"] == paused_at and job()["state"] == "paused"  # no step advances while paused
        assert ledger.status_counts(job_id) == counts  # and nothing moves (generation stopped too)

        r = httpx.patch(f"{api}/jobs/{job_id}", json={"lr": 5e-5, "temperature": 0.8}, timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.post(f"{api}/jobs/{job_id}/resume", timeout=30).status_code == 202
        wait(lambda: job()["step"] >= paused_at + 3, "steps after resume")
        steps = ledger.train_steps(job_id)
        assert steps[-1]["metrics"]["lr"] == pytest.approx(5e-5)  # the live knob reached the trainer
        assert all(s["metrics"]["lr"] == pytest.approx(1e-4) for s in steps if s["step"] <= paused_at)

        assert httpx.post(f"{api}/jobs/{job_id}/stop", timeout=30).status_code == 202
        wait(lambda: job()["state"] == "stopped", "drain to stopped", 120)
        assert sup.wait_all(60, exclude=("broker",)), "services did not exit after stop"
        # nothing lost across the pause: every sample is accounted for, none dropped as stale
        final = ledger.status_counts(job_id)
        assert final.get("dropped", 0) == 0 and final["trained"] == job()["step"] * 4 * 4
        actions = [c["changes"].get("command") for c in ledger.job_changes(job_id)]
        assert actions == ["pause", "set", "resume", "stop"]
        # the stop left a committed, loadable HF checkpoint of the final step
        (ck,) = httpx.get(f"{api}/jobs/{job_id}/checkpoints", timeout=30).json()
        assert ck["step"] == job()["step"] and os.path.exists(os.path.join(ck["path"], "COMMIT"))
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(ck["path"]).config.vocab_size > 0
    finally:
        sup.stop_all()


def _stack(tmp_path, db_url: str, tag: str) -> tuple[Supervisor, str, str, str]:
    """A supervisor whose processes share the real Redis (a fresh key prefix), the ledger, and a
    broker port: (supervisor, API base URL, Redis URL, stream prefix)."""
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    prefix = f"{tag}-{uuid.uuid4().hex[:8]}:"
    port = _free_port()
    env = {"REDIS_URL": redis_url, "DATABASE_URL": db_url, "STREAM_PREFIX": prefix, "BROKER_PORT": str(port),
           "GEN_GENERATOR_ID": "gen-0", "TRAINER_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TRAINER_CHECKPOINT_DIR": str(tmp_path / "checkpoints")}
    return Supervisor(tmp_path / "logs", env), f"http://127.0.0.1:{port}", redis_url, prefix


def _start_broker(sup: Supervisor, api: str, timeout: float = 60) -> None:
    sup.start("broker", "broker")
    deadline = time.monotonic() + timeout
    while not _healthy(api):
        assert not sup.failed() and time.monotonic() < deadline, f"broker did not come up:\n{sup.tail('broker')}"
        time.sleep(0.2)


def _healthy(api: str) -> bool:
    try:
        return httpx.get(f"{api}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
