"""RL math checked four ways: hand-computed values, invariants, a slow reference, a real step."""

import math

import pytest
import torch

from trainer_svc.algorithms import (
    ADVANTAGE_ESTIMATORS,
    LOSSES,
    LossInputs,
    aipo_loss,
    grpo_advantages,
    is_fresh,
    lookup,
    staleness,
)


def test_grpo_hand_computed():
    # rewards 1,0,0,1: mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735
    # A = +-0.5 / 0.57735 = +-0.866025
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert torch.allclose(adv, torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025]]), atol=1e-5)


def test_grpo_invariants():
    torch.manual_seed(0)
    rewards = torch.rand(5, 8)
    adv = grpo_advantages(rewards)
    assert torch.allclose(adv.sum(dim=1), torch.zeros(5), atol=1e-5)  # each group sums to zero
    assert torch.allclose(adv.std(dim=1), torch.ones(5), atol=1e-3)  # and has unit std
    # a group with one reward value carries no signal
    assert torch.equal(grpo_advantages(torch.ones(2, 4)), torch.zeros(2, 4))
    # shifting and scaling a group's rewards does not change its advantages
    assert torch.allclose(grpo_advantages(3 * rewards + 7), adv, atol=1e-4)


def _two_token_inputs():
    # pi = (0.5, 0.25), mu = (0.25, 0.5): ratios 2.0 and 0.5
    lp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    beh = torch.log(torch.tensor([[0.25, 0.5]]))
    return lp, LossInputs(lp, beh, torch.tensor([2.0]), torch.ones(1, 2))


def test_aipo_truncation_hand_computed():
    lp, inp = _two_token_inputs()
    out = aipo_loss(inp, rho=1.5, num_tokens=2)
    # weights min(2, 1.5) = 1.5 and min(0.5, 1.5) = 0.5; A = 2
    # loss = -(1.5*2*log 0.5 + 0.5*2*log 0.25) / 2 = -(3 * -0.693147 + 1 * -1.386294) / 2 = 1.732868
    assert out.loss.item() == pytest.approx(1.732868, abs=1e-5)
    out.loss.backward()
    # d loss / d log pi_t = -w_t * A / num_tokens: the weight is a stop-gradient
    assert torch.allclose(lp.grad, torch.tensor([[-1.5, -0.5]]))
    assert out.metrics["is/truncated_sum"] == 1.0  # only the ratio 2 exceeded rho
    assert out.metrics["is/sum"] == pytest.approx(2.5)
    assert out.metrics["is/max"] == pytest.approx(2.0)
    # k3 mismatch KL per token (r - 1 - log r): (1 - log 2) + (-0.5 + log 2) = 0.5
    assert out.metrics["mismatch_kl/sum"] == pytest.approx(0.5, abs=1e-6)


def test_aipo_without_truncation_is_plain_importance_weighting():
    lp, inp = _two_token_inputs()
    out = aipo_loss(inp, rho=100.0, num_tokens=2)
    expected = -(2.0 * 2 * math.log(0.5) + 0.5 * 2 * math.log(0.25)) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-5)
    assert out.metrics["is/truncated_sum"] == 0.0


def test_aipo_on_policy_equals_reinforce():
    torch.manual_seed(1)
    lp = torch.randn(3, 5).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5, 2.0])
    out = aipo_loss(LossInputs(lp, lp.detach().clone(), adv, mask), rho=2.0, num_tokens=int(mask.sum()))
    reinforce = -(adv[:, None] * lp * mask).sum() / mask.sum()
    assert torch.allclose(out.loss, reinforce)


def _slow_aipo(lp, beh, adv, mask, rho, num_tokens):
    total = 0.0
    for b in range(len(lp)):
        for t in range(len(lp[b])):
            if mask[b][t]:
                w = min(math.exp(lp[b][t] - beh[b][t]), rho)
                total += -w * adv[b] * lp[b][t]
    return total / num_tokens


def test_aipo_matches_slow_reference_and_ignores_padding():
    torch.manual_seed(2)
    lp = torch.randn(4, 6) * 0.3 - 1.0
    beh = lp + torch.randn(4, 6) * 0.5
    mask = (torch.rand(4, 6) > 0.3).float()
    adv = torch.randn(4)
    n = int(mask.sum())
    out = aipo_loss(LossInputs(lp, beh, adv, mask), rho=1.3, num_tokens=n)
    assert out.loss.item() == pytest.approx(_slow_aipo(lp.tolist(), beh.tolist(), adv.tolist(), mask.tolist(), 1.3, n), abs=1e-5)
    # garbage in padded positions changes nothing
    lp2 = torch.where(mask.bool(), lp, torch.full_like(lp, 123.0))
    beh2 = torch.where(mask.bool(), beh, torch.full_like(beh, -77.0))
    assert aipo_loss(LossInputs(lp2, beh2, adv, mask), rho=1.3, num_tokens=n).loss.item() == pytest.approx(out.loss.item(), abs=1e-5)


def test_token_mean_is_independent_of_micro_batching():
    torch.manual_seed(3)
    lp_full = (torch.randn(8, 5) * 0.2 - 1.0).requires_grad_(True)
    beh = lp_full.detach() + torch.randn(8, 5) * 0.3
    mask = (torch.rand(8, 5) > 0.2).float()
    adv = torch.randn(8)
    n = int(mask.sum())
    aipo_loss(LossInputs(lp_full, beh, adv, mask), rho=1.5, num_tokens=n).loss.backward()
    full_grad = lp_full.grad.clone()
    lp_mb = lp_full.detach().clone().requires_grad_(True)
    for lo in range(0, 8, 2):  # 4 micro-batches, each divided by the global token count
        sl = slice(lo, lo + 2)
        aipo_loss(LossInputs(lp_mb[sl], beh[sl], adv[sl], mask[sl]), rho=1.5, num_tokens=n).loss.backward()
    assert torch.allclose(lp_mb.grad, full_grad, atol=1e-6)


def test_staleness_filter():
    assert staleness(5, 3) == 2
    assert is_fresh(5, 3, 2) and not is_fresh(5, 2, 2)
    assert is_fresh(5, 5, 0) and not is_fresh(5, 4, 0)  # sync mode keeps only on-policy samples


def test_registry_lookup_lists_valid_names():
    assert lookup(ADVANTAGE_ESTIMATORS, "grpo", "advantage estimator") is grpo_advantages
    assert lookup(LOSSES, "aipo", "loss") is aipo_loss
    with pytest.raises(ValueError, match=r"unknown loss 'ppo'; valid: \['aipo'\]"):
        lookup(LOSSES, "ppo", "loss")


def test_one_training_step_moves_the_tiny_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer_svc.logprobs import pad_batch, token_logprobs
    from trainer_svc.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "m", layers=1, hidden=32, heads=2, intermediate=64, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts, comps = [[1, 10, 11], [1, 12]], [[20, 21, 2], [22, 2]]
    ids, attn, mask = pad_batch(prompts, comps, pad_id=0)
    with torch.no_grad():
        beh = token_logprobs(model, ids, attn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lp = token_logprobs(model, ids, attn)
    out = aipo_loss(LossInputs(lp, beh, torch.tensor([1.0, -1.0]), mask), rho=2.0, num_tokens=int(mask.sum()))
    out.loss.backward()
    opt.step()
    assert math.isfinite(out.loss.item())
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(moved) >= len(before) // 2, moved
    with torch.no_grad():  # the positive-advantage completion became more likely
        after = token_logprobs(model, ids, attn)
    assert ((after - beh) * mask)[0].sum() > 0 > ((after - beh) * mask)[1].sum()
