"""A co-located job (`placement: colocated`, sync) through the real services as processes.

Each service places itself the way compose and the systemd units start it (NODE_ROLES,
NODE_PLACEMENT=colocated: shared/entry.py), so generator and trainer share every core and take
turns; the job reaches its steps with every sample trained exactly once (broker.verify), through
the same streams and ledger as a split job.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import httpx
import pytest

from asyncrl.launch import Supervisor
from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from broker.verify import verify

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_colocated_job_reaches_its_steps_exactly_once(tmp_path):
    from asyncrl.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    db_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    port = _free_port()
    env = {
        "REDIS_URL": redis_url,
        "DATABASE_URL": db_url,
        "STREAM_PREFIX": f"co-{uuid.uuid4().hex[:8]}:",
        "BROKER_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
        "TRAINER_CHECKPOINT_DIR": str(tmp_path / "ck"),
        "NODE_ROLES": "generator,reward,trainer",
        "NODE_PLACEMENT": "colocated",
    }
    sup = Supervisor(tmp_path / "logs", env)
    api = f"http://127.0.0.1:{port}"
    ledger = Ledger(db_url)
    try:
        sup.start("broker", "broker")
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{api}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert not sup.failed() and time.monotonic() < deadline, sup.tail("broker")
            time.sleep(0.2)
        spec = {
            "name": "colocated",
            "model_path": str(model),
            "placement": "colocated",
            "steps": STEPS,
            "group_size": 4,
            "prompts_per_step": 4,
            "eval_every": 0,
            "task": {"n_train": 64, "n_test": 8},
            "sampling": {"max_tokens": 8},
        }
        r = httpx.post(f"{api}/jobs", json=spec, timeout=30)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        assert r.json()["spec"]["mode"] == "sync"  # co-located alternates: sync
        for name, module in (("generator", "generator_svc"), ("reward", "reward_svc"), ("trainer", "trainer_svc")):
            sup.start(name, module, {"JOB_ID": job_id, "GEN_GENERATOR_ID": "gen-0"})
        deadline = time.monotonic() + 400
        while ledger.get_job(job_id)["state"] not in ("finished", "failed", "stopped"):
            assert not sup.failed(), "\n".join(f"{p.name}:\n{sup.tail(p.name)}" for p in sup.failed())
            assert time.monotonic() < deadline, sup.tail("trainer")
            time.sleep(0.5)
        assert ledger.get_job(job_id)["state"] == "finished", sup.tail("trainer")
        assert sup.wait_all(60, exclude=("broker",)), "services did not exit after the job finished"
    finally:
        sup.stop_all()
    cores = sorted(os.sched_getaffinity(0))
    every = f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    # each placed itself co-located: generator and trainer on every core, by the one rule
    assert f"placed on cores {every} (colocated) VLLM_CPU_OMP_THREADS_BIND={every}" in sup.tail("generator", 10_000)
    assert f"placed on cores {every} (colocated) OMP_NUM_THREADS={len(cores)} TRAINER_THREADS={len(cores)}" in sup.tail(
        "trainer", 10_000
    )
    steps = ledger.train_steps(job_id)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["metrics"]["staleness/bound"] == 0 and s["metrics"]["off_policy/max"] == 0 for s in steps)
    assert ledger.status_counts(job_id)["trained"] == STEPS * 4 * 4
    result = verify(ledger, job_id)
    assert result.ok, [v.message for v in result.violations]
    assert result.checks["trained_once"] == 0
