"""Runs inside vLLM's worker process (named by `worker_extension_cls`, so no code is pickled).

The worker pulls a weight version straight from the trainer's transport (the bytes never pass
through vLLM's RPC channel), verifies every chunk against the manifest, and reloads the weights in
place with vLLM's own `reload_weights` (which repacks them for the CPU kernels).

vLLM's layerwise reload counts every buffer of a layer as something to load, non-persistent ones
too, and warns "<Layer>: Failed to load weights" for a layer that got nothing, after which it puts
the layer's own tensors back unchanged. A rotary embedding holds only `cos_sin_cache`, a
non-persistent buffer computed from the config that no checkpoint (and no model's `load_weights`)
carries, so that warning came on every swap with nothing wrong. `_quiet_derived_only_layers` drops
exactly that message for layer classes made only of such buffers; a layer that has parameters
and gets none still warns (tests/generator_svc/test_swap_warning.py checks both, and that the
swapped weights are the ones the engine then scores with).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import xxhash

from shared.schema import LoraAdapter, Manifest
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


_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_NOTHING_LOADED = "%s: Failed to load weights"


class _DerivedOnlyLayers(logging.Filter):
    """Drops vLLM's "nothing loaded" warning for the named layer classes only."""

    def __init__(self) -> None:
        super().__init__()
        self.classes: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == _NOTHING_LOADED and args[:1] and args[0] in self.classes)


_derived_only = _DerivedOnlyLayers()


def derived_only_classes(model: torch.nn.Module) -> set[str]:
    """Layer classes whose every instance holds buffers but no parameters and no persistent
    buffers: nothing of theirs is in a checkpoint, so a weight swap never loads anything there."""
    derived, loadable = set(), set()
    for m in model.modules():
        has_params = any(p is not None for p in m._parameters.values())
        buffers = [n for n, b in m._buffers.items() if b is not None]
        persistent = [n for n in buffers if n not in m._non_persistent_buffers_set]
        if has_params or persistent:
            loadable.add(type(m).__name__)
        elif buffers:
            derived.add(type(m).__name__)
    return derived - loadable


def _quiet_derived_only_layers(model: torch.nn.Module) -> None:
    _derived_only.classes |= derived_only_classes(model)
    logger = logging.getLogger(_RELOAD_LOGGER)
    if _derived_only not in logger.filters:
        logger.addFilter(_derived_only)


def _fetch(transport: str, address: str, m: Manifest) -> Any:
    """The version's bytes, verified; or {"ok": False, ...} saying why not (any transfer failure is
    reported, never raised: an exception would take the engine process down, and the old weights
    keep serving)."""
    client = make_client(transport)
    try:
        return client.fetch(address, m)
    except Exception as exc:  # noqa: BLE001 - see above
        return {"ok": False, "version": m.version, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        client.close()


def _tied_copy_without_module(model: torch.nn.Module, name: str) -> bool:
    """Whether `name` is a tied output embedding the engine's model has no module for. A trainer's
    state dict carries `lm_head.weight` of a tied model; vLLM's Gemma 2 computes its logits from
    `embed_tokens` and has no `lm_head`, and its loader refuses the name ("There is no module or
    parameter named 'lm_head'"). Models with an `lm_head` module (tied or not) take it: a layer
    that gets nothing in a reload is restored to its old tensors, which would untie it."""
    if name != "lm_head.weight":
        return False
    try:
        model.get_submodule("lm_head")
    except AttributeError:
        return True
    return False


def _repack_cpu_experts(model: torch.nn.Module) -> int:
    """Redo the CPU MoE kernel's own weight preparation after a reload; returns the layers redone.

    vLLM's CPU experts pad and prepack `w13_weight`/`w2_weight` into their grouped-GEMM layout
    once, when the kernel is built. A reload runs the layer's `process_weights_after_loading`
    again, which (the kernel being built by then) copies the new weights in as they came and skips
    that step, so the kernel read plain weights as packed ones: after a swap an MoE's engine no
    longer scored like the trainer (the post-swap probe missed by 0.09-0.34 in logprob). The
    experts' own step, run on the freshly loaded weights, is exactly what the first load did."""
    done = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or type(experts).__name__ not in _CPU_EXPERTS or getattr(experts, "_use_zentorch", False):
            continue
        experts.process_weights_after_loading(module)
        done += 1
    return done


# vLLM's unquantized CPU expert kernels (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py),
# whose process_weights_after_loading pads and prepacks; named so vLLM is not imported here
_CPU_EXPERTS = (
    "CPUUnquantizedExperts",
    "X86CPUUnquantizedExperts",
    "ArmCPUUnquantizedExperts",
    "PowerCPUUnquantizedExperts",
)


class _ModelRunner(Protocol):
    def get_model(self) -> torch.nn.Module: ...


class WeightSyncExtension:
    """Mixed into vLLM's Worker; methods are called by name through `LLM.collective_rpc`."""

    if TYPE_CHECKING:  # the Worker's, which this class is mixed into (vLLM is not imported here)
        model_runner: _ModelRunner

        def reload_weights(self, *, weights_iterator: Iterator[tuple[str, torch.Tensor]]) -> None: ...

    def asyncrl_load_version(self, transport: str, address: str, manifest: dict) -> dict:
        """Fetch and verify the whole version first; only then touch the engine's weights. A failed
        or interrupted transfer returns {"ok": False, ...} and leaves the old weights in place (an
        exception here would take the engine process down with it)."""
        m = Manifest.model_validate(manifest)
        t0 = time.perf_counter()
        buf = _fetch(transport, address, m)
        if isinstance(buf, dict):
            return buf
        t1 = time.perf_counter()
        model = self.model_runner.get_model()
        _quiet_derived_only_layers(model)
        tensors = [(n, t) for n, t in tensors_from_buffer(buf, m) if not _tied_copy_without_module(model, n)]
        self.reload_weights(weights_iterator=iter(tensors))
        _repack_cpu_experts(model)
        t2 = time.perf_counter()
        return {"ok": True, "version": m.version, "fetch_s": t1 - t0, "load_s": t2 - t1, "bytes": m.total_bytes}

    def asyncrl_fetch_adapter(self, transport: str, address: str, manifest: dict, adapter: dict, path: str) -> dict:
        """A LoRA version: fetch and verify its tensors like `asyncrl_load_version`, then write
        them as a PEFT adapter folder at `path` for vLLM's LoRA loader (the engine adds it)."""
        from safetensors.torch import save_file

        m = Manifest.model_validate(manifest)
        a = LoraAdapter.model_validate(adapter)
        t0 = time.perf_counter()
        buf = _fetch(transport, address, m)
        if isinstance(buf, dict):
            return buf
        t1 = time.perf_counter()
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {name: t.contiguous() for name, t in tensors_from_buffer(buf, m)}, str(out / "adapter_model.safetensors")
        )
        (out / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "r": a.rank,
                    "lora_alpha": a.alpha,
                    "target_modules": list(a.target_modules),
                    "bias": "none",
                    "fan_in_fan_out": False,
                    "use_rslora": False,
                    "use_dora": False,
                    "modules_to_save": None,
                }
            )
        )
        return {
            "ok": True,
            "version": m.version,
            "fetch_s": t1 - t0,
            "load_s": time.perf_counter() - t1,
            "bytes": m.total_bytes,
        }

    def asyncrl_adapter_fingerprint(self, path: str) -> str:
        """xxh3 of the loaded adapter's file (the tensors vLLM read)."""
        return xxhash.xxh3_64((Path(path) / "adapter_model.safetensors").read_bytes()).hexdigest()

    def asyncrl_fingerprint(self) -> str:
        """xxh3 over the engine's own parameters (after any repacking), in name order."""
        h = xxhash.xxh3_64()
        model = self.model_runner.get_model()
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            h.update(name.encode())
            h.update(p.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
