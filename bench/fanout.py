"""Fan-out bench: seconds from a publish until every receiver serves the new version, and the
trainer's egress per version, for N receivers, star vs relay tree.

The receivers are relay processes (`python -m generator_svc.relay`): the generator's own relay
code (generator_svc/relay.py: the registry in Redis, the source choice, the verified fetch, the
weight server) with no vLLM engine, so 16 of them fit on this machine. The trainer side is the
real `TcpWeightServer` and a real `PolicyAnnouncement` on the job's policy stream (real Redis).
"Serving" is the moment a receiver has verified every chunk and serves the version itself (its
registry entry's `served_at`); the figure per version is the last receiver's time minus the
publish time (one clock: one box).

Emulated uplinks. On one box every "link" is loopback, as fast as memory, so N copies from the
trainer cost little and the star looks fine. Every server here (the trainer's and each relay's)
therefore sends through an emulated uplink of `uplink_mbps` MB/s shared by all its connections (a
token bucket in the TCP server's send path, `shared.transport.base.Uplink`): the figures model a
network where each node's uplink is the constraint. The times are emulated in that sense; the
bytes counted (trainer egress) are real. Three ways: the star (fan-out 0: every receiver from the
trainer), the tree as generators run it (relays pass each chunk on once it verified), and the tree
store and forward (a relay passes a version on only once all of it verified). The model figures
next to the measured ones are the formulas in results/fanout.md (`model_tree_s`).

    python -m bench fanout        (or python -m bench.fanout)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from bench.claims import machine
from broker.redis_server import resolve_redis_url
from broker.streams import POLICY, JobStreams, connect
from generator_svc.relay import RELAYS
from shared.ids import policy_version_id
from shared.schema import PolicyAnnouncement
from shared.transport import DEFAULT_CHUNK_BYTES, TcpWeightServer, build_manifest
from shared.transport.relay import tree_depth

MB = 1_000_000
PREFIX = "benchfanout:"


def model_tree_s(n: int, fanout: int, hop_s: float, chunk_s: float | None = None) -> float:
    """The time the last of `n` nodes of the heap has the version. Store and forward (`chunk_s`
    None): a node has it `hop_s` x (its parent's children) after its parent has all of it (the
    children share the parent's uplink); the root, one hop after the publish. Streamed (`chunk_s`:
    one chunk's time on a link): a node starts one chunk after its parent started and then runs at
    its parent's rate: its share of the parent's uplink, never faster than the parent's own."""
    if n <= 0:
        return 0.0
    done, rate, start = [hop_s], [1.0], [0.0]  # rate: fraction of an uplink a node receives at
    for i in range(1, n):
        p = (i - 1) // fanout
        siblings = min(n, p * fanout + fanout + 1) - (p * fanout + 1)
        if chunk_s is None:
            done.append(done[p] + siblings * hop_s)
        else:
            rate.append(min(rate[p], 1.0 / siblings))
            start.append(start[p] + chunk_s * siblings)
            done.append(start[i] + hop_s / rate[i])
    return max(done)


def _start_receivers(
    job: str, n: int, fanout: int, uplink_mbps: float, redis_url: str, store_and_forward: bool
) -> list[subprocess.Popen]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    sf = ["--store-and-forward"] if store_and_forward else []
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "generator_svc.relay",
                "--job",
                job,
                "--id",
                f"r{i:02d}",
                "--redis",
                redis_url,
                "--prefix",
                PREFIX,
                "--fanout",
                str(fanout),
                "--keep",
                "1",
                "--uplink-mbps",
                str(uplink_mbps),
                *sf,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for i in range(n)
    ]


def _entries(streams: JobStreams) -> dict[str, dict]:
    return {
        (k.decode() if isinstance(k, bytes) else k): json.loads(v)
        for k, v in streams.r.hgetall(streams.key(RELAYS)).items()
    }


def _served(streams: JobStreams, v: int, n: int) -> dict[str, dict] | None:
    """The registry's entries once `n` receivers serve version `v`, else None."""
    e = _entries(streams)
    return e if sum(str(v) in x["served_at"] for x in e.values()) >= n else None


def _wait(cond, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.01)
    raise TimeoutError(f"{what} not within {timeout_s:.0f} s")


def _one_group(
    server: TcpWeightServer,
    base: np.ndarray,
    first_version: int,
    n: int,
    fanout: int,
    versions: int,
    uplink_mbps: float,
    redis_url: str,
    store_and_forward: bool = False,
) -> list[dict]:
    """Start n receivers with `fanout` (0: star), publish `versions` versions one after another,
    each once the previous is served everywhere; per version: seconds publish -> all serving and
    trainer egress bytes."""
    job = f"fanout-{uuid.uuid4().hex[:8]}"
    streams = JobStreams(connect(redis_url), job, prefix=PREFIX)
    procs = _start_receivers(job, n, fanout, uplink_mbps, redis_url, store_and_forward)
    out = []
    try:
        _wait(lambda: len(_entries(streams)) >= n, 120, f"{n} receivers registered")
        for v in range(first_version, first_version + versions):
            buf = base.copy()
            buf[:8] = np.frombuffer(np.int64(v).tobytes(), dtype=np.uint8)  # each version its own bytes
            manifest = build_manifest(v, [("w", [buf.nbytes], "uint8", buf.nbytes)], buf)
            server.serve(manifest, buf)
            sent0 = server.sent.bytes
            t_pub = time.time()
            streams.publish(
                POLICY,
                PolicyAnnouncement(
                    job_id=job,
                    msg_id=policy_version_id(job, v),
                    policy_version=v,
                    manifest=manifest,
                    transport="tcp",
                    address=server.address,
                    trainer_run="bench",
                ),
            )
            entries = _wait(lambda v=v: _served(streams, v, n), 300, f"v{v} served by {n} receivers")
            done = max(x["served_at"][str(v)] for x in entries.values() if str(v) in x["served_at"])
            out.append({"version": v, "seconds": done - t_pub, "trainer_egress_bytes": server.sent.bytes - sent0})
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        errs = [
            (p.returncode, p.stderr.read().decode(errors="replace")) for p in procs if p.stderr and p.returncode != 0
        ]
        streams.r.delete(streams.key(RELAYS), streams.key(POLICY))
        if errs:
            print(
                f"{len(errs)} receiver(s) exited non-zero; first: rc {errs[0][0]}", errs[0][1][-2000:], file=sys.stderr
            )
    return out


def bench_fanout(
    out_dir: str = "results",
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
    payload_mb: int = 32,
    uplink_mbps: float = 25.0,
    fanout: int = 2,
    versions: int = 3,
) -> dict:
    """Star vs tree for each N in `sizes`, `versions` publishes each (median), interleaved."""
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    payload = payload_mb * MB
    base = np.random.default_rng(0).integers(0, 256, payload, dtype=np.uint8)
    server = TcpWeightServer(keep=2, uplink_bytes_per_s=uplink_mbps * MB)
    hop_s = payload / (uplink_mbps * MB)
    chunk_s = DEFAULT_CHUNK_BYTES / (uplink_mbps * MB)  # a relay passes a chunk on once it verified
    runs: dict[str, dict[str, list[dict]]] = {}
    v = 1
    t0 = time.time()
    try:
        for i, n in enumerate(sizes):
            modes = [("star", 0, False), ("tree", fanout, False), ("tree_sf", fanout, True)]
            for mode, k, sf in modes[i % 3 :] + modes[: i % 3]:  # rotate which goes first
                got = _one_group(server, base, v, n, k, versions, uplink_mbps, redis_url, sf)
                v += versions
                runs.setdefault(str(n), {})[mode] = got
                print(
                    f"N={n:2d} {mode}: "
                    + ", ".join(f"{r['seconds']:.2f}s/{r['trainer_egress_bytes'] / payload:.1f}x" for r in got),
                    flush=True,
                )
    finally:
        server.close()

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    res: dict[str, Any] = {
        "what": "seconds from publish until every receiver serves the version (verified), median of "
        f"{versions} versions; trainer egress bytes per version (tree: what `trainer_egress_bytes` means)",
        "emulated": f"every server's uplink limited to {uplink_mbps:g} MB/s (token bucket); times model that "
        "network, bytes are counted",
        "payload_bytes": payload,
        "uplink_mbps": uplink_mbps,
        "fanout": fanout,
        "versions_per_point": versions,
        "receivers": "python -m generator_svc.relay processes (the generator's relay code, no engine), TCP",
        "machine": machine(),
        "wall_s": round(time.time() - t0, 1),
    }
    for n in sizes:
        r = runs[str(n)]
        res[str(n)] = {
            "star_s": round(med(r["star"], "seconds"), 3),
            "tree_s": round(med(r["tree"], "seconds"), 3),
            "tree_store_and_forward_s": round(med(r["tree_sf"], "seconds"), 3),
            "tree_store_and_forward_trainer_egress_bytes": int(med(r["tree_sf"], "trainer_egress_bytes")),
            "trainer_egress_bytes": int(med(r["tree"], "trainer_egress_bytes")),
            "star_trainer_egress_bytes": int(med(r["star"], "trainer_egress_bytes")),
            "tree_depth": tree_depth(n, fanout),
            "model_star_s": round(n * hop_s, 3),
            "model_tree_store_and_forward_s": round(model_tree_s(n, fanout, hop_s), 3),
            "model_tree_s": round(model_tree_s(n, fanout, hop_s, chunk_s), 3),
            "runs": r,
        }
    lo, hi = str(sizes[0]), str(sizes[-1])
    res[f"tree_{hi}_over_{lo}"] = round(res[hi]["tree_s"] / res[lo]["tree_s"], 2)
    res[f"star_{hi}_over_{lo}"] = round(res[hi]["star_s"] / res[lo]["star_s"], 2)
    res[f"tree_store_and_forward_{hi}_over_{lo}"] = round(
        res[hi]["tree_store_and_forward_s"] / res[lo]["tree_store_and_forward_s"], 2
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fanout.json").write_text(json.dumps(res, indent=2) + "\n")
    _write_md(res, sizes, out / "fanout.md")
    _plot(res, sizes, out / "fanout.png")
    return res


def _write_md(res: dict, sizes: tuple[int, ...], path: Path) -> None:
    p = res["payload_bytes"]
    lines = [
        "# Weight fan-out: star vs relay tree",
        "",
        f"One version of {p / MB:.0f} MB published to N receivers; seconds from the publish until every receiver "
        f"serves it (verified against the trainer's manifest), median of {res['versions_per_point']} versions. "
        f"Tree: fan-out {res['fanout']}, one root fetching from the trainer. **Emulated**: {res['emulated']}. "
        f"Receivers: {res['receivers']}. Machine: {res['machine']['cores']} cores, shared.",
        "",
        "| N | star s | tree s | tree / star | tree, store and forward s | trainer egress per version: star | "
        "tree | tree s&f | tree depth | model star s | model tree s | model tree s&f s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in sizes:
        r = res[str(n)]
        lines.append(
            f"| {n} | {r['star_s']:.2f} | **{r['tree_s']:.2f}** | {r['tree_s'] / r['star_s']:.2f} | "
            f"{r['tree_store_and_forward_s']:.2f} | {r['star_trainer_egress_bytes'] / p:.1f} copies | "
            f"**{r['trainer_egress_bytes'] / p:.1f} copies** | "
            f"{r['tree_store_and_forward_trainer_egress_bytes'] / p:.1f} copies | {r['tree_depth']} | "
            f"{r['model_star_s']:.2f} | {r['model_tree_s']:.2f} | {r['model_tree_store_and_forward_s']:.2f} |"
        )
    lo, hi = sizes[0], sizes[-1]
    lines += [
        "",
        f"Growth N={lo} -> {hi}: tree x{res[f'tree_{hi}_over_{lo}']}, star x{res[f'star_{hi}_over_{lo}']}, "
        f"tree store and forward x{res[f'tree_store_and_forward_{hi}_over_{lo}']}.",
        "",
        "The tree (the default) streams: a relay passes each 4 MiB chunk on as soon as it verified against "
        "the trainer's manifest (`Streaming`), so the levels overlap. Store and forward (`--store-and-forward`): "
        "a relay passes a version on only once all of it verified. Models: star = N x payload / uplink (the "
        "trainer's uplink carries every copy); store and forward = for each node, its parent's time + payload / "
        "uplink x its parent's children (they share the parent's uplink), levels one after another, so time grows "
        "as fan-out x depth; streamed = each level starts a chunk's time (x siblings) after its parent and runs at "
        "its share of the parent's uplink, so time is about fan-out x payload / uplink plus depth x a chunk.",
        "",
        f"Total bench time {res['wall_s']:.0f} s. `python -m bench fanout`.",
    ]
    path.write_text("\n".join(lines) + "\n")


def _plot(res: dict, sizes: tuple[int, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    ns = list(sizes)
    a.plot(ns, [res[str(n)]["star_s"] for n in ns], "o-", label="star (measured)")
    a.plot(ns, [res[str(n)]["tree_s"] for n in ns], "s-", label=f"tree k={res['fanout']} (measured)")
    a.plot(ns, [res[str(n)]["tree_store_and_forward_s"] for n in ns], "^-", label="tree, store and forward")
    a.plot(ns, [res[str(n)]["model_star_s"] for n in ns], ":", color="C0", label="star model")
    a.plot(ns, [res[str(n)]["model_tree_s"] for n in ns], ":", color="C1", label="tree model")
    a.plot(
        ns,
        [res[str(n)]["model_tree_store_and_forward_s"] for n in ns],
        ":",
        color="C2",
        label="store and forward model",
    )
    a.set_xscale("log", base=2)
    a.set_xlabel("receivers N")
    a.set_ylabel("publish -> all serving (s)")
    a.set_title(f"{res['payload_bytes'] / MB:.0f} MB, emulated {res['uplink_mbps']:g} MB/s uplinks")
    a.legend()
    p = res["payload_bytes"]
    b.plot(ns, [res[str(n)]["star_trainer_egress_bytes"] / p for n in ns], "o-", label="star")
    b.plot(ns, [res[str(n)]["trainer_egress_bytes"] / p for n in ns], "s-", label="tree (both kinds)")
    b.set_xscale("log", base=2)
    b.set_xlabel("receivers N")
    b.set_ylabel("trainer egress per version (copies)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    print(
        json.dumps({k: v for k, v in bench_fanout().items() if not isinstance(v, dict) or "star_s" not in v}, indent=2)
    )
