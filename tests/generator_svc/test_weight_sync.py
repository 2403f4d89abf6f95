"""Weight sync against real generator processes (vLLM CPU engine), driven by a trainer-side publisher.

One scenario, in order: a generator that starts late loads the newest version only; two generators
end on the same engine fingerprint; a restarted trainer (new server, new port) is followed; a
transfer cut midway leaves the old weights serving; a version whose probe the engine cannot
reproduce is refused loudly and never recorded as loaded.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
import uuid

import msgpack
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


def _half_sending_server() -> tuple[socket.socket, str]:
    """Answers a weight request with 'ok' and half of the bytes, then hangs up."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                (n,) = struct.unpack("<I", conn.recv(4))
                req = msgpack.unpackb(conn.recv(n))
                body = msgpack.packb({"ok": True, "nbytes": req["length"]})
                conn.sendall(struct.pack("<I", len(body)) + body + b"\0" * (req["length"] // 2))

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"127.0.0.1:{srv.getsockname()[1]}"


def test_weight_sync_late_join_fingerprints_restart_interruption_and_bad_probe(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.tiny_model import build_tiny_model
    from trainer_svc.weights import flatten_weights, probe, publish_weights

    model_dir = build_tiny_model(tmp_path / "m", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    db_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(db_url)
    job_id = f"ws{uuid.uuid4().hex[:8]}"
    ledger.create_job(job_id, "weight-sync", JobSpec(model_path=str(model_dir)).model_dump(mode="json"), "running")
    prefix = f"ws-{uuid.uuid4().hex[:8]}:"
    streams = JobStreams(connect(redis_url), job_id, prefix=prefix)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    server = TcpWeightServer(keep=3)

    def publish(v: int, srv=None, run: str = "run-1") -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        publish_weights(model, v, srv or server, streams, ledger, job_id, keep=3, run_id=run)

    def loads(gen: str) -> list[int]:
        return sorted(r["version"] for r in ledger.generator_loads(job_id) if r["generator_id"] == gen)

    def fingerprint(gen: str, v: int) -> str | None:
        return next(
            (
                r["fingerprint"]
                for r in ledger.generator_loads(job_id)
                if r["generator_id"] == gen and r["version"] == v
            ),
            None,
        )

    def wait_for(cond, what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            bad = [p for p in sup.failed()]
            assert not bad, f"{bad[0].name} died:\n{sup.tail(bad[0].name, 60)}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{sup.tail('gen-a', 40)}"
            time.sleep(0.2)

    env = {
        "REDIS_URL": redis_url,
        "DATABASE_URL": db_url,
        "STREAM_PREFIX": prefix,
        "JOB_ID": job_id,
        "PYTHONUNBUFFERED": "1",
        "GEN_BLOCK_MS": "200",
    }
    sup = Supervisor(tmp_path / "logs", env)
    try:
        publish(0)
        publish(1)
        sup.start("gen-a", "generator_svc", {"GEN_GENERATOR_ID": "gen-a"})
        wait_for(lambda: loads("gen-a") == [1], "gen-a to load v1")
        assert loads("gen-a") == [1]  # joined after v1: never loaded the stale v0

        publish(2)
        wait_for(lambda: 2 in loads("gen-a"), "gen-a to load v2")
        sup.start("gen-b", "generator_svc", {"GEN_GENERATOR_ID": "gen-b"})
        wait_for(lambda: loads("gen-b") == [2], "late gen-b to load v2")
        fa, fb = fingerprint("gen-a", 2), fingerprint("gen-b", 2)
        assert fa and fa == fb  # two engines hold bit-identical weights
        assert fingerprint("gen-a", 1) != fa

        # the trainer restarts (new process, resumed at the next version): new server, new port
        server.close()
        server2 = TcpWeightServer(keep=3)
        publish(3, server2, run="run-2")
        wait_for(lambda: 3 in loads("gen-a") and 3 in loads("gen-b"), "both to follow the restarted trainer")
        assert fingerprint("gen-a", 3) == fingerprint("gen-b", 3)

        # a transfer cut midway: both keep serving v3 (nothing recorded for v4), and stay up
        srv, addr = _half_sending_server()
        ann = streams.latest(POLICY, PolicyAnnouncement)[1]
        bad = ann.model_copy(
            update={
                "msg_id": f"{job_id}/v4-cut",
                "policy_version": 4,
                "address": addr,
                "manifest": ann.manifest.model_copy(update={"version": 4}),
            }
        )
        streams.publish(POLICY, bad)
        time.sleep(4)
        assert 4 not in loads("gen-a") and 4 not in loads("gen-b")
        assert {h["version"] for h in streams.heartbeats().values()} == {3}
        assert not sup.failed()
        srv.close()
        publish(5, server2, run="run-2")  # and recover on the next good version
        wait_for(lambda: 5 in loads("gen-a") and 5 in loads("gen-b"), "recovery on v5")

        # a version whose probe the engine cannot reproduce: refused, reported, never recorded
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        entries, buf = flatten_weights(model)
        manifest = build_manifest(6, entries, buf)
        server2.serve(manifest, buf)
        ids, lp = probe(model)
        lp[3] += 0.5  # what a silently wrong load would look like from the outside
        streams.publish(
            POLICY,
            PolicyAnnouncement(
                job_id=job_id,
                msg_id=f"{job_id}/v6",
                policy_version=6,
                manifest=manifest,
                transport="tcp",
                address=server2.address,
                trainer_run="run-2",
                probe_ids=pack_i32(ids),
                probe_logprobs=pack_f32(lp),
            ),
        )
        deadline = time.monotonic() + 120
        while any(p.popen.poll() is None for p in sup.procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(p.popen.returncode == 1 for p in sup.procs), [p.popen.returncode for p in sup.procs]
        assert "do not reproduce the trainer's probe" in sup.tail("gen-a", 200)
        assert 6 not in loads("gen-a") and 6 not in loads("gen-b")
        server2.close()
    finally:
        sup.stop_all()
        streams.delete_all()
