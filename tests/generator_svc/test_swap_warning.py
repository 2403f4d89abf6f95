"""An in-place weight swap through the real vLLM CPU engine logs no "RotaryEmbedding: Failed to
load weights", the swapped weights are what the engine scores with afterwards, the rotary cache is
untouched, and a layer that really gets no weights still warns (the silencing is that narrow)."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from shared.transport import TcpWeightServer, build_manifest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_swap_logs_no_rotary_warning_and_takes_effect(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from asyncrl.tiny_model import build_tiny_model
    from generator_svc.engine import Engine
    from generator_svc.worker_ext import derived_only_classes
    from trainer_svc.weights import flatten_weights

    model_dir = build_tiny_model(tmp_path / "m", layers=1, hidden=64, heads=2, intermediate=128, seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    engine = Engine(str(model_dir), max_model_len=64)
    server = TcpWeightServer(keep=2)
    records = Records()
    logger = logging.getLogger(RELOAD_LOGGER)
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        worker = engine._llm.llm_engine.model_executor.driver_worker.worker  # in-process engine
        vmodel = worker.model_runner.get_model()
        assert {type(m).__name__ for m in vmodel.modules()} & {"RotaryEmbedding"}  # the layer that warned
        assert derived_only_classes(vmodel) == {"RotaryEmbedding"}
        rope = next(m for m in vmodel.modules() if type(m).__name__ == "RotaryEmbedding")
        cache_before = rope.cos_sin_cache.clone()

        ids = list(range(3, 40))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        entries, buf = flatten_weights(model)
        m1 = build_manifest(1, entries, buf)
        server.serve(m1, buf)
        res = engine.load_version("tcp", server.address, m1)
        assert res["ok"]
        assert not [msg for msg in records.messages if "Failed to load weights" in msg], records.messages
        assert torch.equal(rope.cos_sin_cache, cache_before)  # vLLM put the derived cache back as it was
        got = torch.tensor(engine.score(ids))
        torch.testing.assert_close(got, hf_logprobs(model, ids), atol=2e-4, rtol=0)

        # A version without the final norm's weight: that layer has a parameter and loads nothing,
        # so vLLM's warning must still come through.
        kept = [t for t in m1.tensors if t.name != "model.norm.weight"]
        assert len(kept) == len(m1.tensors) - 1
        buf2 = np.concatenate([buf[t.offset : t.offset + t.nbytes] for t in kept])
        m2 = build_manifest(2, [(t.name, t.shape, t.dtype, t.nbytes) for t in kept], buf2)
        server.serve(m2, buf2)
        records.messages.clear()
        engine.load_version("tcp", server.address, m2)
        failed = [msg for msg in records.messages if "Failed to load weights" in msg]
        assert failed == ["RMSNorm: Failed to load weights"], records.messages
    finally:
        logger.removeHandler(records)
        threading.Thread(target=server.close, daemon=True).start()
        engine.close()
