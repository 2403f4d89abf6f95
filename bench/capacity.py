"""Unit costs for the capacity model (`python -m bench capacity`), measured with the real code paths.

(a) One Redis shard: the three streams of one job as the services drive them, in separate processes:
    a trainer process (feeder: `publish_many` of PromptGroups within (k + 1) steps of its version;
    learner: `consume` of Scored, a step, `ack`, `trim_acked_many`), generator processes
    (`consume` prompts, n Rollouts per group, `publish_if_owned`) and a reward process (`consume`
    rollouts, `publish_if_owned` of Scored). A dedicated redis-server (AOF everysec, as
    docker-compose.yml runs it) so its `INFO cpu` counts only this job: Redis CPU seconds per
    sample, samples/s and bytes/s, at 256 / 1024 / 4096 completion tokens. The same runner, with
    generators paced to a token rate and the step given a duration, gives the measured points the
    simulation is checked against (bench/capacity_sim.py).
(b) The ledger on PostgreSQL (a fresh database per run): rows/s of the four writes of a sample as the
    services batch them, the server processes' CPU per sample, and the cost of the status and
    verify queries on a large samples table.
(c) Weight bytes/s per link: results/transfer.json (bench/transfer.py), not re-measured.

Writes results/capacity.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import redis

from broker.streams import (
    GROUP_GENERATORS,
    GROUP_REWARDERS,
    GROUP_TRAINERS,
    PROMPTS,
    ROLLOUTS,
    SCORED,
    Consumer,
    JobStreams,
    connect,
)
from shared.schema import PromptGroup, Rollout, SamplingParams, Scored, encode, pack_f32, pack_i32

GROUP_SIZE = 8
TEXT_BYTES_PER_TOKEN = 4  # the rollout carries prompt and completion text beside the ids


# -- messages of realistic size ---------------------------------------------------------------------
def prompt_group(job_id: str, index: int, prompt_tokens: int, completion_tokens: int, version: int) -> PromptGroup:
    ids = np.arange(prompt_tokens, dtype=np.int32) % 32000
    return PromptGroup(
        job_id=job_id,
        msg_id=f"p{index}",
        group_id=f"p{index}",
        policy_version=version,
        prompt_index=index,
        prompt="w" * (TEXT_BYTES_PER_TOKEN * prompt_tokens),
        prompt_ids=pack_i32(ids),
        answer="42",
        n=GROUP_SIZE,
        sampling=SamplingParams(max_tokens=completion_tokens),
    )


def _text(rng: np.random.Generator, n: int) -> str:
    """`n` characters of letters and spaces: about as compressible as prose (PostgreSQL TOAST-
    compresses long text; a run of one letter would cost it almost nothing)."""
    return "".join(np.array(list("abcdefghijklmnopqrstuvwxyz     "))[rng.integers(0, 31, size=n)])


def rollout_template(job_id: str, prompt_tokens: int, completion_tokens: int) -> Rollout:
    rng = np.random.default_rng(0)
    return Rollout(
        job_id=job_id,
        msg_id="t",
        group_id="t",
        policy_version=0,
        policy_version_max=0,
        prompt_index=0,
        sample_index=0,
        group_size=GROUP_SIZE,
        generator_id="gen-0",
        prompt_ids=pack_i32(np.arange(prompt_tokens, dtype=np.int32) % 32000),
        completion_ids=pack_i32(rng.integers(4, 32000, size=completion_tokens, dtype=np.int32)),
        logprobs=pack_f32(-rng.random(completion_tokens, dtype=np.float32)),
        completion=_text(rng, TEXT_BYTES_PER_TOKEN * completion_tokens),
        finish_reason="length",
        answer="42",
        prompt=_text(rng, TEXT_BYTES_PER_TOKEN * prompt_tokens),
    )


# -- the three roles (subprocesses) ---------------------------------------------------------------
def _ready_then_go() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


def _role_trainer(a: argparse.Namespace) -> None:
    streams = JobStreams(connect(a.url), a.job)
    reader = Consumer(SCORED, GROUP_TRAINERS, "trainer", Scored)
    groups_per_step = a.samples_per_step // GROUP_SIZE
    total_groups = a.samples // GROUP_SIZE
    version, fed, held = 0, 0, []
    stale: list[int] = []
    trained = 0
    _ready_then_go()
    time.sleep(a.idle_s)  # every consumer waiting on an empty stream: the shard's idle cost
    print(json.dumps({"idle_s": a.idle_s}), flush=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    while trained < a.samples:
        # feeder: keep (k + 1) steps of groups in flight ahead of the trainer's version
        want = min(total_groups, (version + a.k + 1) * groups_per_step)
        if want > fed:
            streams.publish_many(
                PROMPTS, [prompt_group(a.job, i, a.prompt_tokens, a.tokens, version) for i in range(fed, want)]
            )
            fed = want
        held += streams.consume(reader, count=512, block_ms=100)
        while len(held) >= a.samples_per_step:
            batch, held = held[: a.samples_per_step], held[a.samples_per_step :]
            if a.step_s:
                time.sleep(a.step_s)
            stale += [version - d.message.policy_version for d in batch]
            version += 1
            streams.r.set(f"{a.job}:version", version)
            streams.ack(SCORED, GROUP_TRAINERS, [d.entry_id for d in batch])
            streams.trim_acked_many(
                ((PROMPTS, GROUP_GENERATORS), (ROLLOUTS, GROUP_REWARDERS), (SCORED, GROUP_TRAINERS))
            )
            trained += len(batch)
    wall = time.perf_counter() - t0
    streams.r.set(f"{a.job}:done", 1)
    print(
        json.dumps(
            {
                "wall_s": wall,
                "trained": trained,
                "steps": version,
                "cpu_s": time.process_time() - cpu0,
                "staleness_mean": statistics.fmean(stale),
                "staleness_max": max(stale),
            }
        ),
        flush=True,
    )


def _role_generator(a: argparse.Namespace) -> None:
    streams = JobStreams(connect(a.url), a.job)
    me = Consumer(PROMPTS, GROUP_GENERATORS, f"gen-{a.index}", PromptGroup)
    tpl = rollout_template(a.job, a.prompt_tokens, a.tokens)
    _ready_then_go()
    cpu0 = time.process_time()
    while not streams.r.exists(f"{a.job}:done"):
        ds = streams.consume(me, count=a.batch_groups, block_ms=200)
        if not ds:
            continue
        version = int(streams.r.get(f"{a.job}:version") or 0)
        if a.gen_tps:  # the engine's time for the batch at this replica's token rate
            time.sleep(len(ds) * GROUP_SIZE * a.tokens / a.gen_tps)
        per_entry = []
        for d in ds:
            g = d.message
            per_entry.append(
                (
                    d.entry_id,
                    [
                        tpl.model_copy(
                            update={
                                "msg_id": f"{g.group_id}/{i}",
                                "group_id": g.group_id,
                                "sample_index": i,
                                "prompt_index": g.prompt_index,
                                "policy_version": version,
                                "policy_version_max": version,
                                "generator_id": me.name,
                            }
                        )
                        for i in range(GROUP_SIZE)
                    ],
                )
            )
        streams.publish_if_owned(me, ROLLOUTS, per_entry)
    print(json.dumps({"cpu_s": time.process_time() - cpu0}), flush=True)


def _role_reward(a: argparse.Namespace) -> None:
    streams = JobStreams(connect(a.url), a.job)
    me = Consumer(ROLLOUTS, GROUP_REWARDERS, "reward-0", Rollout)
    _ready_then_go()
    cpu0 = time.process_time()
    while not streams.r.exists(f"{a.job}:done"):
        ds = streams.consume(me, count=64, block_ms=200)
        if ds:
            streams.publish_if_owned(
                me,
                SCORED,
                [
                    (
                        d.entry_id,
                        [
                            Scored(
                                job_id=d.message.job_id,
                                msg_id=d.message.msg_id,
                                group_id=d.message.group_id,
                                policy_version=d.message.policy_version,
                                rollout=d.message,
                                reward=1.0,
                            )
                        ],
                    )
                    for d in ds
                ],
            )
    print(json.dumps({"cpu_s": time.process_time() - cpu0}), flush=True)


# -- (a) one Redis shard ----------------------------------------------------------------------------
@contextmanager
def redis_shard() -> Iterator[str]:
    """A dedicated redis-server on a free loopback port, configured as docker-compose.yml runs it."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not on PATH: the Redis unit costs need a dedicated server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="capacity-redis-") as d:
        p = subprocess.Popen(
            [
                exe,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                d,
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--maxmemory-policy",
                "noeviction",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    redis.Redis.from_url(url, socket_timeout=1).ping()
                    break
                except redis.RedisError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            yield url
        finally:
            p.terminate()
            p.wait(timeout=20)


def redis_cpu_s(url: str) -> float:
    info = connect(url).info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def run_chain(
    url: str,
    *,
    tokens: int,
    samples: int,
    generators: int,
    prompt_tokens: int = 256,
    samples_per_step: int = 256,
    k: int = 1,
    gen_tps: float = 0.0,
    step_s: float = 0.0,
    batch_groups: int = 8,
    idle_s: float = 2.0,
) -> dict[str, Any]:
    """Push `samples` samples through prompts -> rollouts -> scored on the shard at `url`.

    gen_tps: each generator's token rate (0: as fast as the process goes); step_s: the trainer
    step's duration (0: none). Returns samples/s, Redis CPU per sample, the shard's busy
    fraction, bytes, and the staleness the trainer saw."""
    job = f"cap-{uuid.uuid4().hex[:8]}"
    streams = JobStreams(connect(url), job)
    for stream, group in ((PROMPTS, GROUP_GENERATORS), (ROLLOUTS, GROUP_REWARDERS), (SCORED, GROUP_TRAINERS)):
        streams.ensure_group(stream, group)
    common = [
        "--url",
        url,
        "--job",
        job,
        "--tokens",
        str(tokens),
        "--prompt-tokens",
        str(prompt_tokens),
        "--samples",
        str(samples),
        "--samples-per-step",
        str(samples_per_step),
        "--k",
        str(k),
        "--gen-tps",
        str(gen_tps),
        "--step-s",
        str(step_s),
        "--batch-groups",
        str(batch_groups),
        "--idle-s",
        str(idle_s),
    ]
    roles = [["trainer"], ["reward"]] + [["generator", "--index", str(i)] for i in range(generators)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.capacity", *role, *common],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for role in roles
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"capacity bench role did not start (exit {p.wait()})")
        idle0 = redis_cpu_s(url)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        assert procs[0].stdout is not None
        procs[0].stdout.readline()  # the trainer's idle window is over
        cpu0, t0 = redis_cpu_s(url), time.perf_counter()
        idle_cpu_per_s = (cpu0 - idle0) / idle_s
        out = procs[0].communicate(timeout=600)[0]
        cpu1, wall = redis_cpu_s(url), time.perf_counter() - t0
        client_cpu = sum(json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1])["cpu_s"] for p in procs[1:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        streams.delete_all()
        connect(url).delete(f"{job}:version", f"{job}:done")
    res = json.loads(out.strip().splitlines()[-1])
    client_cpu += res["cpu_s"]
    rollout = rollout_template(job, prompt_tokens, tokens)
    rb = len(encode(rollout))
    sb = len(encode(Scored(job_id=job, msg_id="t", group_id="t", policy_version=0, rollout=rollout, reward=1.0)))
    pb = len(encode(prompt_group(job, 0, prompt_tokens, tokens, 0)))
    per_sample = rb + sb + pb / GROUP_SIZE
    cpu = cpu1 - cpu0
    rate = res["trained"] / res["wall_s"]
    return {
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "generators": generators,
        "gen_tps": gen_tps,
        "step_s": step_s,
        "samples_per_step": samples_per_step,
        "k": k,
        "samples": res["trained"],
        "wall_s": res["wall_s"],
        "samples_per_s": rate,
        "rollout_bytes": rb,
        "scored_bytes": sb,
        "prompt_group_bytes": pb,
        "bytes_written_per_sample": per_sample,
        "bytes_written_per_s": per_sample * rate,
        "msgs_per_s": rate * (2 + 1 / GROUP_SIZE),
        "redis_cpu_s": cpu,
        "redis_idle_cpu_per_s": idle_cpu_per_s,
        "redis_cpu_s_per_sample": max(0.0, cpu - idle_cpu_per_s * wall) / res["trained"],
        "redis_utilisation": cpu / wall,
        "staleness_mean": res["staleness_mean"],
        "staleness_max": res["staleness_max"],
        "steps": res["steps"],
        # the roles' own CPU: past ~1 x the cores this box lends them, the box is the bottleneck
        "client_cpu_s_per_sample": client_cpu / res["trained"],
        "client_cpu_per_s": client_cpu / wall,
    }


def fit_redis(points: list[dict[str, Any]]) -> dict[str, float]:
    """Least-squares a + b * rollout_bytes of Redis CPU seconds per sample."""
    x = np.array([p["rollout_bytes"] for p in points], dtype=float)
    y = np.array([p["redis_cpu_s_per_sample"] for p in points], dtype=float)
    b, a = np.polyfit(x, y, 1)
    return {"base_s": max(float(a), 0.0), "per_byte_s": max(float(b), 0.0)}


def bench_redis(tokens: tuple[int, ...] = (256, 1024, 4096), reps: int = 2) -> dict[str, Any]:
    samples = {256: 6144, 1024: 4096, 4096: 2048}
    runs: dict[int, list[dict[str, Any]]] = {t: [] for t in tokens}
    with redis_shard() as url:
        for _ in range(reps):  # interleaved, medians below
            for t in tokens:
                runs[t].append(run_chain(url, tokens=t, samples=samples.get(t, 2048), generators=2))
                print(
                    f"redis {t} tokens: {runs[t][-1]['samples_per_s']:.0f} samples/s, "
                    f"{1e6 * runs[t][-1]['redis_cpu_s_per_sample']:.0f} us Redis CPU/sample",
                    flush=True,
                )
    med = []
    for t in tokens:
        rs = runs[t]
        m = dict(rs[0])
        for key in (
            "samples_per_s",
            "redis_cpu_s_per_sample",
            "redis_utilisation",
            "bytes_written_per_s",
            "msgs_per_s",
        ):
            m[key] = statistics.median(r[key] for r in rs)
        m["runs"] = [{k: r[k] for k in ("samples_per_s", "redis_cpu_s_per_sample", "redis_utilisation")} for r in rs]
        med.append(m)
    return {"points": med, "fit": fit_redis(med)}


def bench_crosscheck(
    generators: tuple[int, ...] = (1, 2, 4, 8),
    tokens: int = 256,
    gen_tps: float = 12800.0,
    step_s: float = 0.25,
    samples_per_step: int = 64,
) -> dict[str, Any]:
    """Paced runs the simulation is checked against: each generator makes 50 samples/s (256-token
    completions at 12,800 tokens/s, batches of 2 groups), the trainer takes 64 samples per 0.25 s
    step (256 samples/s at most), k = 1."""
    pts = []
    with redis_shard() as url:
        for g in generators:
            r = run_chain(
                url,
                tokens=tokens,
                prompt_tokens=64,
                samples=max(1024, 256 * g),
                generators=g,
                samples_per_step=samples_per_step,
                gen_tps=gen_tps,
                step_s=step_s,
                batch_groups=2,
            )
            pts.append(r)
            print(
                f"crosscheck {g} generators: {r['samples_per_s']:.0f} samples/s, staleness "
                f"{r['staleness_mean']:.2f}, Redis busy {r['redis_utilisation']:.3f}",
                flush=True,
            )
    return {"points": pts, "batch_groups": 2, "group_size": GROUP_SIZE}


# -- (b) the ledger on PostgreSQL ------------------------------------------------------------------
def _libpq(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def fresh_database(admin_url: str) -> Iterator[str]:
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    name = f"capacity_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(_libpq(admin_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(_libpq(admin_url), autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class _ServerCpu:
    """CPU seconds of this database's PostgreSQL backends (read from /proc; same machine only)."""

    def __init__(self, url: str):
        import psycopg

        self._conn = psycopg.connect(_libpq(url), autocommit=True)
        self._db = self._conn.info.dbname
        self._tick = os.sysconf("SC_CLK_TCK")

    def _pids(self) -> list[int]:
        rows = self._conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (self._db,)).fetchall()
        return [int(r[0]) for r in rows]

    def read(self) -> dict[int, float]:
        out = {}
        for pid in self._pids():
            try:
                f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[pid] = (int(f[11]) + int(f[12])) / self._tick
            except (OSError, IndexError):
                continue
        return out

    def wal_lsn(self) -> int:
        return int(self._conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()[0])  # type: ignore[index]

    @staticmethod
    def delta(before: dict[int, float], after: dict[int, float]) -> float:
        return sum(v - before.get(pid, 0.0) for pid, v in after.items())


def bench_ledger_writes(
    url: str, *, tokens: int, samples: int = 8192, batch: int = 64, step_samples: int = 512
) -> dict[str, Any]:
    """Rows/s of the four writes of a sample, batched as the services batch them: the generator's
    insert and the reward service's no-op insert (`batch` rows, one generate call's worth), its
    update to scored (`batch`), the trainer's update to trained (`step_samples`, one step)."""
    from broker.ledger import Ledger
    from broker.runtime import sample_row

    ledger = Ledger(url)
    job = f"cap-{uuid.uuid4().hex[:8]}"
    ledger.create_job(job, "capacity", {})
    tpl = rollout_template(job, 256, tokens)
    rows = [
        sample_row(
            tpl.model_copy(
                update={"msg_id": f"{job}/g{i // 8}/{i % 8}", "group_id": f"g{i // 8}", "sample_index": i % 8}
            )
        )
        for i in range(samples)
    ]
    cpu = _ServerCpu(url)
    phases: dict[str, dict[str, float]] = {}

    def timed(name: str, fn: Any, items: list[Any], size: int) -> None:
        ledger.status_counts(job)  # the pool's connection is open before the CPU reading
        c0, w0, t0 = cpu.read(), cpu.wal_lsn(), time.perf_counter()
        for i in range(0, len(items), size):
            fn(items[i : i + size])
        wall = time.perf_counter() - t0
        phases[name] = {
            "rows": len(items),
            "batch": size,
            "wall_s": wall,
            "rows_per_s": len(items) / wall,
            "server_cpu_s_per_row": cpu.delta(c0, cpu.read()) / len(items),
            "wal_bytes_per_row": (cpu.wal_lsn() - w0) / len(items),
        }

    timed("generated", ledger.record_generated, rows, batch)
    timed("generated_again", ledger.record_generated, rows, batch)
    scored = [
        (r["msg_id"], 1.0, "ok", {"components": {}, "reason": "", "entry": f"rollouts/{i}-0"})
        for i, r in enumerate(rows)
    ]
    timed("scored", ledger.record_scored_ids, scored, batch)
    used = [{"msg_id": r["msg_id"], "status": "trained", "trainer_version": 3} for r in rows]
    timed("trained", ledger.record_used, used, step_samples)
    ledger.close()
    per_sample_s = sum(1 / p["rows_per_s"] for p in phases.values())
    return {
        "tokens": tokens,
        "phases": phases,
        "wall_s_per_sample": per_sample_s,
        "samples_per_s": 1 / per_sample_s,
        "server_cpu_s_per_sample": sum(p["server_cpu_s_per_row"] for p in phases.values()),
        "wal_bytes_per_sample": sum(p["wal_bytes_per_row"] for p in phases.values()),
    }


# One job's rows made in SQL (a multi-day job's table in seconds): ~96% trained, 2% dropped, the
# rest in flight; staleness 0-2; completions of 1,000 characters.
_FILL = """
INSERT INTO samples (msg_id, job_id, group_id, sample_index, kind, prompt_index, generator_id,
    gen_version_min, gen_version_max, num_prompt_tokens, num_completion_tokens, completion,
    finish_reason, status, trainer_version, staleness, reward, reward_status, created_at, scored_at, used_at)
SELECT %(job)s || '/' || i, %(job)s, 'g' || (i / 8), i %% 8, 'train', i / 8, 'gen-' || (i %% 64),
    i / 8192, i / 8192, 256, 1024, repeat('x', 1000), 'length',
    CASE WHEN i > %(n)s - 2000 THEN 'scored' WHEN i %% 50 = 0 THEN 'dropped' ELSE 'trained' END,
    CASE WHEN i > %(n)s - 2000 THEN NULL ELSE i / 8192 + i %% 3 END,
    CASE WHEN i > %(n)s - 2000 THEN NULL ELSE i %% 3 END,
    1.0, 'ok', now(), now(), now()
FROM generate_series(1, %(n)s) AS i
"""


def bench_ledger_queries(url: str, *, rows: int) -> dict[str, Any]:
    """Seconds of the status queries (GET /jobs/{id}: status counts, staleness histogram, usage; a
    page of GET /jobs/{id}/samples, first and deep) and of `python -m broker.verify` on a job of
    `rows` samples, beside a small second job."""
    import psycopg

    from broker.ledger import Ledger
    from broker.verify import verify

    ledger = Ledger(url)
    big, small = f"big-{uuid.uuid4().hex[:6]}", f"small-{uuid.uuid4().hex[:6]}"
    for j in (big, small):
        ledger.create_job(j, "capacity", {}, state="finished")
    t0 = time.perf_counter()
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        conn.execute(_FILL, {"job": big, "n": rows})
        conn.execute(_FILL, {"job": small, "n": 10_000})
        conn.execute("VACUUM ANALYZE samples")
        size = int(conn.execute("SELECT pg_total_relation_size('samples')").fetchone()[0])  # type: ignore[index]
        plan = "\n".join(
            r[0]
            for r in conn.execute(
                "EXPLAIN SELECT staleness, count(*) FROM samples WHERE job_id = %s AND status = 'trained' "
                "AND staleness IS NOT NULL GROUP BY staleness",
                (big,),
            )
        )
    fill_s = time.perf_counter() - t0

    def best(fn: Any, reps: int = 2) -> float:  # warm cache, best of `reps` (the box is shared)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    def queries(job: str, n: int) -> dict[str, float]:
        return {
            "status_counts_s": best(lambda: ledger.status_counts(job)),
            "staleness_histogram_s": best(lambda: ledger.staleness_histogram(job)),
            "usage_s": best(lambda: ledger.usage(job)),
            "count_trained_s": best(lambda: ledger.count_samples(job, status="trained")),
            "first_page_s": best(lambda: ledger.samples(job, limit=50)),
            "deep_page_s": best(lambda: ledger.samples(job, limit=50, offset=max(0, n - 5000))),
            "verify_s": best(lambda: verify(ledger, job), reps=1),
        }

    out: dict[str, Any] = {"rows": rows, "fill_s": fill_s, "table_bytes": size, "staleness_plan": plan, "queries": {}}
    # Migration 0007's (job_id, id) index: measured without it, then with it.
    for state in ("without_job_id_id_index", "with_job_id_id_index"):
        with psycopg.connect(_libpq(url), autocommit=True) as conn:
            if state.startswith("without"):
                conn.execute("DROP INDEX IF EXISTS ix_samples_job_id_id")
            else:
                conn.execute("CREATE INDEX IF NOT EXISTS ix_samples_job_id_id ON samples (job_id, id)")
                conn.execute("ANALYZE samples")
        out["queries"][state] = {"big": queries(big, rows), "small": queries(small, 10_000)}
        print(f"ledger queries {state}: {out['queries'][state]}", flush=True)
    ledger.close()
    return out


def bench_ledger(
    admin_url: str, *, tokens: tuple[int, ...] = (256, 1024, 4096), rows: int = 1_000_000
) -> dict[str, Any]:
    writes = []
    for t in tokens:
        with fresh_database(admin_url) as url:
            w = bench_ledger_writes(url, tokens=t)
            writes.append(w)
            print(
                f"ledger {t} tokens: {w['samples_per_s']:.0f} samples/s (one writer), "
                f"{1e6 * w['server_cpu_s_per_sample']:.0f} us server CPU/sample",
                flush=True,
            )
    with fresh_database(admin_url) as url:
        queries = bench_ledger_queries(url, rows=rows)
    return {"writes": writes, "queries": queries}


# -- (c) weight links ----------------------------------------------------------------------------
def link_figures(results: Path) -> dict[str, Any]:
    t = json.loads((results / "transfer.json").read_text())
    big = t["sizes"][str(t["largest_mb"])]
    return {
        "source": "results/transfer.json (bench/transfer.py, loopback on this box)",
        "size_mb": t["largest_mb"],
        "tcp_bytes_per_s": big["tcp_mbps"] * 1e6,
        "ucx_bytes_per_s": big["ucx_mbps"] * 1e6,
        "ucx_raw_bytes_per_s": big["ucx_raw_mbps"] * 1e6,
    }


def bench_capacity(
    out_dir: str = "results", *, admin_url: str | None = None, rows: int = 1_000_000, reps: int = 2
) -> dict[str, Any]:
    admin_url = admin_url or os.environ.get("TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    out = Path(out_dir)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "machine": {
            "cores": len(os.sched_getaffinity(0)),
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "note": "shared with other jobs: figures are noisy",
        },
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }
    result["redis"] = bench_redis(reps=reps)
    result["crosscheck"] = bench_crosscheck()
    result["ledger"] = bench_ledger(admin_url, rows=rows)
    result["links"] = link_figures(out)
    result["wall_s"] = time.perf_counter() - t0
    (out / "capacity.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("role", choices=["trainer", "generator", "reward"])
    for name, typ, default in (
        ("--url", str, ""),
        ("--job", str, ""),
        ("--tokens", int, 256),
        ("--prompt-tokens", int, 256),
        ("--samples", int, 1024),
        ("--samples-per-step", int, 256),
        ("--k", int, 1),
        ("--gen-tps", float, 0.0),
        ("--step-s", float, 0.0),
        ("--batch-groups", int, 8),
        ("--index", int, 0),
        ("--idle-s", float, 0.0),
    ):
        p.add_argument(name, type=typ, default=default)
    a = p.parse_args()
    {"trainer": _role_trainer, "generator": _role_generator, "reward": _role_reward}[a.role](a)


if __name__ == "__main__":
    _main()
