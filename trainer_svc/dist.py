"""The trainer across processes: `torchrun --nproc-per-node N -m trainer_svc`, FSDP2 (`fully_shard`).

World size 1 (plain `python -m trainer_svc`) is the trivial case of the same code: no process
group, no wrapping, every helper below returns what the single process already has.

Who does what with N ranks:

- **rank 0** is the trainer the rest of the system sees: the feeder, the scored stream, the ledger,
  the control stream, the weight server, checkpoints. Before each piece of collective work
  (building the model, a step, a weight snapshot, a checkpoint gather, a roll-back) it
  `announce`s it to the other ranks: one msgpack header broadcast as a uint8 tensor (a length,
  then the bytes; never pickle, so no `broadcast_object_list`), then the call's tensors, each
  broadcast as it is. A step's announcement carries the whole global batch as tensors
  (trainer_svc/batch.py `TrainBatch`): every rank needs all rewards (group advantages) and all
  completion lengths (global loss normalisation) anyway, it keeps the other ranks off Redis and
  the ledger entirely, and the batch is small next to the weights (16 groups x 8 samples x 1k
  tokens ~ 1 MB). Pause, resume, stop and cancel are rank 0's decisions: while it waits it sends a
  `tick` now and then so a long pause never reaches the collective timeout, and `exit` at the end.
- **ranks 1..N-1** hold no connection to anything but the process group: `receive` an
  announcement, do the same Learner call rank 0 does, repeat until `exit`. They build the model
  from the job's `model_path` (which every node needs); rank 0's weights reach them by broadcast,
  so a checkpoint to resume from need only be readable by rank 0.

What is sharded (FSDP2, one `fully_shard` unit per decoder layer plus the root): parameters,
gradients and AdamW state, 1/N per rank. Each rank computes the loss on its contiguous share of
the global batch (in micro-batches of samples, or packed to a token budget: every rank packs every
rank's share alike, so all know the most passes any needs); the normalisation stays global
(`BatchNorm` from every sample's length), and each rank scales its loss by N before backward because the gradient
reduce-scatter averages over ranks, so the summed update equals the single-process update. (FSDP2's
`set_gradient_divide_factor(1.0)` would say "sum" directly, but it reduces with PREMUL_SUM, and
gloo raises "Cannot use ReduceOp.PREMUL_SUM with Gloo".) FSDP2 runs on CPU with gloo (checked
with torch 2.13: forward, backward, clip_grad_norm_, full state-dict gather and rank-0 broadcast
all work), so DDP is not needed.
Weights for publishing and checkpoints are gathered in full to rank 0 (CPU); optimizer state is
gathered to rank 0 and saved in the single-process `optimizer.state_dict()` layout, so a
checkpoint resumes at any world size. The frozen KL reference, if any, is replicated, not sharded.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import msgpack
import torch
import torch.distributed as dist

from trainer_svc.packing import first_fit_decreasing

log = logging.getLogger(__name__)

# Rank 0 sends a tick when it has sent nothing for this long: well inside any collective timeout.
KEEPALIVE_S = 30.0


@dataclass
class Ranks:
    """This process's place in the trainer's process group (world size 1: no group at all)."""

    rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    _last_sent: float = field(default_factory=time.monotonic, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, device: str, timeout_s: float = 1800.0) -> Ranks:
        """Join the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR...);
        without WORLD_SIZE > 1 nothing is joined. Backend nccl on CUDA (one GPU per local rank:
        `cuda` becomes `cuda:<local rank>`), gloo on CPU."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls(device=device)
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if device.startswith("cuda"):
            device = f"cuda:{local}"
            torch.cuda.set_device(local)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        log.info("rank %d of %d (%s, %s)", rank, world, backend, device)
        return cls(rank, world, device)

    def close(self) -> None:
        """Leave the process group together (on the clean path only: a rank that failed just
        exits, and torchrun stops the rest). Without the barrier, a rank tearing gloo down while
        another still finishes its last broadcast can abort ("terminate called without an active
        exception")."""
        if self.sharded and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # --- rank 0 -> the others ------------------------------------------------------------------

    def announce(self, op: str, tensors: Mapping[str, torch.Tensor] | None = None, **payload: Any) -> None:
        """Rank 0: tell every other rank which collective call comes next, with its arguments
        (`payload` msgpack-able, `tensors` by name). A no-op on the other ranks and at world size 1."""
        if not self.sharded or not self.is_main:
            return
        tensors = dict(tensors or {})
        heads = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]
        data = msgpack.packb({"op": op, **payload, "tensors": heads}, use_bin_type=True)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64, device=self._comm), 0)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._comm), 0)
        for t in tensors.values():
            if t.numel():
                dist.broadcast(_sendable(t).contiguous().to(self._comm), 0)
        self._last_sent = time.monotonic()

    def receive(self) -> dict[str, Any]:
        """Ranks 1..N-1: the next announcement from rank 0 (blocks); its tensors, on the CPU,
        under "tensors"."""
        n = torch.zeros(1, dtype=torch.int64, device=self._comm)
        dist.broadcast(n, 0)
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=self._comm)
        dist.broadcast(buf, 0)
        m = msgpack.unpackb(buf.cpu().numpy().tobytes(), raw=False)
        tensors = {}
        for name, dtype, shape in m.pop("tensors", []):
            want = getattr(torch, dtype)
            t = _sendable(torch.empty(shape, dtype=want)).to(self._comm)
            if t.numel():
                dist.broadcast(t, 0)
            tensors[name] = t.cpu().to(want)
        return {**m, "tensors": tensors}

    def keepalive(self) -> None:
        """Rank 0, while it waits (for data, or paused): a tick if it has been quiet a while."""
        if self.sharded and self.is_main and time.monotonic() - self._last_sent > KEEPALIVE_S:
            self.announce("tick")

    @property
    def _comm(self) -> torch.device:
        return torch.device(self.device if self.device.startswith("cuda") else "cpu")

    # --- the batch -----------------------------------------------------------------------------

    def shard(self, n: int) -> tuple[int, int]:
        """[lo, hi) of this rank's contiguous share of n samples (sizes differ by at most 1)."""
        base, extra = divmod(n, self.world_size)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (self.rank < extra)

    def micro_batches(self, n: int, size: int) -> list[tuple[int, int] | None]:
        """This rank's micro-batches of its share of n samples, as [lo, hi) ranges, padded with
        None to the count of the rank with the most: with FSDP every forward is a collective
        (the layer all-gathers), so every rank runs the same number of them."""
        most = math.ceil(math.ceil(n / self.world_size) / size)
        lo, hi = self.shard(n)
        return [(a, min(a + size, hi)) if (a := lo + i * size) < hi else None for i in range(most)]

    def packed_micro_batches(self, lengths: list[int], budget: int) -> list[list[int] | None]:
        """This rank's share of the samples (the same contiguous share as `micro_batches`) packed
        into micro-batches of at most `budget` tokens (`packing.first_fit_decreasing`; `lengths`
        is every sample's prompt + completion), as global sample indices, padded with None to the
        count of the rank with the most. Every rank holds every length (the step's announcement
        carries the whole batch), so each computes every rank's packing: no collective needed."""

        def bins(rank: int) -> list[list[int]]:
            lo, hi = Ranks(rank, self.world_size).shard(len(lengths))
            return [[lo + i for i in b] for b in first_fit_decreasing(lengths[lo:hi], budget)]

        most = max(len(bins(r)) for r in range(self.world_size))
        mine: list[list[int] | None] = list(bins(self.rank))
        return mine + [None] * (most - len(mine))

    def reduce_metrics(self, sums: Mapping[str, float]) -> dict[str, float]:
        """Micro-batch metric sums of every rank combined like `algorithms.accumulate` does: max
        for keys ending in "max", sum for the rest. Every rank must hold the same keys."""
        if not self.sharded:
            return dict(sums)
        keys = sorted(sums)
        out: dict[str, float] = {}
        for op, names in (
            (dist.ReduceOp.MAX, [k for k in keys if k.endswith("max")]),
            (dist.ReduceOp.SUM, [k for k in keys if not k.endswith("max")]),
        ):
            t = torch.tensor([sums[k] for k in names], dtype=torch.float64, device=self._comm)
            dist.all_reduce(t, op=op)
            out.update(zip(names, t.cpu().tolist(), strict=True))
        return out

    # --- the model -----------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, cpu_offload: bool = False, mp_policy: Any | None = None) -> torch.nn.Module:
        """Shard `model` in place with FSDP2, one unit per decoder layer (HF `_no_split_modules`)
        plus the root, then give every rank rank 0's weights (it may hold a resumed checkpoint the
        others never read). `cpu_offload`: FSDP2's CPUOffloadPolicy (sharded parameters, gradients
        and optimizer state in CPU memory). `mp_policy`: FSDP2's MixedPrecisionPolicy
        (trainer_svc/precision.py; None: parameters in their own dtype). At world size 1: `model`
        as it is."""
        if not self.sharded:
            return model
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        # pinned host memory (faster copies to the GPU) needs an accelerator; on CPU the policy is
        # accepted but there is nothing to move
        policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()

        full = {k: v.detach().clone() for k, v in model.state_dict().items()} if self.is_main else {}
        layer_types = set(getattr(model, "_no_split_modules", None) or ())
        layers = [m for m in model.modules() if type(m).__name__ in layer_types]
        if not layers:
            raise ValueError(
                f"{type(model).__name__} names no decoder layer class (_no_split_modules); "
                "FSDP2 needs one unit per layer"
            )
        mp = {} if mp_policy is None else {"mp_policy": mp_policy}
        for layer in layers:
            fully_shard(layer, offload_policy=policy, **mp)
        fully_shard(model, offload_policy=policy, **mp)
        self.load_model_state(model, full)
        return model

    def model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full HF-named state dict: on rank 0 (on CPU when sharded), {} on the others."""
        if not self.sharded:
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast(dict[str, torch.Tensor], state)  # a model's state: tensors only (torch types it any value)

    def load_model_state(self, model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        """Rank 0's full state dict into every rank's (sharded) model; others pass {}."""
        if not self.sharded:
            model.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(
            model,
            dict(state) if self.is_main else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state in `optimizer.state_dict()` layout (params by index in
        model.parameters() order) on rank 0, {} on the others. Like `state_dict()` it may share
        tensors with the live state (the unsharded `step` counters): save it before the next step."""
        if not self.sharded:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        # one optimizer: its state dict's layout (torch's type allows a list, for several)
        by_name = cast(
            dict[str, Any],
            get_optimizer_state_dict(
                model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            ),
        )
        if not self.is_main:
            return {}
        # the optimizer's own order: the parameters it updates (LoRA: the adapters only)
        index = {name: i for i, (name, _) in enumerate(_trained(model))}
        return {
            "state": {index[n]: s for n, s in by_name["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]],
        }

    def load_optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any] | None
    ) -> None:
        """Rank 0's state (`optimizer.state_dict()` layout; None: empty) into every rank's
        optimizer. Every rank must pass None or not-None alike (rank 0 announces which)."""
        if state is None:
            optimizer.state.clear()
            return
        if not self.sharded:
            optimizer.load_state_dict(dict(state))  # it copies the top level itself
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        by_name: dict[str, Any] = {}
        if self.is_main:
            names = [name for name, _ in _trained(model)]
            by_name = {
                "state": {names[i]: s for i, s in state["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
            }
        set_optimizer_state_dict(
            model, optimizer, by_name, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )


def _trained(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _sendable(t: torch.Tensor) -> torch.Tensor:
    """`t` in a dtype every backend broadcasts (gloo has no bool)."""
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (e.g. FSDP2's clip_grad_norm_ total) as a plain tensor; others as they are."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
