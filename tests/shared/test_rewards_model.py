"""Kind `model`: a tiny LlamaForSequenceClassification (one label) built and saved here; the
scorer's batched, padded rewards equal a direct transformers forward pass over each text alone."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from asyncrl.tiny_model import build_tokenizer
from shared.rewards import RewardInput, RewardLoadError, build_scorer


def _save_reward_model(path, num_labels: int = 1):
    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        num_labels=num_labels,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def test_reward_model_scores_equal_a_direct_forward_pass(tmp_path):
    model, tok = _save_reward_model(tmp_path / "rm")
    items = [RewardInput(prompt="12+7=", completion=c, answer="19") for c in ("19", "20 then more", "", "x" * 40, "3")]
    with build_scorer(
        {"kind": "model", "path": str(tmp_path / "rm"), "batch_size": 2, "template": "{prompt}{completion}"}
    ) as scorer:
        results = scorer.score_sync(items)
    with torch.inference_mode():
        want = [float(model(**tok(it.prompt + it.completion, return_tensors="pt")).logits[0, 0]) for it in items]
    assert all(r.ok for r in results)
    assert [r.reward for r in results] == pytest.approx(want, abs=1e-5)
    assert len(set(want)) == len(want)  # distinct texts, distinct scores: the right token was read


def test_reward_model_that_cannot_serve_fails_at_build(tmp_path):
    with pytest.raises(RewardLoadError, match="no config.json"):
        build_scorer({"kind": "model", "path": str(tmp_path / "absent")})
    _save_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(RewardLoadError, match="has 2 labels; a reward model has 1"):
        build_scorer({"kind": "model", "path": str(tmp_path / "two")})
