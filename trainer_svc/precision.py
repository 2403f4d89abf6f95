"""The trainer's compute precision (algorithm.dtype): float32, or bfloat16 mixed precision.

bfloat16 here is mixed precision, never a bfloat16 copy of the model: the parameters, their
gradients and AdamW's moments stay float32 (the master weights, the only copy, and the one
published to the generators), and only the forward runs under `torch.autocast`, which casts the
inputs of matmul-like ops to bfloat16 and leaves reductions and norms in float32. The logprobs
and the loss are then computed in float32 from the bfloat16 logits (trainer_svc/logprobs.py casts
them). Activation checkpointing recomputes under the autocast state of the original forward, so
it composes; so does the chunked logprob path (its head runs inside the same context).

On CUDA with FSDP2, `mixed_precision_policy` also all-gathers the parameters in bfloat16 and
reduces gradients in float32 (the reduce-scatter's sums stay exact-ish); on CPU (gloo) autocast
alone is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from trainer_svc.algorithms import lookup

# algorithm.dtype -> the autocast dtype (None: no autocast, plain float32)
AUTOCAST: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16}


def device_type(device: str | torch.device) -> str:
    """ "cpu" or "cuda" (the autocast device type) of a device string such as "cuda:1"."""
    return torch.device(device).type


def autocast(device: str | torch.device, dtype: str) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """A factory of the forward's precision context for `dtype` on `device`: a no-op for float32,
    `torch.autocast(device_type, bfloat16)` for bfloat16.

    Raises:
        ValueError: on an unknown dtype name, listing the valid ones.
    """
    low = lookup(AUTOCAST, dtype, "trainer dtype")
    if low is None:
        return contextlib.nullcontext
    kind = device_type(device)
    return lambda: torch.autocast(device_type=kind, dtype=low)


def mixed_precision_policy(device: str | torch.device, dtype: str) -> Any | None:
    """FSDP2's MixedPrecisionPolicy for `dtype` on `device`: bfloat16 parameters in the forward
    and backward, float32 gradient reduction, on CUDA only; None otherwise (float32, or CPU where
    autocast does the casting and gloo's bfloat16 collectives are not relied on)."""
    low = lookup(AUTOCAST, dtype, "trainer dtype")
    if low is None or device_type(device) != "cuda":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
