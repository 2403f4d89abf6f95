"""Which co-located roles hand the device over between phases (shared.placement.takes_turns) and
what that decision turns on and off in the generator and trainer (the GPU paths themselves run in
tests/gpu/test_colocated_gpu.py)."""

from __future__ import annotations

import torch

from shared.placement import takes_turns
from trainer_svc.offload import Offload


def test_only_colocated_gpu_roles_take_turns():
    assert takes_turns("colocated", "cuda") and takes_turns("colocated", "cuda:1")
    assert not takes_turns("colocated", "cpu")  # CPU: the phases share cores, nothing moves
    assert not takes_turns("split", "cuda") and not takes_turns("split", "cpu")


def test_the_trainer_offloads_only_colocated_on_a_gpu_with_one_rank():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    assert Offload.for_job(model, opt, "cuda", "colocated").on
    assert not Offload.for_job(model, opt, "cuda", "colocated", world_size=2).on  # FSDP shards stay put
    assert not Offload.for_job(model, opt, "cuda", "split").on
    off = Offload.for_job(model, opt, "cpu", "colocated")
    before = model.weight.data_ptr()
    off.to_host()
    off.to_device()
    assert not off.on and not off.on_host and model.weight.data_ptr() == before  # CPU: nothing moved
