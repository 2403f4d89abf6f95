"""Relay fan-out in the real generator service (GEN_RELAY_FANOUT): two generator processes (vLLM
CPU engine) and the trainer's publish path. The first generator by id fetches from the trainer, the
second from it, each engine loads from its own relay: one copy leaves the trainer per version,
and both engines hold the same weights. The first one killed, the second routes around it."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
import torch

from asyncrl.launch import Supervisor
from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from broker.streams import JobStreams, connect
from generator_svc.relay import RELAYS
from shared.jobspec import JobSpec
from shared.transport import TcpWeightServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_generators_relay_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.tiny_model import build_tiny_model
    from trainer_svc.weights import publish_weights

    model_dir = build_tiny_model(tmp_path / "m", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    db_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(db_url)
    job_id = f"rl{uuid.uuid4().hex[:8]}"
    ledger.create_job(job_id, "relay", JobSpec(model_path=str(model_dir)).model_dump(mode="json"), "running")
    prefix = f"rly-{uuid.uuid4().hex[:8]}:"
    streams = JobStreams(connect(redis_url), job_id, prefix=prefix)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    server = TcpWeightServer(keep=3)
    copy = sum(t.numel() * t.element_size() for t in model.state_dict().values())

    def publish(v: int) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        publish_weights(model, v, server, streams, ledger, job_id, keep=3, run_id="run-1")

    def loads(gen: str) -> dict[int, str]:
        return {r["version"]: r["fingerprint"] for r in ledger.generator_loads(job_id) if r["generator_id"] == gen}

    def wait_for(cond, what: str, alive: tuple[str, ...], timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            for p in sup.procs:
                if p.name in alive:
                    assert p.popen.poll() is None, f"{p.name} died:\n{sup.tail(p.name, 60)}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{sup.tail('gen-b', 40)}"
            time.sleep(0.2)

    env = {
        "REDIS_URL": redis_url,
        "DATABASE_URL": db_url,
        "STREAM_PREFIX": prefix,
        "JOB_ID": job_id,
        "PYTHONUNBUFFERED": "1",
        "GEN_BLOCK_MS": "200",
        "GEN_RELAY_FANOUT": "2",
    }
    sup = Supervisor(tmp_path / "logs", env)
    try:
        gens = [sup.start(g, "generator_svc", {"GEN_GENERATOR_ID": g}) for g in ("gen-a", "gen-b")]
        wait_for(
            lambda: len(streams.r.hgetall(streams.key(RELAYS))) == 2, "both relays to register", ("gen-a", "gen-b")
        )

        publish(1)
        wait_for(lambda: 1 in loads("gen-a") and 1 in loads("gen-b"), "both to load v1", ("gen-a", "gen-b"))
        assert loads("gen-a")[1] == loads("gen-b")[1]  # the same weights in both engines
        assert server.sent.bytes == copy  # one copy left the trainer: gen-b had it from gen-a
        assert "from gen-a" in sup.tail("gen-b", 400)

        # the root dies; gen-b routes around it (to the trainer) and loads v2
        gens[0].popen.send_signal(signal.SIGKILL)
        gens[0].popen.wait()
        publish(2)
        wait_for(lambda: 2 in loads("gen-b"), "gen-b to load v2 without gen-a", ("gen-b",))
        assert server.sent.bytes == 2 * copy
        entry = json.loads(streams.r.hget(streams.key(RELAYS), "gen-b"))
        assert 2 in entry["versions"]  # and serves it on
    finally:
        sup.stop_all()
        server.close()
        streams.delete_all()
        streams.r.delete(streams.key(RELAYS))
