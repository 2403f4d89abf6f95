"""Runs inside vLLM's worker process (named by `worker_extension_cls`, so no code is pickled).

The worker pulls a weight version straight from the trainer's transport (the bytes never pass
through vLLM's RPC channel), verifies every chunk against the manifest, and reloads the weights in
place with vLLM's own `reload_weights` (which repacks them for the CPU kernels).
"""

from __future__ import annotations

import time

import torch
import xxhash

from shared.schema import Manifest
from shared.transport import make_client

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def tensors_from_buffer(buf, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
    """Views into one flat uint8 buffer, one per manifest entry (no copies)."""
    flat = torch.frombuffer(memoryview(buf), dtype=torch.uint8)
    out = []
    for t in manifest.tensors:
        dtype = _DTYPES.get(t.dtype)
        if dtype is None:
            raise ValueError(f"tensor {t.name}: unsupported dtype {t.dtype}")
        out.append((t.name, flat[t.offset : t.offset + t.nbytes].view(dtype).reshape(t.shape)))
    return out


class WeightSyncExtension:
    """Mixed into vLLM's Worker; methods are called by name through `LLM.collective_rpc`."""

    def asyncrl_load_version(self, transport: str, address: str, manifest: dict) -> dict:
        """Fetch and verify the whole version first; only then touch the engine's weights. A failed
        or interrupted transfer returns {"ok": False, ...} and leaves the old weights in place (an
        exception here would take the engine process down with it)."""
        m = Manifest.model_validate(manifest)
        t0 = time.perf_counter()
        client = make_client(transport)
        try:
            buf = client.fetch(address, m)
        except Exception as exc:  # noqa: BLE001 - any transfer failure: report, keep serving old weights
            return {"ok": False, "version": m.version, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            client.close()
        t1 = time.perf_counter()
        self.reload_weights(weights_iterator=iter(tensors_from_buffer(buf, m)))
        t2 = time.perf_counter()
        return {"ok": True, "version": m.version, "fetch_s": t1 - t0, "load_s": t2 - t1, "bytes": m.total_bytes}

    def asyncrl_fingerprint(self) -> str:
        """xxh3 over the engine's own parameters (after any repacking), in name order."""
        h = xxhash.xxh3_64()
        model = self.model_runner.get_model()
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            h.update(name.encode())
            h.update(p.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
