"""vLLM's sampled-token logprobs agree with trainer_svc.logprobs on the same tokens.

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
TEMPERATURE = 1.0


def _sample_with_vllm(model_dir: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        dtype="float32",
        gpu_memory_utilization=0.2,
        max_model_len=256,
        enforce_eager=True,
        seed=0,
    )
    params = SamplingParams(
        n=N_SAMPLES, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, logprobs=0, seed=0
    )
    records = []
    for out in llm.generate(PROMPTS, params):
        for c in out.outputs:
            ids = list(c.token_ids)
            records.append(
                {
                    "prompt_ids": list(out.prompt_token_ids),
                    "completion_ids": ids,
                    # logprobs=0: each position holds just the sampled token's logprob.
                    "logprobs": [c.logprobs[i][t].logprob for i, t in enumerate(ids)],
                }
            )
    return {"records": records}


@pytest.mark.integration
@pytest.mark.slow
def test_vllm_logprobs_match_trainer(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from trainer_svc.logprobs import sequence_logprobs
    from trainer_svc.tiny_model import build_tiny_model

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
    records = json.loads(out_json.read_text())["records"]
    assert len(records) == len(PROMPTS) * N_SAMPLES

    bos = 1  # trainer_svc.tiny_model: <pad>, <s>, </s>, <unk> are ids 0..3
    assert all(r["prompt_ids"][0] == bos for r in records), "vLLM prompt lacks BOS"

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = sequence_logprobs(
            model,
            [r["prompt_ids"] for r in records],
            [r["completion_ids"] for r in records],
            temperature=TEMPERATURE,
        )
    diffs = torch.cat(
        [
            (o - torch.tensor(r["logprobs"], dtype=torch.float32)).abs()
            for o, r in zip(ours, records, strict=True)
        ]
    )
    print(
        f"logprob |vLLM - trainer| over {diffs.numel()} tokens: "
        f"mean {diffs.mean().item():.3g} max {diffs.max().item():.3g}"
    )
    assert diffs.numel() > 0
    assert diffs.mean().item() <= 1e-3
    assert diffs.max().item() <= 1e-2


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(_sample_with_vllm(sys.argv[1])))
