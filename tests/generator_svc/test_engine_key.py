"""When a generator of the fleet keeps its engine for the next job (generator_svc.service.engine_key),
and when the reward service keeps a scorer's workers (reward_svc.service.scorer_key)."""

from __future__ import annotations

import json
from pathlib import Path

from generator_svc.service import engine_key
from reward_svc.service import scorer_key
from shared.rewards.spec import PythonReward

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "eos_token_id": 2,
    "_name_or_path": "/somewhere",
    "transformers_version": "4.0",
    "torch_dtype": "float32",
}


def _model(root: Path, config: dict | None = None, tokenizer: str = '{"vocab": "abc"}', weights: bytes = b"w") -> str:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config or CONFIG))
    (root / "tokenizer.json").write_text(tokenizer)
    (root / "model.safetensors").write_bytes(weights)
    return str(root)


def _key(path: str, lora: int | None = None, dtype: str = "float32") -> str:
    return engine_key(path, dtype=dtype, quantization=None, lora_rank=lora, sleep_mode=False)


def test_a_model_of_the_same_shape_and_tokenizer_keeps_the_engine(tmp_path: Path) -> None:
    base = _model(tmp_path / "base")
    tuned = _model(
        tmp_path / "tuned",
        {**CONFIG, "_name_or_path": "/elsewhere", "transformers_version": "5.0"},
        weights=b"other weights",
    )
    assert _key(base) == _key(tuned)  # the weights come by the verified swap


def test_another_shape_tokenizer_or_engine_dtype_rebuilds(tmp_path: Path) -> None:
    base = _key(_model(tmp_path / "base"))
    assert _key(_model(tmp_path / "wider", {**CONFIG, "hidden_size": 128})) != base
    assert _key(_model(tmp_path / "eos", {**CONFIG, "eos_token_id": 3})) != base  # generation stops elsewhere
    assert _key(_model(tmp_path / "tok", tokenizer='{"vocab": "abd"}')) != base
    assert _key(str(tmp_path / "base"), dtype="bfloat16") != base
    assert _key(str(tmp_path / "base"), lora=8) != base


def test_a_lora_job_keeps_the_engine_only_over_the_same_base_weights(tmp_path: Path) -> None:
    base = _model(tmp_path / "base")
    assert _key(base, lora=8) == _key(base, lora=8)
    assert _key(base, lora=8) != _key(_model(tmp_path / "other", weights=b"other weights"), lora=8)


def test_a_reward_file_edited_between_jobs_is_another_plug_in(tmp_path: Path) -> None:
    f = tmp_path / "rw.py"
    f.write_text("def score(completion, answer):\n    return 1.0\n")
    spec = PythonReward(function=f"{f}:score")
    first = scorer_key(spec)
    assert scorer_key(PythonReward(function=f"{f}:score")) == first
    assert scorer_key(PythonReward(function=f"{f}:score", kwargs={"k": 1})) != first
    f.write_text("def score(completion, answer):\n    return 0.0\n")
    assert scorer_key(spec) != first
    assert scorer_key("exact_match") == scorer_key("exact_match") != first
