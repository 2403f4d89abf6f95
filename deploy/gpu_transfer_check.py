"""GPU check: weight transfer from CUDA memory over UCX, against a device-to-device copy.

Run on a machine with an NVIDIA GPU (CUDA torch and ucxx-cu12 installed):

    python deploy/gpu_transfer_check.py --gb 1 [--out results/transfer_gpu.json]

The trainer side serves a CUDA uint8 buffer with `UcxWeightServer`; a separate receiver process
pulls it straight into CUDA memory with `UcxWeightClient.fetch_into` (cuda_ipc / NVLink on one box,
RDMA between boxes when UCX has it), then checks every chunk against the manifest on the host.
Set UCX_PROTO_INFO=y to see which transport carried the data.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time


def _receiver(address: str, manifest_json: str, reps: int, q) -> None:
    import torch

    from shared.schema import Manifest
    from shared.transport import bad_chunks
    from shared.transport.ucx import UcxWeightClient

    torch.cuda.init()
    m = Manifest.model_validate_json(manifest_json)
    out = torch.empty(m.total_bytes, dtype=torch.uint8, device="cuda")
    client = UcxWeightClient()
    times = []
    for _ in range(reps + 1):  # the first fetch creates the UCX worker: not timed
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        client.fetch_into(address, m, out)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    q.put({"times_s": times[1:], "bad_chunks": bad_chunks(out.cpu().numpy(), m)})


def main() -> None:
    import torch

    from shared.transport import build_manifest
    from shared.transport.ucx import UcxWeightServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="results/transfer_gpu.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check needs an NVIDIA GPU")
    n = int(a.gb * 1e9)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    d2d = []
    for _ in range(a.reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        d2d.append(time.perf_counter() - t0)
    manifest = build_manifest(0, [("weights", [n], "uint8", n)], src.cpu().numpy())
    server = UcxWeightServer(keep=1)
    server.serve(manifest, src)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(server.address, manifest.model_dump_json(), a.reps, q))
    p.start()
    res = q.get(timeout=600)
    p.join()
    server.close()
    ucx_s = sorted(res["times_s"])[len(res["times_s"]) // 2]
    d2d_s = sorted(d2d[1:])[len(d2d[1:]) // 2]
    result = {
        "bytes": n,
        "ucx_cuda_gbps": n / ucx_s / 1e9,
        "d2d_copy_gbps": n / d2d_s / 1e9,
        "ucx_over_d2d": d2d_s / ucx_s,
        "verified": not res["bad_chunks"],
        "gpu": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=2))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
