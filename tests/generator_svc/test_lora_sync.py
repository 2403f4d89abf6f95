"""LoRA versions trainer -> a real generator process (vLLM CPU engine with enable_lora).

The trainer (a LoRA `Learner`) publishes only its adapter; the generator fetches it, loads it as a
vLLM LoRA adapter under a new id per version, and the probe (taken by the trainer with the
adapter applied) must be reproduced by the engine's own scoring through the adapter. An adapter
announced with the probe of the bare base model is refused: the check sees the adapter path.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

from asyncrl.launch import Supervisor
from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from broker.streams import POLICY, JobStreams, connect
from shared.jobspec import JobSpec
from shared.schema import PolicyAnnouncement, pack_f32, pack_i32
from shared.transport import TcpWeightServer, build_manifest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_lora_adapter_round_trip_with_probe(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.tiny_model import build_tiny_model
    from trainer_svc import lora
    from trainer_svc.learner import Learner
    from trainer_svc.weights import flatten_weights, probe, publish_weights

    model_dir = build_tiny_model(tmp_path / "m", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    spec = JobSpec(model_path=str(model_dir), lora={"rank": 4, "alpha": 8.0})
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    db_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(db_url)
    job_id = f"lo{uuid.uuid4().hex[:8]}"
    ledger.create_job(job_id, "lora-sync", spec.model_dump(mode="json"), "running")
    prefix = f"lo-{uuid.uuid4().hex[:8]}:"
    streams = JobStreams(connect(redis_url), job_id, prefix=prefix)
    learner = Learner(spec, "cpu")
    server = TcpWeightServer(keep=3)
    full_bytes = sum(
        t.numel() * t.element_size() for t in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().values()
    )

    def publish(v: int) -> None:
        with torch.no_grad():
            for _, p in lora.trainable(learner.model):
                p.add_(torch.randn_like(p) * 0.2)
        publish_weights(
            learner.model,
            v,
            server,
            streams,
            ledger,
            job_id,
            keep=3,
            run_id="run-1",
            snapshot=learner.snapshot(),
            lora=spec.lora.adapter(),
        )

    def loads() -> dict[int, str]:
        return {r["version"]: r["fingerprint"] for r in ledger.generator_loads(job_id)}

    def wait_for(cond, what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert not sup.failed(), sup.tail("gen-a", 60)
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{sup.tail('gen-a', 40)}"
            time.sleep(0.2)

    env = {
        "REDIS_URL": redis_url,
        "DATABASE_URL": db_url,
        "STREAM_PREFIX": prefix,
        "JOB_ID": job_id,
        "PYTHONUNBUFFERED": "1",
        "GEN_BLOCK_MS": "200",
        "GEN_GENERATOR_ID": "gen-a",
    }
    sup = Supervisor(tmp_path / "logs", env)
    try:
        publish(1)
        ann = streams.latest(POLICY, PolicyAnnouncement)[1]
        assert ann.lora == spec.lora.adapter()
        assert all(".lora_A." in t.name or ".lora_B." in t.name for t in ann.manifest.tensors)
        assert ann.manifest.total_bytes * 10 < full_bytes  # the adapter, not the model
        sup.start("gen-a", "generator_svc", {})
        wait_for(lambda: 1 in loads(), "gen-a to load adapter v1")
        publish(2)  # a new adapter id in the running engine; the old one removed
        wait_for(lambda: 2 in loads(), "gen-a to load adapter v2")
        publish(3)
        wait_for(lambda: 3 in loads(), "gen-a to load adapter v3")
        fps = loads()
        assert len({fps[1], fps[2], fps[3]}) == 3  # each fingerprint covers its adapter
        log = sup.tail("gen-a", 400)
        assert "probe gap" in log

        # an adapter announced with the bare base model's probe: the engine's scoring goes
        # through the adapter, so it cannot reproduce that probe and refuses the version
        with torch.no_grad():
            for _, p in lora.trainable(learner.model):
                p.add_(torch.randn_like(p) * 0.5)
        adapter, _ = learner.snapshot()
        entries, buf = flatten_weights(adapter)
        manifest = build_manifest(4, entries, buf)
        server.serve(manifest, buf)
        ids, lp = probe(AutoModelForCausalLM.from_pretrained(model_dir))
        streams.publish(
            POLICY,
            PolicyAnnouncement(
                job_id=job_id,
                msg_id=f"{job_id}/v4",
                policy_version=4,
                manifest=manifest,
                transport="tcp",
                address=server.address,
                trainer_run="run-1",
                probe_ids=pack_i32(ids),
                probe_logprobs=pack_f32(lp),
                lora=spec.lora.adapter(),
            ),
        )
        deadline = time.monotonic() + 120
        while sup.procs[0].popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sup.procs[0].popen.returncode == 1
        assert "do not reproduce the trainer's probe" in sup.tail("gen-a", 200)
        assert 4 not in loads()
    finally:
        sup.stop_all()
        streams.delete_all()
        server.close()
