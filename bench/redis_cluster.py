"""A real job on a local Redis Cluster (3 primaries + 3 replicas, `broker.redis_server.LocalCluster`),
and the same job through a failover: the primary serving the job's slot is SIGKILLed mid-job and
its replica promoted.

    python -m bench redis-cluster        # writes results/redis_cluster.json

`tests/test_redis_cluster_job.py` runs `cluster_job` too (without writing results).

What a failover loses is what replication had not carried when the primary died. On loopback a
replica is a fraction of a millisecond behind, so the scenario partitions it first, as a network
split or a stalled host would: the replica is frozen (SIGSTOP) and its link closed from the
primary's side (CLIENT KILL TYPE replica), so every write the primary takes from then on is its
alone. Once the job has added prompt, rollout and scored entries there, the primary's writes are
paused (CLIENT PAUSE WRITE), every entry of the job's streams is read from it, it is SIGKILLed,
the replica thawed (SIGCONT) and, writes paused there too until it is read, promoted. Entries on
the first list and not the second are lost; XINFO STREAM's entries-added on both sides counts the
XADDs lost (also those added and trimmed while partitioned).

Where each loss ends (ARCHITECTURE.md, "Redis Cluster"): a lost entry whose input is still pending
somewhere (its XACK was lost with it) is reclaimed after CLAIM_IDLE_MS and redone under the same
sample ids; a group of which no stream holds anything any more (its prompt lost, or its prompt and
its outputs) is settled `lost` in the ledger by the trainer (trainer_svc/sink.py `settle_lost`).
`failover_samples_lost` counts the samples of the lost entries' groups that ended lost (or with no
row at all); `verify_found` is what `broker.verify` reports as lost: they must agree.
"""

from __future__ import annotations

import os
import platform
import socket
import time
import uuid
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import redis

from asyncrl.launch import Supervisor
from broker.ledger import Ledger
from broker.redis_server import LocalCluster
from broker.streams import DEAD, PROMPTS, ROLLOUTS, SCORED, JobStreams
from broker.verify import verify
from shared.ids import eval_round, sample_ids
from shared.schema import DecodeError, EvalRound, PromptGroup, Rollout, Scored, decode

STREAMS = (PROMPTS, ROLLOUTS, SCORED, DEAD)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entries(node: redis.Redis, key: str) -> dict[str, bytes]:
    """Entry id -> message field of every entry of `key`, read from one node."""
    return {eid.decode(): fields.get(b"d", b"") for eid, fields in node.xrange(key)}


def _added(node: redis.Redis, key: str) -> int:
    try:
        return int(node.xinfo_stream(key)["entries-added"])
    except redis.ResponseError:  # no such stream
        return 0


def _who(raw: bytes) -> tuple[str, str]:
    """(group id, sample id) of a stream entry's message: a prompt group or evaluation round has
    no sample id (""), nor has what is not a message of ours (group id "")."""
    try:
        msg = decode(raw, (PromptGroup, EvalRound, Rollout, Scored))
    except DecodeError:
        return "", ""
    return msg.group_id, "" if isinstance(msg, (PromptGroup, EvalRound)) else msg.msg_id


def failover(cl: LocalCluster, key: str, gap_s: float, timeout_s: float = 60.0) -> dict[str, Any]:
    """Partition the replica of the primary serving `key`'s slot, let the job write to the primary
    alone (until it has added prompt, rollout and scored entries, at most `gap_s`), kill the
    primary, and measure what the promoted replica lacks (see the module docstring). `key` is any
    key of the job: all share one slot."""
    primary = cl.master_of(key)
    replica = cl.replica_of(primary)
    old = cl.node(primary)
    prefix = key.rsplit(":", 1)[0]
    keys = {s: f"{prefix}:{s}" for s in STREAMS}
    cl.freeze(replica)
    old.client_kill_filter(_type="replica")  # the primary's end of the link: nothing more reaches the replica
    base = {s: _added(old, k) for s, k in keys.items()}
    t0 = time.monotonic()
    while time.monotonic() - t0 < gap_s:
        time.sleep(0.05)
        if all(_added(old, keys[s]) > base[s] for s in (PROMPTS, ROLLOUTS, SCORED)):
            break
    waited = time.monotonic() - t0
    old.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")  # nothing written between the reads and the kill
    # The whole streams (what the trainer trimmed is gone from both sides): small here.
    before = {s: _entries(old, k) for s, k in keys.items()}
    added_before = {s: _added(old, k) for s, k in keys.items()}
    t_kill = time.monotonic()
    cl.kill(primary)
    cl.thaw(replica)
    new = redis.Redis(host="127.0.0.1", port=replica, socket_timeout=2)
    # no service writes to it until it is read (paused as a replica, it stays paused once promoted)
    new.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")
    try:
        while cl.master_of(key) != replica or not cl.ok():
            if time.monotonic() - t_kill > timeout_s:
                raise RuntimeError(f"replica {replica} was not promoted within {timeout_s:.0f} s")
            time.sleep(0.05)
        promoted_s = time.monotonic() - t_kill
        after = {s: _entries(new, k) for s, k in keys.items()}
        added_after = {s: _added(new, k) for s, k in keys.items()}
    finally:
        new.execute_command("CLIENT", "UNPAUSE")
    groups: dict[str, list[str]] = {}  # stream -> group ids of its lost entries
    samples: dict[str, list[str]] = {}  # stream -> sample ids of its lost rollout and scored entries
    for s in STREAMS:
        for eid in sorted(set(before[s]) - set(after[s])):
            gid, msg_id = _who(before[s][eid])
            groups.setdefault(s, []).append(gid)
            if msg_id:
                samples.setdefault(s, []).append(msg_id)
    return {
        "primary_port": primary,
        "replica_port": replica,
        "partitioned_s": round(waited, 2),
        "promoted_after_s": round(promoted_s, 2),
        # entries the primary held and the promoted replica lacks, and XADDs it counted and the
        # replica did not (entries-added: also those added and trimmed while partitioned)
        "entries_lost": {s: len(set(before[s]) - set(after[s])) for s in STREAMS},
        "xadds_lost": {s: added_before[s] - added_after[s] for s in STREAMS},
        "lost_groups": groups,
        "lost_samples": samples,
    }


def cluster_job(
    wd: Path,
    model: Path,
    *,
    steps: int = 8,
    fail_over: bool = True,
    gap_s: float = 20.0,
    group_size: int = 4,
    timeout_s: float = 400.0,
) -> dict[str, Any]:
    """One async job on a fresh local cluster, all services as processes; with `fail_over`, the
    job's primary is killed once the trainer has taken 2 steps (`failover`). Returns the figures:
    the job's end state, the failover's measured loss, where each lost item ended, and verify."""
    wd.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite:///{wd / 'ledger.db'}"
    port = _free_port()
    prefix = f"cl-{uuid.uuid4().hex[:8]}:"
    out: dict[str, Any] = {}
    with LocalCluster(3, 1, node_timeout_ms=2000, workdir=str(wd / "cluster")) as cl:
        env = {
            "REDIS_URL": cl.url,
            "DATABASE_URL": db_url,
            "STREAM_PREFIX": prefix,
            "BROKER_PORT": str(port),
            "GEN_GENERATOR_ID": "gen-0",
            "TRAINER_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "TRAINER_CHECKPOINT_DIR": str(wd / "checkpoints"),
            # an input whose output a failover lost is pending again: reclaim it soon
            "CLAIM_IDLE_MS": "5000",
        }
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
            spec = {
                "name": "cluster",
                "model_path": str(model),
                "mode": "async",
                "steps": steps,
                "group_size": group_size,
                "prompts_per_step": 4,
                "eval_every": 0,
                "task": {"n_train": 64, "n_test": 8},
                "sampling": {"max_tokens": 8},
            }
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
                    sup.dump_stacks()
                    raise RuntimeError(
                        f"job not finished after {timeout_s:.0f} s (state {state}):\n"
                        + sup.stuck_report(("trainer", "generator", "reward"))
                    )
                if fail_over and fo is None and len(ledger.train_steps(job_id)) >= 2:
                    done_before = len(ledger.train_steps(job_id))
                    fo = failover(cl, streams.key(PROMPTS), gap_s)
                time.sleep(0.2)
            sup.wait_all(60, exclude=("broker",))
        finally:
            sup.stop_all()
        out.update(
            {
                "job_id": job_id,
                "state": state,
                "steps": len(ledger.train_steps(job_id)),
                "wall_s": round(time.monotonic() - t0, 1),
                "status_counts": ledger.status_counts(job_id),
            }
        )
    rows = {s["msg_id"]: s for s in ledger.samples(job_id, limit=100_000)}
    if fo is not None:
        fo["steps_before"] = done_before
        # Where each lost group ended: its samples' final ledger statuses ("absent": no row). A
        # group Redis lost with nothing left anywhere is settled `lost` by the trainer; one with an
        # input still pending somewhere is redone under the same sample ids and used.
        lost_groups = sorted({g for gs in fo["lost_groups"].values() for g in gs if g})
        final: dict[str, dict[str, str]] = {}
        for g in lost_groups:
            mine = {m: r["status"] for m, r in rows.items() if g in (r["group_id"], eval_round(r["group_id"]))}
            if g.rsplit("/", 1)[-1].startswith("g"):  # a training group: group_size samples, rows or not
                mine.update({m: "absent" for m in sample_ids(g, group_size) if m not in mine})
            final[g] = mine or {g: "absent"}
        fo["lost_group_final_status"] = {g: dict(Counter(st.values())) for g, st in final.items()}
        out["failover"] = fo
        # Samples the failover took for good: those of its lost groups that were never redone.
        out["failover_samples_lost"] = sum(1 for st in final.values() for x in st.values() if x in ("lost", "absent"))
    res = verify(ledger, job_id)
    out["verify"] = {
        "ok": res.ok,
        "violations": {c: n for c, n in res.checks.items() if n},
        "in_flight": res.in_flight,
        "lost": res.lost,
        "counts": res.counts,
        "findings": [
            {"check": f.check, "level": f.level, "count": f.count, "message": f.message}
            for f in (*res.violations, *res.info)
        ],
    }
    return out


def bench_redis_cluster(out_dir: str = "results") -> dict[str, Any]:
    """The end-to-end job and the failover job; writes results/redis_cluster.json."""
    import json

    from asyncrl.tiny_model import build_tiny_model

    wd = Path("runs/bench-redis-cluster").resolve() / time.strftime("%Y%m%d-%H%M%S")
    model = build_tiny_model(wd / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    plain = cluster_job(wd / "plain", model, fail_over=False)
    failed = cluster_job(wd / "failover", model, fail_over=True)
    res = {
        "what": "a real async job (vLLM generator, reward, trainer as processes, tiny model) on a local Redis "
        "Cluster of 3 primaries + 3 replicas; then the same job with the job's primary SIGKILLed after "
        "step 2 while its replica was partitioned (frozen, link closed), so the primary alone held the "
        "job's last writes; the replica promoted",
        "end_to_end": plain,
        "failover_run": failed,
        "failover_entries_lost": failed["failover"]["entries_lost"],
        "failover_xadds_lost": failed["failover"]["xadds_lost"],
        "failover_samples_lost": failed["failover_samples_lost"],
        # what broker.verify reported: the samples it found lost, and that nothing else is wrong
        "verify_found": {
            "lost_samples": failed["verify"]["lost"],
            "violations": failed["verify"]["violations"],
            "in_flight_samples": failed["verify"]["in_flight"],
        },
        "verify_found_exactly_the_loss": failed["verify"]["lost"] == failed["failover_samples_lost"],
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "redis_cluster.json").write_text(json.dumps(res, indent=2) + "\n")
    return res
