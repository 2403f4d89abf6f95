"""vLLM's sampled-token logprobs agree with trainer_svc.logprobs on the same tokens (the trainer in
float32, and in bfloat16 mixed precision within a looser stated bound).

The importance weights of off-policy RL are exp(trainer logprob - generator logprob), so the two
must score the same tokens alike. vLLM starts engine processes and needs a ``__main__`` guard,
so this file doubles as the script the test runs in a subprocess: ``python
tests/test_logprob_match.py MODEL_DIR OUT_JSON`` samples with vLLM and writes the samples as
JSON (a file, not stdout, which vLLM's engine processes also write to).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROMPTS = ["17+25=", "3+4=", "0+19=", "Hello, world! ", "a b  c"]
N_SAMPLES = 8
MAX_TOKENS = 8
# 1.0 is what the demo trains with; 0.7 checks that the engine reports the *processed*
# (temperature-scaled) distribution, the behaviour policy the trainer divides by.
TEMPERATURES = (1.0, 0.7)


def _sample_with_engine(model_dir: str) -> dict:
    """Sample through generator_svc.engine.Engine: the exact code path the generator service uses."""
    from generator_svc.engine import Engine
    from shared.schema import SamplingParams

    engine = Engine(model_dir, seed=0, dtype="float32", max_model_len=256, gpu_memory_utilization=0.2)
    out: dict = {}
    for t in TEMPERATURES:
        params = SamplingParams(temperature=t, max_tokens=MAX_TOKENS, seed=0)
        groups = engine.generate(PROMPTS, [params] * len(PROMPTS), [N_SAMPLES] * len(PROMPTS))
        out[str(t)] = [
            {"prompt_ids": s.prompt_ids, "completion_ids": s.completion_ids, "logprobs": s.logprobs}
            for g in groups
            for s in g
        ]
    engine.close()
    return out


@pytest.mark.integration
@pytest.mark.slow
def test_vllm_logprobs_match_trainer(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from asyncrl.tiny_model import build_tiny_model
    from trainer_svc.logprobs import sequence_logprobs
    from trainer_svc.precision import autocast

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    out_json = tmp_path / "vllm_samples.json"
    proc = subprocess.run(
        [sys.executable, __file__, str(model_dir), str(out_json)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    by_temperature = json.loads(out_json.read_text())
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bos = 1  # asyncrl.tiny_model: <pad>, <s>, </s>, <unk> are ids 0..3
    for t in TEMPERATURES:
        records = by_temperature[str(t)]
        assert len(records) == len(PROMPTS) * N_SAMPLES
        assert all(r["prompt_ids"][0] == bos for r in records), "vLLM prompt lacks BOS"
        with torch.no_grad():
            ours = sequence_logprobs(
                model,
                [r["prompt_ids"] for r in records],
                [r["completion_ids"] for r in records],
                temperature=t,
            )
        diffs = torch.cat(
            [(o - torch.tensor(r["logprobs"], dtype=torch.float32)).abs() for o, r in zip(ours, records, strict=True)]
        )
        print(
            f"temperature {t}: logprob |vLLM - trainer| over {diffs.numel()} tokens: "
            f"mean {diffs.mean().item():.3g} max {diffs.max().item():.3g}"
        )
        assert diffs.numel() > 0
        assert diffs.mean().item() <= 1e-3
        assert diffs.max().item() <= 1e-2
        # the trainer in bfloat16 mixed precision (algorithm.dtype, CPU autocast) against the same
        # float32 engine: bfloat16's 8-bit mantissa in the matmuls moves logprobs by ~1e-3 on this
        # model (bench/precision.py measures it at 13M parameters); bounds with ~10x room
        with torch.no_grad(), autocast("cpu", "bfloat16")():
            ours16 = sequence_logprobs(
                model, [r["prompt_ids"] for r in records], [r["completion_ids"] for r in records], temperature=t
            )
        diffs16 = torch.cat(
            [(o - torch.tensor(r["logprobs"], dtype=torch.float32)).abs() for o, r in zip(ours16, records, strict=True)]
        )
        print(
            f"temperature {t}: bfloat16 trainer |vLLM - trainer| mean {diffs16.mean().item():.3g} "
            f"max {diffs16.max().item():.3g}"
        )
        assert 0 < diffs16.max().item() <= 5e-2  # > 0: autocast did change the numerics
        assert diffs16.mean().item() <= 1e-2


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(_sample_with_engine(sys.argv[1])))
