"""Weight-transfer bench: trainer process -> a separate receiver process, per buffer size.

Measured in the receiver (wall time of one call), median of a few repetitions after one warm-up:

- `ucx_mbps`: `UcxWeightClient.fetch`, the real API: a fresh buffer, every chunk's xxh3 verified
  while the rest arrives.
- `ucx_reuse_mbps`: the same verified fetch into a reused buffer (`fetch(..., out=)`, as the
  generator's worker does across swaps): no page faults on new memory.
- `ucx_raw_mbps`: `UcxWeightClient.fetch_into` a reused buffer: the link alone, no verification.
- `hash_mbps`: xxh3 over every chunk of the buffer in one thread, nothing else running (the
  verification's own ceiling).
- `tcp_mbps`: `TcpWeightClient.fetch` (the fallback), fresh buffer, verified.
- `socket_mbps`: a plain socket, `sendall` -> `recv_into` a reused buffer (the baseline).
- `memcpy_mbps`: `np.copyto` inside one process (the upper bound).

MB = 10^6 bytes. Results: results/transfer.json and results/transfer.md. On a 2-vCPU machine the
numbers move by tens of percent between runs (notes/ucx-on-cpu.md): rank, never assert.

    python -m bench.transfer [sizes in MB ...]
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench.claims import machine
from shared.schema import Manifest
from shared.transport import TcpWeightClient, TcpWeightServer, build_manifest, chunk_checksums
from shared.transport.base import DEFAULT_PIECE_BYTES
from shared.transport.ucx import UcxWeightClient, UcxWeightServer, ucx_options

MB = 1_000_000
_U64 = struct.Struct("<Q")
METHODS = ("ucx", "ucx_reuse", "ucx_raw", "tcp", "socket", "hash")


def _reps(nbytes: int) -> int:
    return 3 if nbytes >= 500 * MB else 5


# -- the raw socket baseline ------------------------------------------------------------------


class _SocketSender:
    """Per connection: read a u64 byte count, `sendall` that many bytes of `buf`."""

    def __init__(self, buf: np.ndarray):
        self.buf = buf
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                (n,) = _U64.unpack(conn.recv(_U64.size, socket.MSG_WAITALL))
                conn.sendall(self.buf.data[:n])

    def close(self) -> None:
        self._sock.close()


def _socket_recv(port: int, out: np.ndarray) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_U64.pack(out.nbytes))
        view = out.data
        while len(view):
            n = sock.recv_into(view)
            if n == 0:
                raise ConnectionError("sender closed early")
            view = view[n:]


# -- the receiver process ------------------------------------------------------------------


def _receiver(conn: Connection) -> None:
    """Runs in its own (spawned) process: one command per message, replies with the times."""
    ucx, tcp = UcxWeightClient(), TcpWeightClient()
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        method, address, raw_manifest, reps = cmd
        m = Manifest.model_validate_json(raw_manifest)
        reuse = np.empty(m.total_bytes, dtype=np.uint8)
        reuse.fill(0)  # touch every page once, outside the timings
        times = []
        for _ in range(reps + 1):  # the first is the warm-up
            t0 = time.perf_counter()
            if method == "ucx":
                ucx.fetch(address, m)
            elif method == "ucx_reuse":
                ucx.fetch(address, m, out=reuse)
            elif method == "ucx_raw":
                ucx.fetch_into(address, m, reuse)
            elif method == "tcp":
                tcp.fetch(address, m)
            elif method == "socket":
                _socket_recv(int(address), reuse)
            elif method == "hash":
                chunk_checksums(reuse, m.chunk_bytes)
            times.append(time.perf_counter() - t0)
        conn.send(times[1:])


def _memcpy(buf: np.ndarray, reps: int) -> list[float]:
    dst = np.empty_like(buf)
    dst.fill(0)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        np.copyto(dst, buf)
        times.append(time.perf_counter() - t0)
    return times[1:]


def bench_transfer(sizes_mb: tuple[int, ...] = (10, 100, 1000), out_dir: str = "results") -> dict[str, Any]:

    ctx = mp.get_context("spawn")  # the receiver must not inherit this process's UCX state
    parent, child = ctx.Pipe()
    receiver = ctx.Process(target=_receiver, args=(child,), name="transfer-receiver", daemon=True)
    receiver.start()
    ucx_srv, tcp_srv = UcxWeightServer(port=0, keep=1), TcpWeightServer(port=0, keep=1)
    sizes: dict[str, dict[str, float]] = {}
    seconds: dict[str, dict[str, list[float]]] = {}  # every timed repetition, for the record
    try:
        for mb in sizes_mb:
            nbytes = mb * MB
            buf = np.random.default_rng(mb).integers(0, 256, size=nbytes, dtype=np.uint8)
            m = build_manifest(mb, [("weights", [nbytes], "uint8", nbytes)], buf)
            ucx_srv.serve(m, buf)
            tcp_srv.serve(m, buf)
            sock_srv = _SocketSender(buf)
            reps = _reps(nbytes)
            addresses = {
                "ucx": ucx_srv.address,
                "ucx_raw": ucx_srv.address,
                "tcp": tcp_srv.address,
                "socket": str(sock_srv.port),
                "ucx_reuse": ucx_srv.address,
                "hash": "",
            }
            row: dict[str, float] = {}
            times: dict[str, list[float]] = {}
            for method in METHODS:
                parent.send((method, addresses[method], m.model_dump_json(), reps))
                times[method] = parent.recv()
            times["memcpy"] = _memcpy(buf, reps)
            for method, ts in times.items():
                row[f"{method}_mbps"] = nbytes / MB / statistics.median(ts)
            row["reps"] = reps
            sizes[str(mb)] = row
            seconds[str(mb)] = times
            sock_srv.close()
            print(f"{mb:>6} MB: " + ", ".join(f"{k} {v:,.0f}" for k, v in row.items()), flush=True)
            del buf
    finally:
        parent.send(None)
        receiver.join(timeout=30)
        ucx_srv.close()
        tcp_srv.close()
    largest = sizes[str(max(sizes_mb))]
    result: dict[str, Any] = {
        "sizes": sizes,
        "largest_mb": max(sizes_mb),
        "ucx_over_socket": largest["ucx_mbps"] / largest["socket_mbps"],
        "ucx_raw_over_socket": largest["ucx_raw_mbps"] / largest["socket_mbps"],
        # verified (into a reused buffer, as the generator fetches) / raw, same buffer, same link
        "verified_over_raw": largest["ucx_reuse_mbps"] / largest["ucx_raw_mbps"],
        "verified_fresh_over_raw": largest["ucx_mbps"] / largest["ucx_raw_mbps"],
        "settings": {
            "ucx_options": ucx_options(),
            "UCX_TLS": os.environ.get("UCX_TLS", "(unset: all)"),
            "piece_bytes": DEFAULT_PIECE_BYTES,
            "chunk_bytes": m.chunk_bytes,
        },
        "seconds": seconds,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    _report(result, Path(out_dir))
    return result


def _report(r: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(json.dumps(r, indent=2) + "\n")
    md = [
        "| size (MB) | UCX fetch, verified | UCX fetch, verified, reused buffer | UCX raw (reused buffer) "
        "| TCP fetch, verified | socket sendall/recv_into | xxh3 alone (1 thread) | memcpy (1 process) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mb, row in r["sizes"].items():
        md.append(
            f"| {mb} | {row['ucx_mbps']:,.0f} | {row['ucx_reuse_mbps']:,.0f} | {row['ucx_raw_mbps']:,.0f} "
            f"| {row['tcp_mbps']:,.0f} | {row['socket_mbps']:,.0f} | {row['hash_mbps']:,.0f} "
            f"| {row['memcpy_mbps']:,.0f} |"
        )
    md += [
        "",
        f"MB/s (MB = 10^6 bytes), trainer process -> a separate receiver process, median of "
        f"{', '.join(str(row['reps']) for row in r['sizes'].values())} runs after a warm-up.",
        f"UCX fetch / socket at {r['largest_mb']} MB: {r['ucx_over_socket']:.2f} (target >= 0.8); "
        f"UCX raw / socket: {r['ucx_raw_over_socket']:.2f}.",
        f"Verified / raw UCX at {r['largest_mb']} MB (same reused buffer): {r['verified_over_raw']:.2f} "
        f"(target >= 0.8); with a fresh buffer per fetch: {r['verified_fresh_over_raw']:.2f} (a fresh "
        "buffer also pays the page faults of touching new memory).",
        f"Settings: {r['settings']}.",
        f"Machine: {r['machine']}; {r['date']}.",
    ]
    (out / "transfer.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    bench_transfer(tuple(int(a) for a in sys.argv[1:]) or (10, 100, 1000))
