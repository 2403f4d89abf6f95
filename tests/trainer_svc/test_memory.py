"""Memory options (issue 17 item 3): chunked logprobs equal the unchunked ones in values and
gradients; activation checkpointing leaves loss and gradients unchanged; the spec's knobs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shared.jobspec import AlgorithmSpec  # noqa: E402
from trainer_svc.learner import enable_gradient_checkpointing  # noqa: E402
from trainer_svc.logprobs import token_logprobs, token_logprobs_and_entropy  # noqa: E402


def _model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
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
    attn[1, 9:] = 0  # right padding
    attn[2, 5:] = 0
    temp = torch.tensor([1.0, 0.7, 1.3])
    return ids, attn, temp


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, chunk: int, entropy: str):
    ids, attn, temp = _batch()
    model.zero_grad(set_to_none=True)
    w = torch.linspace(-1, 1, 12).expand(3, 12)  # an arbitrary weighting, so every position matters
    if entropy == "none":
        lp, ent = token_logprobs(model, ids, attn, temp, chunk_tokens=chunk), None
        loss = (lp * w).sum()
    else:
        lp, ent = token_logprobs_and_entropy(model, ids, attn, temp, entropy_grad=entropy == "grad", chunk_tokens=chunk)
        loss = (lp * w).sum() + (0.3 * ent * w).sum() if entropy == "grad" else (lp * w).sum()
    loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), _grads(model)


@pytest.mark.parametrize("entropy", ["none", "metric", "grad"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_logprobs_equal_unchunked(chunk: int, entropy: str) -> None:
    model = _model()
    lp0, ent0, g0 = _run(model, 0, entropy)
    lp1, ent1, g1 = _run(model, chunk, entropy)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-6)
    if ent0 is not None:
        assert ent1 is not None
        torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-6)
        assert not ent1.requires_grad or entropy == "grad"
    assert g0.keys() == g1.keys() and "lm_head.weight" in g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_without_grad_and_metric_entropy_detached() -> None:
    model = _model()
    ids, attn, temp = _batch()
    with torch.no_grad():
        ref = token_logprobs(model, ids, attn, 0.9)
        got = token_logprobs(model, ids, attn, 0.9, chunk_tokens=4)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    lp, ent = token_logprobs_and_entropy(model, ids, attn, temp, chunk_tokens=4)
    assert lp.requires_grad and not ent.requires_grad
    with pytest.raises(ValueError):
        token_logprobs(model, ids, attn, 1.0, chunk_tokens=-1)


def test_chunked_falls_back_when_logits_are_not_the_plain_head() -> None:
    model = _model()
    ids, attn, _ = _batch()
    orig = model.forward

    def scaled(*a, **kw):  # a model with a logit scale: the head alone would be wrong
        out = orig(*a, **kw)
        out.logits = out.logits * 2.0
        return out

    model.forward = scaled
    with torch.no_grad():
        torch.testing.assert_close(
            token_logprobs(model, ids, attn, chunk_tokens=4), token_logprobs(model, ids, attn), rtol=0, atol=1e-6
        )


def test_gradient_checkpointing_same_loss_and_grads() -> None:
    outs = []
    for on in (False, True):
        model = _model()
        if on:
            assert enable_gradient_checkpointing(model)
            assert model.is_gradient_checkpointing
        lp, ent, g = _run(model, 0, "grad")
        outs.append((lp, ent, g))
    (lp0, ent0, g0), (lp1, ent1, g1) = outs
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-6)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6, msg=name)


def test_memory_knobs_in_the_spec() -> None:
    a = AlgorithmSpec()
    assert (a.logprob_chunk_tokens, a.gradient_checkpointing, a.cpu_offload) == (0, False, False)
    b = AlgorithmSpec(logprob_chunk_tokens=256, gradient_checkpointing=True, cpu_offload=True)
    assert (b.logprob_chunk_tokens, b.gradient_checkpointing, b.cpu_offload) == (256, True, True)
    for bad in (
        {"logprob_chunk_tokens": -1},
        {"gradient_checkpointing": "maybe"},
        {"cpu_offload": 3},
        {"logprob_chunk_tokens": 1.5},
    ):
        with pytest.raises(ValueError):
            AlgorithmSpec(**bad)


def test_learner_step_same_with_the_memory_knobs(tmp_path) -> None:
    """One Learner step (the trainer's own path: micro-batches, loss, clip, AdamW) with chunked
    logprobs and activation checkpointing on equals the step with them off, with the entropy bonus
    and a KL reference (both chunked too)."""
    from asyncrl.tiny_model import build_tiny_model
    from shared.jobspec import JobSpec
    from tests.trainer_svc.test_distributed import GROUPS, MAX_TOKENS, N
    from tests.trainer_svc.test_distributed import _batch as dist_batch
    from trainer_svc.batch import TrainBatch
    from trainer_svc.learner import Learner

    model_dir = build_tiny_model(tmp_path / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    torch.set_num_threads(2)
    out = []
    for knobs in ({}, {"logprob_chunk_tokens": 3, "gradient_checkpointing": True}):
        spec = JobSpec(
            model_path=str(model_dir),
            group_size=N,
            prompts_per_step=GROUPS,
            sampling={"max_tokens": MAX_TOKENS},
            algorithm={"lr": 1e-3, "micro_batch_size": 4, "entropy_coef": 0.01, "kl_coef": 0.05, **knobs},
        )
        torch.manual_seed(0)
        learner = Learner(spec, "cpu")
        assert learner.model.is_gradient_checkpointing == bool(knobs)
        samples, rewards = dist_batch(learner.model.config.vocab_size)
        metrics = [learner.step(TrainBatch.of(samples, rewards)) for _ in range(2)]
        out.append((metrics, {k: v.clone() for k, v in learner.model.state_dict().items()}))
    (m0, w0), (m1, w1) = out
    for a, b in zip(m0, m1, strict=True):
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    # AdamW's first steps move every weight by about lr (1e-3) whatever the gradient's size, so
    # float rounding in near-zero gradients shows as ~1e-6 here: 1e-5 is 1 % of one step.
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=1e-5, atol=1e-5, msg=k)
