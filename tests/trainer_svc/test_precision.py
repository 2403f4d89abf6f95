"""Precision (issue 17 item 1): the mismatch-KL estimator against hand-computed numbers; bfloat16
mixed precision (CPU autocast) against float32 on logprobs, loss and a Learner step, within stated
tolerances; the spec's knobs and the generator's probe tolerance."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shared.jobspec import AlgorithmSpec, GeneratorSpec, JobSpec  # noqa: E402
from trainer_svc.algorithms import mismatch_k3  # noqa: E402
from trainer_svc.logprobs import token_logprobs, token_logprobs_and_entropy  # noqa: E402
from trainer_svc.precision import autocast, mixed_precision_policy  # noqa: E402

# bfloat16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3) in the matmuls; on these
# tiny random models the logprobs move by ~1e-3 on average, a few 1e-3 at most. The bounds below
# leave ~10x room; a forward that ran fully in bfloat16 (no float32 logsumexp) or a cast missed
# in the chunked path shows larger gaps.
LOGPROB_MEAN_ATOL = 1e-2
LOGPROB_MAX_ATOL = 5e-2


def test_mismatch_k3_by_hand() -> None:
    # r = pi/mu per token: log r = log 2 -> (2 - 1) - log 2 = 0.30685; log r = -log 2 ->
    # (0.5 - 1) + log 2 = 0.19315; log r = 0 -> 0; the padded token (mask 0) -> 0 whatever its values.
    logp = torch.tensor([[math.log(0.2), math.log(0.05), -1.0], [-2.0, 5.0, 7.0]])
    mu = torch.tensor([[math.log(0.1), math.log(0.1), -1.0], [-2.0, -50.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    k3 = mismatch_k3(logp, mu, mask)
    want = torch.tensor([[1 - math.log(2), -0.5 + math.log(2), 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(k3, want, rtol=0, atol=1e-6)
    assert bool((k3 >= 0).all())  # KL estimates are never negative
    # a float32-sized gap: log r = -1e-4 -> k3 = expm1(x) - x = x^2/2 + x^3/6 + ... = 4.99983e-9; exp(x) - 1 - x
    # in float32 would give rounding noise of ~1e-8 instead
    tiny = mismatch_k3(torch.tensor([[-1e-4]]), torch.tensor([[0.0]]), torch.ones(1, 1))
    assert tiny.dtype == torch.float32 and float(tiny) == pytest.approx(5e-9 - 1e-12 / 6, rel=1e-5)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg).float().train()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 13), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0
    attn[2, 5:] = 0
    return ids, attn, torch.tensor([1.0, 0.7, 1.3])


def test_bf16_logprobs_within_tolerance_of_fp32() -> None:
    model = _model()
    ids, attn, temp = _batch()
    mask = attn[:, 1:].float()
    with torch.no_grad():
        fp32 = token_logprobs(model, ids, attn, temp)
        with autocast("cpu", "bfloat16")():
            bf16 = token_logprobs(model, ids, attn, temp)
            chunked = token_logprobs(model, ids, attn, temp, chunk_tokens=4)
    assert bf16.dtype == torch.float32  # the logprobs themselves are float32, from bfloat16 logits
    gap = (bf16 - fp32).abs() * mask
    assert gap.sum() / mask.sum() <= LOGPROB_MEAN_ATOL and gap.max() <= LOGPROB_MAX_ATOL
    assert gap.max() > 0  # autocast did change the numerics (the test would pass vacuously otherwise)
    torch.testing.assert_close(chunked, bf16, rtol=0, atol=1e-5)  # chunked path: same casts
    # the model's weights stay float32 (mixed precision, not a bfloat16 model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_bf16_gradients_float32_and_close_to_fp32_with_checkpointing() -> None:
    from trainer_svc.learner import enable_gradient_checkpointing

    ids, attn, temp = _batch()
    w = torch.linspace(-1, 1, 12).expand(3, 12)
    grads = {}
    for name, dtype, ckpt, chunk in (
        ("fp32", "float32", False, 0),
        ("bf16", "bfloat16", False, 0),
        ("bf16+ckpt", "bfloat16", True, 0),
        ("bf16+chunk", "bfloat16", False, 4),
    ):
        model = _model()
        if ckpt:
            assert enable_gradient_checkpointing(model)
        with autocast("cpu", dtype)():
            lp, ent = token_logprobs_and_entropy(model, ids, attn, temp, entropy_grad=True, chunk_tokens=chunk)
        ((lp * w).sum() + 0.3 * (ent * w).sum()).backward()  # backward outside autocast, as the learner does
        grads[name] = {n: p.grad for n, p in model.named_parameters()}

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:  # worst gap relative to the gradient's size
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))

    for n, g in grads["bf16"].items():
        assert g.dtype == torch.float32, n
        # measured 1.1e-2 at worst: bfloat16 matmuls in the forward and the backward
        assert rel(g, grads["fp32"][n]) <= 0.1, n
        # activation checkpointing recomputes under the original forward's autocast state: the same
        torch.testing.assert_close(grads["bf16+ckpt"][n], g, rtol=1e-5, atol=1e-7, msg=n)
        # chunking splits the head's bfloat16 matmuls differently: rounding only (measured 4e-3)
        assert rel(grads["bf16+chunk"][n], g) <= 2e-2, n


def test_learner_bf16_step_mixed_precision(tmp_path) -> None:
    """Two Learner steps in float32 and in bfloat16 (with a KL reference and the entropy bonus):
    weights and AdamW state stay float32, the loss and mismatch KL agree within tolerance, the
    weights move."""
    from asyncrl.tiny_model import build_tiny_model
    from tests.trainer_svc.test_distributed import GROUPS, MAX_TOKENS, N
    from tests.trainer_svc.test_distributed import _batch as dist_batch
    from trainer_svc.batch import TrainBatch
    from trainer_svc.learner import Learner

    model_dir = build_tiny_model(tmp_path / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    torch.set_num_threads(2)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        spec = JobSpec(
            model_path=str(model_dir),
            group_size=N,
            prompts_per_step=GROUPS,
            sampling={"max_tokens": MAX_TOKENS},
            algorithm={"lr": 1e-3, "micro_batch_size": 4, "entropy_coef": 0.01, "kl_coef": 0.05, "dtype": dtype},
        )
        torch.manual_seed(0)
        learner = Learner(spec, "cpu")
        before = {k: v.clone() for k, v in learner.model.state_dict().items()}
        samples, rewards = dist_batch(learner.model.config.vocab_size)
        metrics = [learner.step(TrainBatch.of(samples, rewards)) for _ in range(2)]
        after = learner.model.state_dict()
        assert {v.dtype for v in after.values()} == {torch.float32}
        state = [t for s in learner.optimizer.state.values() for t in s.values() if t.ndim > 0]
        assert state and {t.dtype for t in state} == {torch.float32}
        assert any(not torch.equal(before[k], after[k]) for k in before)
        runs[dtype] = metrics
    for m32, m16 in zip(runs["float32"], runs["bfloat16"], strict=True):
        # the behaviour logprobs here are arbitrary (-3..0), so mismatch_kl is large (~1) in both; the
        # precision changes it by the logprob gap's share only
        assert m16["mismatch_kl"] == pytest.approx(m32["mismatch_kl"], rel=2e-2)
        assert m16["loss"] == pytest.approx(m32["loss"], abs=2e-2)
        assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=5e-2)


def test_precision_knobs_in_the_spec() -> None:
    spec = JobSpec(model_path="/m")
    # a user's first run is float32 on both sides, as before
    assert spec.algorithm.dtype == "float32"
    assert (spec.generator.dtype, spec.generator.quantization) == (None, None)
    assert spec.generator.engine_dtype("float32") == "float32"
    assert GeneratorSpec(dtype="bfloat16").engine_dtype("float32") == "bfloat16"
    assert AlgorithmSpec(dtype="bfloat16").dtype == "bfloat16"
    assert GeneratorSpec(quantization="fp8").quantization == "fp8"
    for bad in (
        {"algorithm": {"dtype": "float16"}},
        {"algorithm": {"dtype": "fp8"}},
        {"generator": {"dtype": "int8"}},
        {"generator": {"quantization": "awq"}},
        {"generator": {"dtypes": "bfloat16"}},
    ):
        with pytest.raises(ValueError):
            JobSpec(model_path="/m", **bad)


def test_autocast_and_fsdp_policy_by_name() -> None:
    assert autocast("cpu", "float32")().__enter__() is None  # nullcontext: nothing changes
    with autocast("cpu", "bfloat16")():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="float32"):
        autocast("cpu", "float16")
    assert mixed_precision_policy("cpu", "bfloat16") is None  # CPU: autocast alone
    assert mixed_precision_policy("cuda:0", "float32") is None
    mp = mixed_precision_policy("cuda:0", "bfloat16")  # built without a GPU: a plain record
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_generator_probe_tolerance_follows_precision() -> None:
    from generator_svc.service import probe_atol

    assert probe_atol(1e-3, "float32", None) == 1e-3  # float32 engine: the setting as is
    assert probe_atol(1e-3, "bfloat16", None) == 0.1
    assert probe_atol(1e-3, "auto", None) == 0.1
    assert probe_atol(0.3, "bfloat16", None) == 0.3  # a looser setting is kept
    assert probe_atol(1e-3, "bfloat16", "fp8") == 0.5
