"""The policy's weights on their way out: flattened into one buffer, fingerprinted, served and
announced to the generators."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from broker.ledger import TrainerLedger
from broker.streams import POLICY, JobStreams
from shared.ids import policy_version_id
from shared.metrics import Phases
from shared.schema import LoraAdapter, PolicyAnnouncement, pack_f32, pack_i32
from shared.transport import WeightServer, build_manifest
from trainer_svc.logprobs import token_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel


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


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class _Lease:
    """One version's hold on a staging buffer: the base of the array `HostStaging.copy` returns,
    so every array, slice or memoryview made from that array keeps it alive."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.__array_interface__ = buf.numpy().__array_interface__


class HostStaging:
    """Host buffers that a CUDA trainer copies each version into, allocated once per size and
    reused (pinned by default; `alloc(nbytes)` makes one, a test passes plain CPU tensors).

    Why: a fresh pageable copy of a 1.95 GB version took 1.6-1.7 s on an H200, every version; a
    reused pinned buffer 0.04 s after a one-time 0.9 s pinning (results/gpu.md).

    Why a buffer is reused only once nothing holds what it last handed out (its `_Lease` is gone),
    not as a fixed ring: over the tcp transport these host bytes are what the server serves, and
    it keeps the last `keep` versions, so a ring of keep + 1 would not overwrite a kept version,
    but it would overwrite one whose send is still in flight just after the server dropped it
    (`TcpWeightServer._send` holds a memoryview of it): that generator would receive the next
    version's bytes under this one's manifest, a fetch that fails its checksums.
    A lease that lives longer than expected costs one more
    buffer, never a corrupted version. Over ucx the host copy only feeds the checksum and is
    dropped before the next version: one buffer.
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor] = _pinned):
        self._alloc = alloc
        self._bufs: list[torch.Tensor] = []
        # per buffer, the lease it last handed out
        self._leases: list[weakref.ref[_Lease] | None] = []

    @property
    def buffers(self) -> int:
        """How many buffers it has allocated."""
        return len(self._bufs)

    def copy(self, flat: torch.Tensor) -> np.ndarray:
        """`flat` (a 1-D uint8 tensor, usually on a CUDA device) in a host buffer that nothing
        else holds; the returned array holds that buffer until it and every view of it are gone."""
        n = flat.numel()
        i = next((i for i, b in enumerate(self._bufs) if b.numel() == n and self._free(i)), None)
        if i is None:
            self._bufs.append(self._alloc(n))
            self._leases.append(None)
            i = len(self._bufs) - 1
        buf = self._bufs[i]
        buf.copy_(flat, non_blocking=True)
        if flat.is_cuda:  # non_blocking returns before the bytes land, and the checksum reads them next
            torch.cuda.current_stream(flat.device).synchronize()
        lease = _Lease(buf)
        self._leases[i] = weakref.ref(lease)
        return np.asarray(lease)

    def _free(self, i: int) -> bool:
        lease = self._leases[i]
        return lease is None or lease() is None


# One staging pool per weight server: the buffers live as long as the server that may serve them,
# and go with it when a job's server is dropped.
_staging: weakref.WeakKeyDictionary[Any, HostStaging] = weakref.WeakKeyDictionary()


def staging_for(server: WeightServer) -> HostStaging:
    """The host staging pool of `server`'s versions (made on first use)."""
    if server not in _staging:
        _staging[server] = HostStaging()
    return _staging[server]


def checkpoint_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the model's full state dict) under its checkpoint's names, the ones vLLM's loaders
    read: transformers 5's load-time conversions reverted (an MoE's fused `experts.gate_up_proj`
    back to one tensor per expert and projection), as `save_pretrained` writes them. Tied copies
    stay (a vLLM model with an `lm_head` module needs it in a reload; generator_svc/worker_ext.py
    drops it for one without)."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(cast("PreTrainedModel", model), dict(state)))


def probe(model: torch.nn.Module, length: int = 24) -> tuple[list[int], list[float]]:
    """A fixed pseudo-random token sequence and its logprobs under `model` (the functional
    fingerprint generators check after a swap). The same sequence for every version of a job."""
    hf = cast("PreTrainedModel", model)  # an HF model (or one wrapped, answering for it)
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(20250530)
    ids = torch.randint(min(4, vocab - 1), vocab, (1, length), generator=g)
    bos = hf.config.bos_token_id
    if bos is not None:
        ids[0, 0] = bos
    was_training = model.training
    model.eval()  # no dropout in the fingerprint
    with torch.no_grad():
        lp = token_logprobs(model, ids.to(hf.device), torch.ones_like(ids).to(hf.device))
    model.train(was_training)
    return ids[0].tolist(), lp[0].float().cpu().tolist()


def publish_weights(
    model: torch.nn.Module,
    version: int,
    server: WeightServer,
    streams: JobStreams,
    ledger: TrainerLedger,
    job_id: str,
    keep: int,
    run_id: str = "",
    snapshot: tuple[Mapping[str, torch.Tensor], tuple[list[int], list[float]]] | None = None,
    phases: Phases | None = None,
    max_staleness: int | None = None,
    lora: LoraAdapter | None = None,
    on_announce: Callable[[PolicyAnnouncement], None] | None = None,
) -> tuple[float, str]:
    """Serve and announce version `version`; returns (seconds, the version's checksum).

    `snapshot`: (full weights, probe) from `Learner.snapshot` when `model` is sharded; None takes
    both from `model`. `phases`: times flatten, checksum, serve and announce. `max_staleness`: the
    staleness bound now, announced with the version (generators admit training groups by it).
    `lora`: the weights are this LoRA adapter's tensors only (`Learner.snapshot` of a LoRA job).
    `on_announce`: called with the announcement once published (trainer_svc/redis_state.py keeps it
    to publish again if Redis loses it)."""

    def span(name: str):
        return phases.span(name) if phases is not None else nullcontext()

    t0 = time.perf_counter()
    state, (probe_ids, probe_lp) = snapshot if snapshot is not None else (model.state_dict(), probe(model))
    if lora is None:
        state = checkpoint_state(model, state)
    on_cuda = next(iter(state.values())).is_cuda
    with span("flatten"):
        entries, buf = flatten_weights(state, keep_device=on_cuda)
    with span("checksum"):
        # Checksums are of host bytes. On a CPU `buf` already is the host array (no copy); on CUDA
        # it is copied into a reused staging buffer (HostStaging: why it is never one still served).
        host = staging_for(server).copy(buf) if on_cuda else buf
        manifest = build_manifest(version, entries, host)
    with span("serve"):
        # ucx serves device memory (cuda_ipc, NVLink or RDMA: no host bounce); tcp the host bytes
        server.serve(manifest, buf if on_cuda and server.name == "ucx" else host)
    with span("announce"):
        ledger.record_policy_version(job_id, version, manifest.checksum, manifest.total_bytes)
        ann = PolicyAnnouncement(
            job_id=job_id,
            msg_id=policy_version_id(job_id, version),
            policy_version=version,
            manifest=manifest,
            transport=server.name,
            address=server.address,
            trainer_run=run_id,
            probe_ids=pack_i32(probe_ids),
            probe_logprobs=pack_f32(probe_lp),
            max_staleness=max_staleness,
            lora=lora,
        )
        streams.publish(POLICY, ann)
        if on_announce is not None:
            on_announce(ann)
        # A version older than the ones the server still holds cannot be fetched: drop its announcement.
        streams.trim_broadcast(POLICY, keep)
    return time.perf_counter() - t0, manifest.checksum
