"""The trainer's half of co-located alternation (`placement: colocated`, ARCHITECTURE.md).

On a GPU, while the generators generate, the trainer's parameters, gradients and optimizer state
live in (pinned) host memory; before a step they go back to the device and the update is done
there, in place (the same `Parameter` objects, so the optimizer's references stay valid). On CPU
(`shared.placement.takes_turns` is false) nothing moves.
"""

from __future__ import annotations

import time

import torch

from shared.placement import takes_turns


class Offload:
    """Moves `model`'s parameters and gradients and `optimizer`'s state between `device` and host
    memory when `on`; a no-op otherwise."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: str, on: bool):
        self.model, self.optimizer, self.device, self.on = model, optimizer, torch.device(device), on
        self.on_host = False
        self.to_host_s = self.to_device_s = 0.0  # the last move's cost

    @classmethod
    def for_job(
        cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: str, placement: str, world_size: int = 1
    ) -> Offload:
        """On for a co-located job on a GPU with one trainer rank (sharded ranks keep their
        shards on the device: moving FSDP's sharded parameters is not done here)."""
        return cls(model, optimizer, device, takes_turns(placement, device) and world_size == 1)

    def _tensors(self):
        """(holder, key) of every tensor that moves: each parameter's data and grad, and each
        tensor in the optimizer's per-parameter state (AdamW: exp_avg, exp_avg_sq, step)."""
        for p in self.model.parameters():
            yield p, "data"
            if p.grad is not None:
                yield p, "grad"
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    yield state, k

    def _move(self, to: torch.device, pin: bool) -> None:
        for holder, key in list(self._tensors()):
            t = holder[key] if isinstance(holder, dict) else getattr(holder, key)
            if t.device == to:
                continue
            if pin:  # page-locked, so the copies in both directions run at full bus speed
                moved = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                moved.copy_(t, non_blocking=True)
            else:
                moved = t.to(to, non_blocking=True)
            if isinstance(holder, dict):
                holder[key] = moved
            else:
                setattr(holder, key, moved)

    def to_host(self) -> None:
        """After the step and the publish: free the device for the generators."""
        if not self.on or self.on_host:
            return
        t0 = time.perf_counter()
        self._move(torch.device("cpu"), pin=True)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.on_host, self.to_host_s = True, time.perf_counter() - t0

    def to_device(self) -> None:
        """Before the step: everything back on the device, where the update runs."""
        if not self.on or not self.on_host:
            return
        t0 = time.perf_counter()
        self._move(self.device, pin=False)
        torch.cuda.synchronize(self.device)
        self.on_host, self.to_device_s = False, time.perf_counter() - t0
