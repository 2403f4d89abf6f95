"""Broker and ledger overhead: rollouts through a Redis stream with the real codec and ledger writes.

One hop of the pipeline as the services run it, in two processes (one per core, Redis on the same
two cores): the producer does what the generator does per batch (ledger insert of the sample rows,
`JobStreams.publish_many` of the encoded rollouts), the consumer what the reward service does
(`JobStreams.consume` with decoding and validation, ledger update to `scored`, `XACK`). Each
rollout holds `tokens` completion tokens plus their logprobs (and a short prompt).

The medium's limit is measured in the same run: the same bytes XADDed in pipelines of the same
batch size and read back with XREADGROUP + XACK without codec or ledger (`raw_streams`), and
`redis-benchmark` XADDing a payload of the same size with the same pipeline depth
(`redis_benchmark`; one direction only, so an upper bound).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from broker.runtime import sample_row
from broker.streams import FIELD, GROUP_REWARDERS, ROLLOUTS, Consumer, JobStreams, connect
from shared.schema import Rollout, encode, pack_f32, pack_i32


def make_rollouts(job_id: str, n: int, tokens: int, start: int = 0) -> list[Rollout]:
    """`n` rollouts of `tokens` completion tokens each, groups of 8, with logprobs."""
    rng = np.random.default_rng(start)
    ids = rng.integers(4, 104, size=tokens, dtype=np.int32)
    lps = -rng.random(tokens, dtype=np.float32)
    return [
        Rollout(
            job_id=job_id,
            msg_id=f"g{i // 8}/{i % 8}",
            group_id=f"g{i // 8}",
            policy_version=0,
            policy_version_max=0,
            prompt_index=i // 8,
            sample_index=i % 8,
            group_size=8,
            generator_id="bench",
            prompt_ids=pack_i32(ids[:8]),
            completion_ids=pack_i32(ids),
            logprobs=pack_f32(lps),
            completion="x" * tokens,
            answer="42",
        )
        for i in range(start, start + n)
    ]


def _producer(streams: JobStreams, ledger: Ledger, job_id: str, n: int, tokens: int, batch: int) -> None:
    # Built before the clock starts: the generator has its samples from the engine already.
    batches = [make_rollouts(job_id, min(batch, n - i), tokens, start=i) for i in range(0, n, batch)]
    _ready_then_go()
    for msgs in batches:
        ledger.record_generated([sample_row(m) for m in msgs])
        streams.publish_many(ROLLOUTS, msgs)


def _consumer(streams: JobStreams, ledger: Ledger, n: int, batch: int) -> float:
    reader = Consumer(ROLLOUTS, GROUP_REWARDERS, "bench", Rollout)
    _ready_then_go()
    t0 = time.perf_counter()
    got = 0
    while got < n:
        ds = streams.consume(reader, count=batch, block_ms=5000)
        if not ds:
            raise TimeoutError(f"consumer saw {got} of {n} rollouts, then nothing for 5 s")
        ledger.record_scored([(d.message.msg_id, 1.0) for d in ds])
        streams.ack(ROLLOUTS, GROUP_REWARDERS, [d.entry_id for d in ds])
        got += len(ds)
    return time.perf_counter() - t0


def _ready_then_go() -> None:
    """Start barrier with the parent: say 'ready' on stdout, wait for a line on stdin."""
    print("ready", flush=True)
    sys.stdin.readline()


def _codec_path(redis_url: str, db_url: str, n: int, tokens: int, batch: int, cores: list[int]) -> dict[str, Any]:
    prefix = f"bench-broker-{uuid.uuid4().hex[:8]}:"
    job_id = "bench" + prefix  # one job per run: msg_id is unique across the whole ledger
    ledger = Ledger(db_url)
    ledger.create_job(job_id, "bench-broker", {})
    ledger.close()
    streams = JobStreams(connect(redis_url), job_id, prefix=prefix)
    streams.ensure_group(ROLLOUTS, GROUP_REWARDERS)
    core_p, core_c = (cores[0], cores[-1]) if len(cores) > 1 else (None, None)
    procs = []
    for role, core in (("producer", core_p), ("consumer", core_c)):
        cmd = [
            sys.executable,
            "-m",
            "bench.broker_overhead",
            role,
            "--redis-url",
            redis_url,
            "--db-url",
            db_url,
            "--prefix",
            prefix,
            "--job-id",
            job_id,
            "-n",
            str(n),
            "--tokens",
            str(tokens),
            "--batch",
            str(batch),
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                preexec_fn=(lambda c=core: os.sched_setaffinity(0, {c})) if core is not None else None,
            )
        )
    try:
        for role, p in zip(("producer", "consumer"), procs, strict=True):
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"broker bench {role} did not start (exit {p.wait()})")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        streams.delete_all()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"broker bench processes exited {[p.returncode for p in procs]}")
    wall = float(json.loads(outs[1].strip().splitlines()[-1])["wall_s"])
    size = len(encode(make_rollouts(job_id, 1, tokens)[0]))
    return {
        "samples": n,
        "wall_s": wall,
        "samples_per_s": n / wall,
        "ms_per_sample": 1000 * wall / n,
        "message_bytes": size,
        "ledger": db_url.split(":", 1)[0],
    }


def _raw_streams(redis_url: str, n: int, payload: bytes, batch: int) -> dict[str, Any]:
    """The same bytes through XADD pipelines and XREADGROUP + XACK, no codec, no ledger."""
    r: Any = connect(redis_url)  # redis-py's annotations mix its sync and async return types
    key, group = f"bench-raw-{uuid.uuid4().hex[:8]}", "g"
    r.xgroup_create(key, group, id="0", mkstream=True)
    try:
        t0 = time.perf_counter()
        got = 0
        for i in range(0, n, batch):
            pipe = r.pipeline(transaction=False)
            for _ in range(min(batch, n - i)):
                pipe.xadd(key, {FIELD: payload})
            pipe.execute()
            resp = r.xreadgroup(group, "c", {key: ">"}, count=batch)
            ids = [eid for _k, entries in resp for eid, _f in entries]
            r.xack(key, group, *ids)
            got += len(ids)
        wall = time.perf_counter() - t0
    finally:
        r.delete(key)
    return {"samples": got, "wall_s": wall, "samples_per_s": got / wall, "ms_per_sample": 1000 * wall / got}


def _redis_benchmark(redis_url: str, n: int, size: int, batch: int) -> dict[str, Any] | None:
    """`redis-benchmark` XADD of a `size`-byte field, pipelined `batch` deep; None if absent."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    from redis.connection import parse_url

    conn = parse_url(redis_url)
    key = f"bench-rb-{uuid.uuid4().hex[:8]}"
    cmd = [
        exe,
        "-h",
        str(conn.get("host", "127.0.0.1")),
        "-p",
        str(conn.get("port", 6379)),
        "-n",
        str(n),
        "-c",
        "1",
        "-P",
        str(batch),
        "-q",
        "XADD",
        key,
        "*",
        "d",
        "x" * size,
    ]
    if conn.get("password"):
        cmd[1:1] = ["-a", str(conn["password"])]
    try:
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    finally:
        connect(redis_url).delete(key)
    # "XADD bench-rb-... * d xxx: 123456.79 requests per second, p50=..." (\r-separated progress)
    found = re.findall(r"([\d.]+) requests per second", text)
    if not found:
        raise RuntimeError(f"cannot read redis-benchmark's output: {text[-300:]!r}")
    rate = float(found[-1])
    return {"samples": n, "samples_per_s": rate, "ms_per_sample": 1000 / rate, "command": "XADD (one direction)"}


def bench_broker(
    workdir: Path, *, samples: int = 20_000, tokens: int = 512, batch: int = 128, postgres_url: str | None = None
) -> dict[str, Any]:
    """Samples/s and ms/sample through one hop with codec and ledger, and the medium's limits.

    Args:
        workdir: the SQLite ledger goes here (a fresh file per run).
        samples: rollouts to push through.
        tokens: completion tokens per rollout (each with a float32 logprob).
        batch: rollouts per publish / per XREADGROUP, as the services batch them.
        postgres_url: also measure with this PostgreSQL ledger.
    """
    redis_url, embedded = resolve_redis_url(os.environ.get("REDIS_URL"), allow_embedded=True)
    cores = sorted(os.sched_getaffinity(0))
    try:
        db = workdir / f"broker-{uuid.uuid4().hex[:8]}.db"
        result: dict[str, Any] = {"tokens_per_rollout": tokens, "batch": batch, "cores": len(cores)}
        result["ours_sqlite"] = _codec_path(redis_url, f"sqlite:///{db}", samples, tokens, batch, cores)
        if postgres_url:
            result["ours_postgres"] = _codec_path(redis_url, postgres_url, samples, tokens, batch, cores)
        payload = encode(make_rollouts("bench", 1, tokens)[0])
        result["raw_streams"] = _raw_streams(redis_url, samples, payload, batch)
        result["redis_benchmark"] = _redis_benchmark(redis_url, samples, len(payload), batch)
    finally:
        if embedded:
            embedded.close()
    ours = result["ours_sqlite"]
    result["samples_per_s"] = ours["samples_per_s"]
    result["overhead_ms"] = ours["ms_per_sample"]
    result["ours_over_raw"] = ours["samples_per_s"] / result["raw_streams"]["samples_per_s"]
    return result


def main(argv: list[str] | None = None) -> None:
    """One side of the codec path (the suite starts both, one per core); not for direct use."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("role", choices=("producer", "consumer"))
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--db-url", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--job-id", required=True)
    ap.add_argument("-n", type=int, required=True)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    a = ap.parse_args(argv)
    streams = JobStreams(connect(a.redis_url), a.job_id, prefix=a.prefix)
    ledger = Ledger(a.db_url, migrate=False)
    if a.role == "producer":
        _producer(streams, ledger, a.job_id, a.n, a.tokens, a.batch)
    else:
        print(json.dumps({"wall_s": _consumer(streams, ledger, a.n, a.batch)}), flush=True)


if __name__ == "__main__":
    main()
