"""The policy's weights on their way out: flattened into one buffer, fingerprinted, served and
announced to the generators."""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch

from broker.streams import POLICY, JobStreams
from shared.ids import policy_version_id
from shared.metrics import Phases
from shared.schema import LoraAdapter, PolicyAnnouncement, pack_f32, pack_i32
from shared.transport import WeightServer, build_manifest
from trainer_svc.logprobs import token_logprobs


def flatten_weights(
    model: torch.nn.Module | Mapping[str, torch.Tensor], keep_device: bool = False
) -> tuple[list[tuple[str, list[int], str, int]], Any]:
    """Every tensor of the HF state dict (of `model`, or `model` is one), back to back in one
    uint8 buffer (checkpoint names).

    Returns a host numpy array, or with `keep_device` a uint8 tensor on the model's device (so a
    GPU trainer can serve device memory over UCX: cuda_ipc/NVLink or RDMA, no host bounce)."""
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    entries, parts = [], []
    for name, t in state.items():
        t = t.detach().contiguous()
        entries.append((name, list(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size()))
        parts.append(t.reshape(-1).view(torch.uint8))
    flat = torch.cat(parts)
    return entries, (flat if keep_device else flat.cpu().numpy())


def probe(model: torch.nn.Module, length: int = 24) -> tuple[list[int], list[float]]:
    """A fixed pseudo-random token sequence and its logprobs under `model` (the functional
    fingerprint generators check after a swap). The same sequence for every version of a job."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(20250530)
    ids = torch.randint(min(4, vocab - 1), vocab, (1, length), generator=g)
    bos = model.config.bos_token_id
    if bos is not None:
        ids[0, 0] = bos
    was_training = model.training
    model.eval()  # no dropout in the fingerprint
    with torch.no_grad():
        lp = token_logprobs(model, ids.to(model.device), torch.ones_like(ids).to(model.device))
    model.train(was_training)
    return ids[0].tolist(), lp[0].float().cpu().tolist()


def publish_weights(
    model: torch.nn.Module, version: int, server: WeightServer, streams: JobStreams, ledger, job_id: str, keep: int,
    run_id: str = "", snapshot: tuple[Mapping[str, torch.Tensor], tuple[list[int], list[float]]] | None = None,
    phases: Phases | None = None,
    max_staleness: int | None = None,
    lora: LoraAdapter | None = None,
) -> tuple[float, str]:
    """Serve and announce version `version`; returns (seconds, the version's checksum).

    `snapshot`: (full weights, probe) from `Learner.snapshot` when `model` is sharded; None takes
    both from `model`. `phases`: times flatten, checksum, serve and announce. `max_staleness`: the
    staleness bound now, announced with the version (generators admit training groups by it).
    `lora`: the weights are this LoRA adapter's tensors only (`Learner.snapshot` of a LoRA job)."""
    def span(name: str):
        return phases.span(name) if phases is not None else nullcontext()

    t0 = time.perf_counter()
    state, (probe_ids, probe_lp) = snapshot if snapshot is not None else (model.state_dict(), probe(model))
    on_gpu = next(iter(state.values())).is_cuda and server.name == "ucx"
    with span("flatten"):
        entries, buf = flatten_weights(state, keep_device=on_gpu)
    with span("checksum"):
        manifest = build_manifest(version, entries, buf.cpu().numpy() if on_gpu else buf)  # checksums on host bytes
    with span("serve"):
        server.serve(manifest, buf)
    with span("announce"):
        ledger.record_policy_version(job_id, version, manifest.checksum, manifest.total_bytes)
        streams.publish(
            POLICY,
            PolicyAnnouncement(
                job_id=job_id, msg_id=policy_version_id(job_id, version), policy_version=version,
                manifest=manifest, transport=server.name, address=server.address, trainer_run=run_id,
                probe_ids=pack_i32(probe_ids), probe_logprobs=pack_f32(probe_lp), max_staleness=max_staleness, lora=lora,
            ),
        )
        # A version older than the ones the server still holds cannot be fetched: drop its announcement.
        streams.trim_broadcast(POLICY, keep)
    return time.perf_counter() - t0, manifest.checksum
