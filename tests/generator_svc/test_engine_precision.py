"""The engine's precision knobs where the device is known: fp8 quantization is refused by the CPU
build with a message that says what to do, before any engine is built."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration]


def test_fp8_refused_on_cpu(tmp_path, monkeypatch) -> None:
    pytest.importorskip("vllm")
    from generator_svc.engine import Engine, check_quantization

    # `prepare` sets these for the engine; monkeypatch puts them back after the test
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    if Engine.device_type() == "cpu":
        # no model is read: the refusal comes before vLLM looks at the path
        with pytest.raises(ValueError, match="needs a CUDA GPU.*generator.quantization"):
            Engine(str(tmp_path / "no-model"), quantization="fp8")
    else:  # on a GPU the same rule lets fp8 through
        check_quantization("fp8", cpu=False)


def test_the_quantization_rule() -> None:
    from generator_svc.engine import check_quantization

    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        check_quantization("fp8", cpu=True)
    check_quantization("fp8", cpu=False)
    check_quantization(None, cpu=True)
