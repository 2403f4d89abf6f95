"""A real job on a local Redis Cluster (3 primaries + 3 replicas, `broker.redis_server.LocalCluster`),
and the same job through a failover: the primary serving the job's slot is SIGKILLed mid-job and
its replica promoted.

    python -m bench redis-cluster        # writes results/redis_cluster.json

`tests/test_redis_cluster_job.py` runs `cluster_job` too (without writing results).

What a failover loses is what replication had not carried when the primary died. On loopback a
replica is a fraction of a millisecond behind, so to lose anything at all the scenario opens a
gap first, as a flapping network would: the replica's link to its primary is cut (CLIENT KILL
TYPE master on the replica) and cut again every 50 ms for `gap_s`; a replica reconnects and
catches up at most once a second, so what the primary took since the last catch-up is what it
alone holds. The loss is then measured, not assumed: the primary's writes are paused (CLIENT
PAUSE WRITE), every entry of the job's streams is read from it, the primary is killed, and once
the replica serves the slot the streams are read from it again. Entries on the first list and not the second are lost; XINFO STREAM's entries-added on
both sides counts the same loss independently.

Where each loss ends (ARCHITECTURE.md, "Redis Cluster"): a lost prompt group (the trainer's XADD)
is never generated, so the ledger never hears of it; a lost rollout or scored entry was written by
publish_if_owned together with the XACK of its input, so the input is pending again, reclaimed
after CLAIM_IDLE_MS and redone under the same sample ids (the ledger's rows are upserts).
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import redis

from asyncrl.launch import Supervisor
from broker.ledger import USED_STATUSES, Ledger
from broker.redis_server import LocalCluster
from broker.streams import DEAD, PROMPTS, ROLLOUTS, SCORED, JobStreams
from broker.verify import verify
from shared.schema import DecodeError, PromptGroup, Rollout, Scored, decode

STREAMS = (PROMPTS, ROLLOUTS, SCORED, DEAD)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entries(node: redis.Redis, key: str, first: str) -> dict[str, bytes]:
    """Entry id -> message field of `key`'s entries from `first` on, read from one node."""
    return {eid.decode(): fields.get(b"d", b"") for eid, fields in node.xrange(key, min=first, max="+")}


def _added(node: redis.Redis, key: str) -> int:
    try:
        return int(node.xinfo_stream(key)["entries-added"])
    except redis.ResponseError:  # no such stream
        return 0


def _who(raw: bytes) -> tuple[str, list[str]]:
    """(kind, ids): the group id of a prompt group, the sample ids of a rollout or scored entry."""
    try:
        msg = decode(raw, (PromptGroup, Rollout, Scored))
    except DecodeError:
        return "other", []
    if isinstance(msg, PromptGroup):
        return "prompt_group", [msg.group_id]
    return type(msg).__name__.lower(), [msg.msg_id]


def failover(cl: LocalCluster, key: str, gap_s: float, timeout_s: float = 60.0) -> dict[str, Any]:
    """Kill the primary serving `key`'s slot once it holds stream entries its replica lacks (its
    link cut meanwhile; at most `gap_s` of waiting for the job to write), and measure what the
    promoted replica lacks (see the module docstring). `key` is any key of the job: all share one
    slot."""
    primary = cl.master_of(key)
    replica = cl.replica_of(primary)
    old = cl.node(primary)
    # one connection in READONLY mode: a cluster replica answers reads of its slots only then
    new = redis.Redis(host="127.0.0.1", port=replica, socket_timeout=2, single_connection_client=True)
    new.execute_command("READONLY")
    prefix = key.rsplit(":", 1)[0]
    keys = {s: f"{prefix}:{s}" for s in STREAMS}
    # The whole streams on both sides (what the trainer trimmed is gone from both): small here.
    first = "-"

    def cut() -> None:
        with contextlib.suppress(redis.ResponseError):  # no link at the moment: nothing to cut
            new.client_kill_filter(_type="master")

    # The link is cut, and cut again every 50 ms: a replica reconnects (and catches up) at most
    # once a second, so what the primary takes after its last catch-up is what it alone holds.
    # A job writes in bursts: wait (up to gap_s) for an entry the replica has not got.
    deadline = time.monotonic() + gap_s
    cut()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        cut()
        if sum(_added(old, k) for k in keys.values()) > sum(_added(new, k) for k in keys.values()):
            time.sleep(0.05)  # a little more of the burst
            break
    waited = gap_s - max(0.0, deadline - time.monotonic())
    old.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")  # nothing written between the reads and the kill
    cut()
    before = {s: _entries(old, k, first) for s, k in keys.items()}
    added_before = {s: _added(old, k) for s, k in keys.items()}
    offsets = old.info("replication")
    replica_offset = int(new.info("replication").get("slave_repl_offset", 0))
    t_kill = time.monotonic()
    cl.kill(primary)
    while cl.master_of(key) != replica or not cl.ok():
        if time.monotonic() - t_kill > timeout_s:
            raise RuntimeError(f"replica {replica} was not promoted within {timeout_s:.0f} s")
        time.sleep(0.05)
    promoted_s = time.monotonic() - t_kill
    after = {s: _entries(new, k, first) for s, k in keys.items()}
    added_after = {s: _added(new, k) for s, k in keys.items()}
    lost: dict[str, dict[str, list[str]]] = {}
    for s in STREAMS:
        for eid in sorted(set(before[s]) - set(after[s])):
            kind, ids = _who(before[s][eid])
            lost.setdefault(s, {}).setdefault(kind, []).extend(ids)
    lost_counts = {s: sum(len(v) for v in lost.get(s, {}).values()) for s in STREAMS}
    # entries-added on the new primary, less what services added there since the promotion
    lost_added = {s: added_before[s] - (added_after[s] - len(set(after[s]) - set(before[s]))) for s in STREAMS}
    return {"primary_port": primary, "replica_port": replica, "gap_s": round(waited, 2), "promoted_after_s": round(promoted_s, 2),
            "replication_bytes_behind": int(offsets.get("master_repl_offset", 0)) - replica_offset,
            "entries_lost": lost_counts, "entries_lost_by_entries_added": lost_added, "lost": lost}


def cluster_job(wd: Path, model: Path, *, steps: int = 8, fail_over: bool = True, gap_s: float = 20.0,
                timeout_s: float = 400.0) -> dict[str, Any]:
    """One async job on a fresh local cluster, all services as processes; with `fail_over`, the
    job's primary is killed once the trainer has taken 2 steps (`failover`). Returns the figures:
    the job's end state, the failover's measured loss, where each lost item ended, and verify."""
    wd.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite:///{wd / 'ledger.db'}"
    port = _free_port()
    prefix = f"cl-{uuid.uuid4().hex[:8]}:"
    out: dict[str, Any] = {}
    with LocalCluster(3, 1, node_timeout_ms=2000, workdir=str(wd / "cluster")) as cl:
        env = {"REDIS_URL": cl.url, "DATABASE_URL": db_url, "STREAM_PREFIX": prefix, "BROKER_PORT": str(port),
               "GEN_GENERATOR_ID": "gen-0", "TRAINER_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "TRAINER_CHECKPOINT_DIR": str(wd / "checkpoints"),
               # an input whose output a failover lost is pending again: reclaim it soon
               "CLAIM_IDLE_MS": "5000"}
        sup = Supervisor(wd / "logs", env)
        ledger = Ledger(db_url)
        api = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        try:
            sup.start("broker", "broker")
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{api}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if sup.failed() or time.monotonic() > deadline:
                    raise RuntimeError(f"broker did not come up:\n{sup.tail('broker')}")
                time.sleep(0.2)
            spec = {"name": "cluster", "model_path": str(model), "mode": "async", "steps": steps, "group_size": 4,
                    "prompts_per_step": 4, "eval_every": 0, "task": {"n_train": 64, "n_test": 8},
                    "sampling": {"max_tokens": 8}}
            resp = httpx.post(f"{api}/jobs", json=spec, timeout=30)
            if resp.status_code != 201:
                raise RuntimeError(f"job submission failed ({resp.status_code}): {resp.text}")
            job_id = resp.json()["id"]
            for name, module in (("generator", "generator_svc"), ("reward", "reward_svc"), ("trainer", "trainer_svc")):
                sup.start(name, module, {"JOB_ID": job_id})
            streams = JobStreams(redis.Redis(), job_id, prefix=prefix)  # for key names only
            out["job_slot"] = int(cl.node(cl.live()[0]).cluster("keyslot", streams.key(PROMPTS)))
            out["job_primary_port"] = cl.master_of(streams.key(PROMPTS))
            done_before = 0
            fo: dict[str, Any] | None = None
            while True:
                state = ledger.get_job(job_id)["state"]
                if state in ("finished", "failed", "cancelled", "stopped"):
                    break
                if sup.failed():
                    raise RuntimeError("\n".join(f"{p.name}:\n{sup.tail(p.name)}" for p in sup.failed()))
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"job not finished after {timeout_s:.0f} s (state {state}):\n"
                                       + sup.tail("trainer") + sup.tail("generator"))
                if fail_over and fo is None and len(ledger.train_steps(job_id)) >= 2:
                    done_before = len(ledger.train_steps(job_id))
                    fo = failover(cl, streams.key(PROMPTS), gap_s)
                time.sleep(0.2)
            sup.wait_all(60, exclude=("broker",))
        finally:
            sup.stop_all()
        out.update({"job_id": job_id, "state": state, "steps": len(ledger.train_steps(job_id)), "wall_s": round(
            time.monotonic() - t0, 1), "status_counts": ledger.status_counts(job_id)})
    rows = {s["msg_id"]: s for s in ledger.samples(job_id, limit=100_000)}
    if fo is not None:
        fo["steps_before"] = done_before
        lost = fo.pop("lost")
        groups = lost.get(PROMPTS, {}).get("prompt_group", [])
        samples = sorted(set(lost.get(ROLLOUTS, {}).get("rollout", []) + lost.get(SCORED, {}).get("scored", [])))
        # A lost prompt group: its samples never reach the ledger. A lost rollout or scored entry:
        # redone, so its sample ends used like any other (or in flight when the job stopped).
        group_rows = {g: [r for r in rows.values() if r["group_id"] == g] for g in groups}
        fo["lost_prompt_groups"] = groups
        fo["lost_prompt_groups_never_generated"] = [g for g, rs in group_rows.items() if not rs]
        fo["lost_samples"] = samples
        fo["lost_samples_final_status"] = {m: rows[m]["status"] if m in rows else "absent" for m in samples}
        out["failover"] = fo
        # Samples a failover took for good: the group_size samples of each lost prompt group
        # (never generated) and any lost rollout or scored sample not used by the end.
        out["failover_samples_lost"] = (4 * len(fo["lost_prompt_groups_never_generated"])
                                        + sum(1 for s in fo["lost_samples_final_status"].values()
                                              if s not in USED_STATUSES))
    res = verify(ledger, job_id)
    out["verify"] = {"ok": res.ok, "violations": {c: n for c, n in res.checks.items() if n},
                     "in_flight": res.in_flight, "counts": res.counts,
                     "findings": [{"check": f.check, "level": f.level, "count": f.count, "message": f.message}
                                  for f in (*res.violations, *res.info)]}
    return out


def bench_redis_cluster(out_dir: str = "results") -> dict[str, Any]:
    """The end-to-end job and the failover job; writes results/redis_cluster.json."""
    import json

    from trainer_svc.tiny_model import build_tiny_model

    wd = Path("runs/bench-redis-cluster").resolve() / time.strftime("%Y%m%d-%H%M%S")
    model = build_tiny_model(wd / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    plain = cluster_job(wd / "plain", model, fail_over=False)
    failed = cluster_job(wd / "failover", model, fail_over=True)
    in_flight = failed["verify"]["in_flight"]
    res = {
        "what": "a real async job (vLLM generator, reward, trainer as processes, tiny model) on a local Redis "
                "Cluster of 3 primaries + 3 replicas; then the same job with the job's primary SIGKILLed after "
                "step 2, its replica's link cut gap_s before (the replication lag a failover loses)",
        "end_to_end": plain,
        "failover_run": failed,
        "failover_entries_lost": failed.get("failover", {}).get("entries_lost"),
        "failover_samples_lost": failed.get("failover_samples_lost"),
        "verify_found": {"violations": failed["verify"]["violations"], "in_flight_samples": in_flight},
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "redis_cluster.json").write_text(json.dumps(res, indent=2) + "\n")
    return res
