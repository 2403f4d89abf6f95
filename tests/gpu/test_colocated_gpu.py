"""On an NVIDIA GPU machine only (`pytest -m gpu`): the co-located phase switch for real.

The engine's level-1 sleep frees its device memory and wakes to the same outputs; the trainer's
state goes to host memory and back, and a step after the round trip equals a step without it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

# Deselected by CI's `-m "not gpu"`; run with `pytest -m gpu` on a CUDA machine.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from asyncrl.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0
    )


def test_engine_sleeps_and_wakes_to_the_same_outputs(tiny_model):
    from generator_svc.colocate import Turns
    from generator_svc.engine import Engine
    from shared.placement import takes_turns
    from shared.schema import SamplingParams

    assert Engine.device_type() == "cuda" and takes_turns("colocated", Engine.device_type())
    engine = Engine(str(tiny_model), dtype="float32", gpu_memory_utilization=0.3, enable_sleep_mode=True)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=8)]
        before = engine.generate([[1, 2, 3, 4]], params, [1])[0][0].completion_ids
        turns = Turns(engine, on=True)
        free_awake = torch.cuda.mem_get_info()[0]
        turns.rest()
        free_asleep = torch.cuda.mem_get_info()[0]
        assert turns.asleep and free_asleep - free_awake > 100 * 2**20  # the KV cache at least went
        turns.wake()
        assert not turns.asleep
        assert engine.generate([[1, 2, 3, 4]], params, [1])[0][0].completion_ids == before
        print(
            f"\nsleep {turns.sleep_s:.3f}s wake {turns.wake_s:.3f}s, freed {(free_asleep - free_awake) / 2**30:.2f} GiB"
        )
    finally:
        engine.close()


def test_trainer_state_round_trips_through_host_memory():
    from trainer_svc.offload import Offload

    def run(offload: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        off = Offload.for_job(model, opt, "cuda", "colocated" if offload else "split")
        assert off.on is offload
        x = torch.randn(32, 256, device="cuda")
        for _ in range(3):
            off.to_device()
            opt.zero_grad(set_to_none=False)  # keep grads, so they travel too
            model(x).square().mean().backward()
            opt.step()
            params = list(model.parameters())
            off.to_host()
            if offload:
                assert all(
                    p.device.type == "cpu" and p.grad is not None and p.grad.device.type == "cpu" for p in params
                )
                assert all(
                    t.device.type == "cpu"
                    for s in opt.state.values()
                    for t in s.values()
                    if isinstance(t, torch.Tensor)
                )
                assert list(model.parameters()) == params  # the same Parameter objects: moved in place
        off.to_device()
        return [p.detach().cpu().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
