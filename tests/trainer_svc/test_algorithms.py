"""RL math checked four ways: hand-computed values, invariants, a slow reference, a real step."""

import itertools
import math
import typing

import pytest
import torch

from shared import jobspec
from trainer_svc.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    LOSSES,
    LR_DECAYS,
    BatchNorm,
    LossConfig,
    LossInputs,
    LrSchedule,
    accumulate,
    aggregate,
    aipo_loss,
    finalize_metrics,
    group_mean_advantages,
    grpo_advantages,
    is_fresh,
    lookup,
    lr_at,
    lr_factor,
    policy_loss,
    rloo_advantages,
    staleness,
)

LOSS_NAMES = sorted(LOSSES)
AGG_NAMES = sorted(AGGREGATIONS)


def _norm(mask: torch.Tensor, max_len: int | None = None) -> BatchNorm:
    return BatchNorm.from_lengths(mask.sum(dim=1).long().tolist(), max_len or mask.shape[1])


# --- advantages ---------------------------------------------------------------------------------


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


def test_group_mean_and_rloo_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # group mean 0.5: A = r - 0.5
    assert torch.allclose(group_mean_advantages(r), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    # leave-one-out: A_0 = 1 - (0 + 0 + 1)/3 = 2/3; A_1 = 0 - (1 + 0 + 1)/3 = -2/3
    assert torch.allclose(rloo_advantages(r), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(torch.ones(3, 1))


def test_group_mean_and_rloo_invariants():
    torch.manual_seed(0)
    rewards = torch.rand(5, 8)
    for fn in (group_mean_advantages, rloo_advantages):
        adv = fn(rewards)
        assert torch.allclose(adv.sum(dim=1), torch.zeros(5), atol=1e-5)  # zero-sum per group
        assert torch.allclose(fn(rewards + 7), adv, atol=1e-5)  # a constant shift cancels
        assert torch.equal(fn(torch.ones(2, 4)), torch.zeros(2, 4))  # no signal, no update
    # RLOO is the group-mean advantage scaled by n / (n - 1) (Ahmadian et al. 2024)
    assert torch.allclose(rloo_advantages(rewards), group_mean_advantages(rewards) * 8 / 7, atol=1e-6)


# --- aipo (hand-computed) -----------------------------------------------------------------------


def _two_token_inputs():
    # pi = (0.5, 0.25), mu = (0.25, 0.5): ratios 2.0 and 0.5
    lp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    beh = torch.log(torch.tensor([[0.25, 0.5]]))
    return lp, LossInputs(lp, beh, torch.tensor([2.0]), torch.ones(1, 2))


def _aipo(inp, rho, num_tokens):
    norm = BatchNorm(num_tokens=num_tokens, num_seqs=inp.mask.shape[0], max_len=inp.mask.shape[1])
    return policy_loss(inp, LossConfig(loss="aipo", aggregation="token-mean", rho=rho), norm)


def test_aipo_truncation_hand_computed():
    lp, inp = _two_token_inputs()
    out = _aipo(inp, rho=1.5, num_tokens=2)
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
    # per step: is/mean 2.5/2; truncated 1 of 2 tokens; ESS = 2.5^2 / (2 * (4 + 0.25)) = 0.735294
    m = finalize_metrics(out.metrics, BatchNorm(num_tokens=2, num_seqs=1, max_len=2))
    assert m["is/mean"] == pytest.approx(1.25)
    assert m["is/truncated_frac"] == pytest.approx(0.5)
    assert m["is/ess"] == pytest.approx(0.735294, abs=1e-6)
    assert m["mismatch_kl"] == pytest.approx(0.25, abs=1e-6)
    assert m["loss"] == pytest.approx(1.732868, abs=1e-5)
    # the applied weights are the truncated 1.5 and 0.5: ESS = 2^2 / (2 * (2.25 + 0.25)) = 0.8
    assert m["is/applied_ess"] == pytest.approx(0.8)
    assert m["is/applied_max"] == pytest.approx(1.5)


def test_aipo_without_truncation_is_plain_importance_weighting():
    lp, inp = _two_token_inputs()
    out = _aipo(inp, rho=100.0, num_tokens=2)
    expected = -(2.0 * 2 * math.log(0.5) + 0.5 * 2 * math.log(0.25)) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-5)
    assert out.metrics["is/truncated_sum"] == 0.0


def test_aipo_on_policy_equals_reinforce():
    torch.manual_seed(1)
    lp = torch.randn(3, 5).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5, 2.0])
    out = _aipo(LossInputs(lp, lp.detach().clone(), adv, mask), rho=2.0, num_tokens=int(mask.sum()))
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
    out = _aipo(LossInputs(lp, beh, adv, mask), rho=1.3, num_tokens=n)
    assert out.loss.item() == pytest.approx(
        _slow_aipo(lp.tolist(), beh.tolist(), adv.tolist(), mask.tolist(), 1.3, n), abs=1e-5
    )
    # garbage in padded positions changes nothing
    lp2 = torch.where(mask.bool(), lp, torch.full_like(lp, 123.0))
    beh2 = torch.where(mask.bool(), beh, torch.full_like(beh, -77.0))
    assert _aipo(LossInputs(lp2, beh2, adv, mask), rho=1.3, num_tokens=n).loss.item() == pytest.approx(
        out.loss.item(), abs=1e-5
    )


def test_token_mean_is_independent_of_micro_batching():
    torch.manual_seed(3)
    lp_full = (torch.randn(8, 5) * 0.2 - 1.0).requires_grad_(True)
    beh = lp_full.detach() + torch.randn(8, 5) * 0.3
    mask = (torch.rand(8, 5) > 0.2).float()
    adv = torch.randn(8)
    n = int(mask.sum())
    _aipo(LossInputs(lp_full, beh, adv, mask), rho=1.5, num_tokens=n).loss.backward()
    full_grad = lp_full.grad.clone()
    lp_mb = lp_full.detach().clone().requires_grad_(True)
    for lo in range(0, 8, 2):  # 4 micro-batches, each divided by the global token count
        sl = slice(lo, lo + 2)
        _aipo(LossInputs(lp_mb[sl], beh[sl], adv[sl], mask[sl]), rho=1.5, num_tokens=n).loss.backward()
    assert torch.allclose(lp_mb.grad, full_grad, atol=1e-6)


# --- ppo_clip, gspo, KL (hand-computed) ---------------------------------------------------------


def _with_ratios(ratios, adv, lengths=None):
    """Inputs whose token ratios pi/mu are `ratios` (B, T); mu = 0.4 everywhere."""
    r = torch.tensor(ratios, dtype=torch.float64)
    beh = torch.full_like(r, math.log(0.4))
    lp = (beh + torch.log(r)).requires_grad_(True)
    mask = (
        torch.ones_like(r) if lengths is None else (torch.arange(r.shape[1]) < torch.tensor(lengths)[:, None]).double()
    )
    return lp, LossInputs(lp, beh, torch.tensor(adv, dtype=torch.float64), mask)


def test_ppo_clip_hand_computed():
    # clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28]; token ratios 1.5 (above) and 0.5 (below)
    lp, inp = _with_ratios([[1.5, 0.5], [1.5, 0.5]], adv=[1.0, -1.0])
    cfg = LossConfig(loss="ppo_clip", clip_low=0.2, clip_high=0.28)
    out = policy_loss(inp, cfg, _norm(inp.mask))
    # A=+1, r=1.5: -min(1.5, 1.28) = -1.28  (clip active: gradient 0)
    # A=+1, r=0.5: -min(0.5, 0.8)  = -0.5   (gradient d(-r)/dlog pi = -r = -0.5)
    # A=-1, r=1.5: -min(-1.5, -1.28) = 1.5  (gradient +r = 1.5)
    # A=-1, r=0.5: -min(-0.5, -0.8)  = 0.8  (clip active: gradient 0)
    # token-mean over 4 tokens: (-1.28 - 0.5 + 1.5 + 0.8) / 4 = 0.13
    assert out.loss.item() == pytest.approx(0.13, abs=1e-9)
    out.loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -0.125], [0.375, 0.0]], dtype=torch.float64))
    assert out.metrics["is/truncated_sum"] == 2.0
    m = finalize_metrics(out.metrics, _norm(inp.mask))
    assert m["is/truncated_frac"] == 0.5
    # applied weights (the gradient's -r on each unclipped token): 0, 0.5, 1.5, 0
    # ESS = (0.5 + 1.5)^2 / (4 * (0.25 + 2.25)) = 4 / 10 = 0.4; max 1.5
    assert m["is/applied_ess"] == pytest.approx(0.4)
    assert m["is/applied_max"] == pytest.approx(1.5)


def test_gspo_hand_computed_on_sequences_of_different_lengths():
    # seq 0 has 3 tokens with log-ratios 0.3, -0.1, 0.1 -> s_0 = exp(0.3/3) = exp(0.1) = 1.105171
    # seq 1 has 1 token with log-ratio -0.2 -> s_1 = exp(-0.2) = 0.818731; both advantages -1
    lp, inp = _with_ratios(
        [[math.exp(0.3), math.exp(-0.1), math.exp(0.1)], [math.exp(-0.2), 7.0, 7.0]],
        adv=[-1.0, -1.0],
        lengths=[3, 1],
    )
    cfg = LossConfig(loss="gspo", aggregation="seq-mean-token-mean", gspo_clip_low=0.1, gspo_clip_high=0.05)
    out = policy_loss(inp, cfg, _norm(inp.mask))
    # clip range [0.9, 1.05]
    # seq 0: -min(-1.105171, -1.05) = 1.105171, not clipped (A < 0 only clips below)
    # seq 1: -min(-0.818731, -0.9) = 0.9, clipped -> no gradient
    # seq-mean-token-mean = mean of the sequence losses = (1.105171 + 0.9) / 2 = 1.002585
    assert out.loss.item() == pytest.approx((math.exp(0.1) + 0.9) / 2, abs=1e-9)
    out.loss.backward()
    # d loss_0 / d log pi_t = s_0 / |y_0| = 1.105171 / 3, then / 2 sequences = 0.184195 per token
    g0 = math.exp(0.1) / 3 / 2
    assert torch.allclose(lp.grad, torch.tensor([[g0, g0, g0], [0.0, 0.0, 0.0]], dtype=torch.float64))
    m = finalize_metrics(out.metrics, _norm(inp.mask))
    assert m["is/truncated_frac"] == 0.5  # 1 of 2 seqs
    # applied per sequence: s_0 = 1.105171 and 0 (clipped): ESS = s_0^2 / (2 * s_0^2) = 0.5
    assert m["is/applied_ess"] == pytest.approx(0.5)
    assert m["is/applied_max"] == pytest.approx(math.exp(0.1))
    # token-mean weights each sequence by its length: (3 * 1.105171 + 1 * 0.9) / 4
    tm = policy_loss(inp, LossConfig(loss="gspo", gspo_clip_low=0.1, gspo_clip_high=0.05), _norm(inp.mask))
    assert tm.loss.item() == pytest.approx((3 * math.exp(0.1) + 0.9) / 4, abs=1e-9)


def test_kl_to_reference_hand_computed():
    # on-policy aipo with A = 0: only the KL term remains
    lp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    inp = LossInputs(
        lp,
        lp.detach().clone(),
        torch.zeros(1, dtype=torch.float64),
        torch.ones(1, 1),
        ref_logprobs=ref,
    )
    out = policy_loss(inp, LossConfig(loss="aipo", kl_coef=0.1), BatchNorm(1, 1, 1))
    # d = ref - logp = log(0.25/0.5) = -log 2; k3 = e^d - d - 1 = 0.5 + log 2 - 1 = 0.193147
    k3 = 0.5 + math.log(2) - 1
    assert out.loss.item() == pytest.approx(0.1 * k3, abs=1e-12)
    out.loss.backward()
    # d k3 / d logp = -e^d + 1 = 0.5, times kl_coef
    assert lp.grad.item() == pytest.approx(0.05, abs=1e-12)
    assert finalize_metrics(out.metrics, BatchNorm(1, 1, 1))["kl_ref"] == pytest.approx(k3, abs=1e-12)
    # kl_coef = 0 still reports kl_ref but adds nothing to the loss
    off = policy_loss(inp, LossConfig(loss="aipo"), BatchNorm(1, 1, 1))
    assert off.loss.item() == 0.0 and off.metrics["kl_ref/sum"] == pytest.approx(k3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(
            LossInputs(lp, lp.detach(), inp.advantages, inp.mask),
            LossConfig(kl_coef=0.1),
            BatchNorm(1, 1, 1),
        )


def test_aggregations_hand_computed():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    norm = BatchNorm(num_tokens=4, num_seqs=2, max_len=8)

    def agg(mode):
        return aggregate(per_token, mask, mode, norm).item()

    assert agg("token-mean") == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert agg("seq-mean-token-mean") == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert agg("seq-mean-token-sum-norm") == pytest.approx(10 / (8 * 2))
    # an empty sequence adds 0 (not 0/0) and still counts in num_seqs
    empty = torch.zeros(1, 3)
    n3 = BatchNorm(num_tokens=4, num_seqs=3, max_len=8)
    assert aggregate(
        torch.cat([per_token, empty]), torch.cat([mask, empty]), "seq-mean-token-mean", n3
    ).item() == pytest.approx(6 / 3)
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        aggregate(per_token, mask, "mean", norm)


# --- invariants ---------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_on_policy_gradient_equals_reinforce(loss):
    torch.manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    # GSPO's objective is sequence-level: on-policy it is REINFORCE with per-sequence token means
    agg = "seq-mean-token-mean" if loss == "gspo" else "token-mean"
    lp = torch.randn(3, 5, dtype=torch.float64).requires_grad_(True)
    out = policy_loss(
        LossInputs(lp, lp.detach().clone(), adv, mask),
        LossConfig(loss=loss, aggregation=agg),
        _norm(mask),
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    lp2 = lp.detach().clone().requires_grad_(True)
    reinforce = aggregate(-adv[:, None] * lp2, mask, agg, _norm(mask))
    (expected,) = torch.autograd.grad(reinforce, lp2)
    assert torch.allclose(grad, expected, atol=1e-12)


def test_ess_equal_weights_is_one_and_one_dominant_weight_is_about_one_over_n():
    lp = torch.full((2, 4), -1.0)
    mask = torch.ones(2, 4)
    norm = _norm(mask)
    equal = policy_loss(LossInputs(lp, lp - 0.7, torch.ones(2), mask), LossConfig(), norm)
    assert finalize_metrics(equal.metrics, norm)["is/ess"] == pytest.approx(1.0)
    beh = lp.clone()
    beh[1, 2] -= math.log(1e4)  # one token's weight is 1e4, the other seven 1
    dominant = finalize_metrics(policy_loss(LossInputs(lp, beh, torch.ones(2), mask), LossConfig(), norm).metrics, norm)
    # (1e4 + 7)^2 / (8 * (1e8 + 7)) = 0.12518
    assert dominant["is/ess"] == pytest.approx(1 / 8, rel=2e-3)
    assert dominant["is/max"] == pytest.approx(1e4, rel=1e-4)
    # AIPO (rho 2) applies min(1e4, 2) = 2 to that token: (2 + 7)^2 / (8 * (4 + 7)) = 81 / 88
    assert dominant["is/applied_ess"] == pytest.approx(81 / 88)
    assert dominant["is/applied_max"] == pytest.approx(2.0)


def test_applied_weights_of_a_batch_with_one_wild_raw_ratio():
    # the healthy AIPO batch: 320 tokens on-policy but one with pi/mu = 148 (raw ESS
    # (319 + 148)^2 / (320 * (319 + 148^2)) = 218089 / 7111360 = 0.0307, under min_ess 0.05);
    # the weights AIPO applies are 1 x 319 and min(148, 2) = 2: (319 + 2)^2 / (320 * (319 + 4))
    # = 103041 / 103360 = 0.99691
    lp = torch.full((64, 5), -1.0)
    beh = lp.clone()
    beh[3, 1] -= math.log(148.0)
    mask, norm = torch.ones(64, 5), _norm(torch.ones(64, 5))
    m = finalize_metrics(policy_loss(LossInputs(lp, beh, torch.ones(64), mask), LossConfig(), norm).metrics, norm)
    assert m["is/max"] == pytest.approx(148.0, rel=1e-6)
    assert m["is/ess"] == pytest.approx(218089 / 7111360, rel=1e-5)
    assert m["is/applied_ess"] == pytest.approx(103041 / 103360, rel=1e-6)
    assert m["is/applied_max"] == pytest.approx(2.0)
    # REINFORCE applies weight 1 everywhere, whatever the ratios
    r = finalize_metrics(
        policy_loss(LossInputs(lp, beh, torch.ones(64), mask), LossConfig(loss="reinforce"), norm).metrics, norm
    )
    assert (r["is/applied_ess"], r["is/applied_max"]) == (1.0, 1.0)


def test_metrics_across_micro_batches_equal_metrics_at_once():
    torch.manual_seed(5)
    lp = torch.randn(8, 6) * 0.3 - 1.0
    beh = lp + torch.randn(8, 6) * 0.4
    ref = lp + torch.randn(8, 6) * 0.2
    ent = torch.rand(8, 6) * 3
    mask = (torch.arange(6) < torch.tensor([1, 6, 3, 2, 5, 6, 4, 2])[:, None]).float()
    adv = torch.randn(8)
    norm = _norm(mask)
    for loss in LOSS_NAMES:
        cfg = LossConfig(loss=loss, kl_coef=0.05)
        at_once = finalize_metrics(policy_loss(LossInputs(lp, beh, adv, mask, ref, ent), cfg, norm).metrics, norm)
        sums: dict[str, float] = {}
        for lo in range(0, 8, 2):
            sl = slice(lo, lo + 2)
            out = policy_loss(LossInputs(lp[sl], beh[sl], adv[sl], mask[sl], ref[sl], ent[sl]), cfg, norm)
            sums = accumulate(sums, out.metrics)
        split = finalize_metrics(sums, norm)
        assert (
            set(split)
            == set(at_once)
            == {
                "loss",
                "is/mean",
                "is/max",
                "is/truncated_frac",
                "is/ess",
                "is/applied_ess",
                "is/applied_max",
                "mismatch_kl",
                "kl_ref",
                "entropy",
            }
        )
        for key in at_once:
            assert split[key] == pytest.approx(at_once[key], rel=1e-5, abs=1e-7), (loss, key)
        assert 0 < split["is/ess"] < 1
        assert split["entropy"] == pytest.approx(float((ent * mask).sum() / mask.sum()), rel=1e-6)


def test_accumulate_sums_and_maxes_by_key():
    got = accumulate(accumulate({}, {"is/sum": 1.0, "is/max": 3.0}), {"is/sum": 2.0, "is/max": 2.0, "x": 1.0})
    assert got == {"is/sum": 3.0, "is/max": 3.0, "x": 1.0}


# --- slow per-token reference vs the vectorised version -----------------------------------------


def _slow_per_token(loss, lp, beh, adv, lengths, cfg):
    """Per-token losses as nested lists of 0-dim tensors (grad through lp), written case by case."""
    rows = []
    for b, n in enumerate(lengths):
        a = float(adv[b])
        if loss == "aipo":
            rows.append([-min(math.exp((lp[b, t] - beh[b, t]).item()), cfg.rho) * a * lp[b, t] for t in range(n)])
        elif loss == "reinforce":
            rows.append([-a * lp[b, t] for t in range(n)])
        elif loss == "ppo_clip":
            row = []
            for t in range(n):
                r = torch.exp(lp[b, t] - beh[b, t])
                if a > 0 and r.item() > 1 + cfg.clip_high:
                    row.append(torch.tensor(-(1 + cfg.clip_high) * a, dtype=lp.dtype))  # constant
                elif a < 0 and r.item() < 1 - cfg.clip_low:
                    row.append(torch.tensor(-(1 - cfg.clip_low) * a, dtype=lp.dtype))
                else:
                    row.append(-r * a)
            rows.append(row)
        else:  # gspo
            log_s = sum(lp[b, t] - beh[b, t] for t in range(n)) / max(n, 1)
            s = torch.exp(torch.as_tensor(log_s, dtype=lp.dtype))
            if a > 0 and s.item() > 1 + cfg.gspo_clip_high:
                li = torch.tensor(-(1 + cfg.gspo_clip_high) * a, dtype=lp.dtype)
            elif a < 0 and s.item() < 1 - cfg.gspo_clip_low:
                li = torch.tensor(-(1 - cfg.gspo_clip_low) * a, dtype=lp.dtype)
            else:
                li = -s * a
            rows.append([li] * n)
    return rows


def _slow_aggregate(rows, mode, max_len):
    if mode == "token-mean":
        return sum(x for row in rows for x in row) / sum(len(row) for row in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / max(len(row), 1) for row in rows) / len(rows)
    return sum(x for row in rows for x in row) / (max_len * len(rows))


def _random_batch(seed, b=8, t=7, lengths=(3, 7, 1, 5, 2, 6, 4, 7)):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3 - 1.0
    beh = lp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    ref = lp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).double()
    return lp, beh, ref, adv, mask, list(lengths)


# clip ranges wide enough that the random batch has both clipped and unclipped tokens/sequences
_CFG = {
    "rho": 1.2,
    "clip_low": 0.2,
    "clip_high": 0.28,
    "gspo_clip_low": 0.05,
    "gspo_clip_high": 0.05,
}


@pytest.mark.parametrize("loss,agg", list(itertools.product(LOSS_NAMES, AGG_NAMES)))
def test_matches_slow_reference(loss, agg):
    lp, beh, ref, adv, mask, lengths = _random_batch(seed=7)
    cfg = LossConfig(loss=loss, aggregation=agg, kl_coef=0.1, **_CFG)
    max_len = 10
    lp1 = lp.clone().requires_grad_(True)
    out = policy_loss(LossInputs(lp1, beh, adv, mask, ref_logprobs=ref), cfg, _norm(mask, max_len))
    (grad,) = torch.autograd.grad(out.loss, lp1)
    if loss != "reinforce":  # reinforce never truncates
        assert out.metrics["is/truncated_sum" if loss != "gspo" else "is/truncated_seq_sum"] > 0

    lp2 = lp.clone().requires_grad_(True)
    rows = _slow_per_token(loss, lp2, beh, adv, lengths, cfg)
    for b, row in enumerate(rows):
        for t in range(len(row)):
            d = ref[b, t] - lp2[b, t]
            row[t] = row[t] + 0.1 * (torch.exp(d) - d - 1)
    slow = _slow_aggregate(rows, agg, max_len)
    (slow_grad,) = torch.autograd.grad(slow, lp2)
    assert out.loss.item() == pytest.approx(slow.item(), abs=1e-10)
    assert torch.allclose(grad, slow_grad, atol=1e-10)
    assert grad.abs().sum() > 0


# --- micro-batch invariance for every (loss, aggregation) ---------------------------------------


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("loss,agg", list(itertools.product(LOSS_NAMES, AGG_NAMES)))
def test_gradient_is_independent_of_micro_batching(loss, agg, kl_coef):
    lp, beh, ref, adv, mask, lengths = _random_batch(seed=11)
    cfg = LossConfig(loss=loss, aggregation=agg, kl_coef=kl_coef, **_CFG)
    norm = BatchNorm.from_lengths(lengths, max_len=16)

    whole = lp.clone().requires_grad_(True)
    policy_loss(LossInputs(whole, beh, adv, mask, ref), cfg, norm).loss.backward()

    split = lp.clone().requires_grad_(True)
    total = 0.0
    for lo in range(0, 8, 2):  # 4 micro-batches, each padded only to its own longest sequence
        sl = slice(lo, lo + 2)
        width = max(lengths[sl])
        out = policy_loss(
            LossInputs(split[sl, :width], beh[sl, :width], adv[sl], mask[sl, :width], ref[sl, :width]),
            cfg,
            norm,
        )
        out.loss.backward()
        total += out.loss.item()
    assert whole.grad.abs().sum() > 0
    assert torch.allclose(split.grad, whole.grad, atol=1e-12)
    assert total == pytest.approx(policy_loss(LossInputs(lp, beh, adv, mask, ref), cfg, norm).loss.item(), abs=1e-12)


# --- config, registries, staleness --------------------------------------------------------------


def test_staleness_filter():
    assert staleness(5, 3) == 2
    assert is_fresh(5, 3, 2) and not is_fresh(5, 2, 2)
    assert is_fresh(5, 5, 0) and not is_fresh(5, 4, 0)  # sync mode keeps only on-policy samples


def test_registry_lookup_lists_valid_names():
    assert lookup(ADVANTAGE_ESTIMATORS, "grpo", "advantage estimator") is grpo_advantages
    assert lookup(LOSSES, "aipo", "loss") is aipo_loss
    with pytest.raises(ValueError, match=r"unknown loss 'ppo'; valid: \['aipo', 'gspo', 'ppo_clip', 'reinforce'\]"):
        lookup(LOSSES, "ppo", "loss")


def test_registries_match_the_job_spec_names():
    assert set(ADVANTAGE_ESTIMATORS) == set(typing.get_args(jobspec.Advantage))
    assert set(LOSSES) == set(typing.get_args(jobspec.Loss))
    assert set(AGGREGATIONS) == set(typing.get_args(jobspec.Aggregation))
    assert set(LR_DECAYS) == set(typing.get_args(jobspec.LrScheduleName))


def test_loss_config_from_spec_and_unknown_names():
    spec = jobspec.AlgorithmSpec(loss="gspo", aggregation="seq-mean-token-mean", rho=3.0, kl_coef=0.01)
    cfg = LossConfig.from_spec(spec)
    assert cfg == LossConfig(
        loss="gspo",
        aggregation="seq-mean-token-mean",
        rho=3.0,
        clip_low=spec.clip_low,
        clip_high=spec.clip_high,
        gspo_clip_low=spec.gspo_clip_low,
        gspo_clip_high=spec.gspo_clip_high,
        kl_coef=0.01,
        entropy_coef=0.0,
    )
    assert LossConfig.from_spec(jobspec.AlgorithmSpec(entropy_coef=0.05)).entropy_coef == 0.05
    # the dataclass defaults are the job spec's defaults
    assert LossConfig.from_spec(jobspec.AlgorithmSpec()) == LossConfig()
    with pytest.raises(ValueError, match=r"unknown loss 'ppo'; valid: \['aipo', 'gspo', 'ppo_clip', 'reinforce'\]"):
        LossConfig(loss="ppo")
    with pytest.raises(ValueError, match="unknown aggregation"):
        LossConfig(aggregation="sum")


# --- learning-rate schedule ---------------------------------------------------------------------


def _sched(name, warmup=2, steps=6, min_ratio=0.1, lr=1e-3):
    return LrSchedule(lr=lr, name=name, warmup_steps=warmup, min_lr_ratio=min_ratio, steps=steps)


# Warm-up W = 2 then decay over S = 6 steps to min 0.1: steps 1, 2 at 1/2, 1; then p = (t - 2) / 4.
#   linear: 1 - 0.9 p                       -> t=3..6: 0.775, 0.55, 0.325, 0.1
#   cosine: 1 - 0.9 (1 - cos(pi p)) / 2     -> t=3: 1 - 0.9 (1 - 0.70711) / 2 = 0.86820
#           t=4: 1 - 0.9 / 2 = 0.55;  t=5: 1 - 0.9 (1 + 0.70711) / 2 = 0.23180;  t=6: 0.1
# Step 7 is past the end: the minimum (p is clamped at 1).
@pytest.mark.parametrize(
    "name,factors",
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]),
        ("cosine", [0.5, 1.0, 0.868198, 0.55, 0.231802, 0.1, 0.1]),
    ],
)
def test_lr_schedules_hand_computed(name, factors):
    sched = _sched(name)
    got = [lr_at(t, sched) for t in range(1, 8)]
    assert got == pytest.approx([1e-3 * f for f in factors], rel=1e-5)
    assert [lr_factor(t, sched) for t in range(1, 8)] == pytest.approx(factors, rel=1e-5)


def test_lr_schedule_without_warmup_and_to_zero():
    # W = 0, S = 4, min 0: p = t / 4 from the first step; cosine (1 + cos(pi t / 4)) / 2
    cosine = _sched("cosine", warmup=0, steps=4, min_ratio=0.0)
    assert [lr_factor(t, cosine) for t in range(1, 5)] == pytest.approx([0.853553, 0.5, 0.146447, 0.0], abs=1e-6)
    linear = _sched("linear", warmup=0, steps=4, min_ratio=0.0)
    assert [lr_factor(t, linear) for t in range(1, 5)] == pytest.approx([0.75, 0.5, 0.25, 0.0])
    # a warm-up as long as the job: every step ramps, the last one at the peak
    ramp = _sched("cosine", warmup=4, steps=4)
    assert [lr_factor(t, ramp) for t in range(1, 5)] == [0.25, 0.5, 0.75, 1.0]


def test_a_constant_schedule_trains_at_lr_bit_for_bit_and_the_default_decays_to_zero():
    spec = jobspec.JobSpec(model_path="/m", steps=10, algorithm={"lr": 3e-6, "lr_schedule": "constant"})
    sched = LrSchedule.from_spec(spec)
    assert sched == LrSchedule(lr=3e-6, steps=10)  # the dataclass's own defaults: constant
    assert all(lr_at(t, sched) == 3e-6 for t in range(1, 12))  # exactly, past the end too
    # a spec with only lr: linear from lr to 0 at the last step (TRL's default), lr x (1 - t / 10)
    only_lr = LrSchedule.from_spec(jobspec.JobSpec(model_path="/m", steps=10, algorithm={"lr": 3e-6}))
    assert only_lr == LrSchedule(lr=3e-6, name="linear", steps=10)
    assert [lr_at(t, only_lr) for t in (1, 5, 10)] == pytest.approx([2.7e-6, 1.5e-6, 0.0])
    warm = LrSchedule.from_spec(
        jobspec.JobSpec(
            model_path="/m",
            steps=10,
            algorithm={"lr": 1e-4, "lr_schedule": "linear", "warmup_steps": 3, "min_lr_ratio": 0.5},
        )
    )
    assert warm == LrSchedule(lr=1e-4, name="linear", warmup_steps=3, min_lr_ratio=0.5, steps=10)


def test_lr_schedule_refuses_unknown_names_and_a_warmup_past_the_end():
    with pytest.raises(ValueError, match=r"unknown lr schedule 'step'; valid: \['constant', 'cosine', 'linear'\]"):
        LrSchedule(name="step")
    with pytest.raises(ValueError, match="warmup_steps must lie in 0..steps"):
        LrSchedule(warmup_steps=5, steps=4)
    with pytest.raises(ValueError, match=r"warmup_steps \(5\) must not exceed steps \(4\)"):
        jobspec.JobSpec(model_path="/m", steps=4, algorithm={"warmup_steps": 5})


# --- the entropy bonus --------------------------------------------------------------------------


def _two_token_entropy_inputs(entropy_grad: bool):
    """One sample, two completion tokens over a vocabulary of 2, advantage 0 (so the policy term has
    no gradient): logits z1 = (0, ln 3) -> p = (1/4, 3/4); z2 = (0, 0) -> p = (1/2, 1/2)."""
    from types import SimpleNamespace

    from trainer_svc.logprobs import token_logprobs_and_entropy

    z = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0], [0.0, 0.0]]], requires_grad=True)  # (1, L=3, V=2)
    ids = torch.tensor([[0, 1, 0]])

    def model(input_ids, attention_mask):
        return SimpleNamespace(logits=z)

    lp, ent = token_logprobs_and_entropy(model, ids, torch.ones_like(ids), entropy_grad=entropy_grad)
    mask = torch.ones(1, 2)
    return z, LossInputs(lp, lp.detach(), torch.zeros(1), mask, entropy=ent)


# H1 = ln 4 - (3/4) ln 3 = 0.562335; H2 = ln 2 (the maximum: no gradient there).
# dH/dz_k = -p_k (ln p_k + H): for z1, (3/16) ln 3 x (+1, -1). The bonus is -c H_t per token,
# averaged like the policy loss: token-mean and seq-mean-token-mean over the 2 tokens,
# seq-mean-token-sum-norm over max_len (4) x 1 sequence. So d loss / d z1 = c (3/16) ln 3 / D x (-1, +1):
# a descent step raises the less likely token's logit and lowers the likelier one's, towards
# the uniform distribution: the entropy goes up.
@pytest.mark.parametrize("agg,denom", [("token-mean", 2), ("seq-mean-token-mean", 2), ("seq-mean-token-sum-norm", 4)])
def test_entropy_bonus_hand_computed(agg, denom):
    c = 0.1
    z, inp = _two_token_entropy_inputs(entropy_grad=True)
    h1, h2 = math.log(4) - 0.75 * math.log(3), math.log(2)
    assert inp.entropy[0].tolist() == pytest.approx([h1, h2], abs=1e-6)
    out = policy_loss(inp, LossConfig(aggregation=agg, entropy_coef=c), BatchNorm(num_tokens=2, num_seqs=1, max_len=4))
    assert out.loss.item() == pytest.approx(-c * (h1 + h2) / denom, abs=1e-6)  # the policy term is 0 (A = 0)
    out.loss.backward()
    g = c * (3 / 16) * math.log(3) / denom
    assert z.grad[0, 0].tolist() == pytest.approx([-g, g], abs=1e-6)
    assert z.grad[0, 1:].abs().max().item() < 1e-7  # at the maximum, and the last position scores nothing
    with torch.no_grad():  # one descent step on the logits raises the entropy
        p = torch.softmax(z[0, 0] - 1.0 * z.grad[0, 0], dim=-1)
    assert -(p * p.log()).sum().item() > h1


def test_entropy_bonus_off_is_a_metric_only_and_on_needs_the_graph():
    z, inp = _two_token_entropy_inputs(entropy_grad=False)
    assert not inp.entropy.requires_grad
    norm = BatchNorm(num_tokens=2, num_seqs=1, max_len=4)
    out = policy_loss(inp, LossConfig(), norm)
    assert out.loss.item() == 0.0 and out.metrics["entropy/sum"] == pytest.approx(
        math.log(4) - 0.75 * math.log(3) + math.log(2), abs=1e-6
    )
    with pytest.raises(ValueError, match="entropy_coef > 0 needs LossInputs.entropy with grad"):
        policy_loss(inp, LossConfig(entropy_coef=0.1), norm)


# --- logprobs + entropy and one real training step ----------------------------------------------


def _tiny(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "m", layers=1, hidden=32, heads=2, intermediate=64, seed=0)
    return AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_from_one_forward(tmp_path, temperature):
    from trainer_svc.logprobs import pad_batch, token_logprobs, token_logprobs_and_entropy

    model = _tiny(tmp_path)
    ids, attn, _ = pad_batch([[1, 10, 11], [1, 12]], [[20, 21, 2], [22, 2]], pad_id=0)
    lp, ent = token_logprobs_and_entropy(model, ids, attn, temperature)
    assert torch.allclose(lp, token_logprobs(model, ids, attn, temperature), atol=1e-6)
    assert lp.requires_grad and not ent.requires_grad
    with torch.no_grad():  # slow reference: -sum_v p log p of the temperature-scaled softmax
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
        p = torch.softmax(logits, dim=-1)
        expected = -(p * torch.log(p)).sum(dim=-1)
    assert torch.allclose(ent, expected, atol=1e-5)
    assert (ent > 0).all() and (ent <= math.log(logits.shape[-1]) + 1e-5).all()


def test_one_training_step_moves_the_tiny_model(tmp_path):
    from trainer_svc.logprobs import pad_batch, token_logprobs, token_logprobs_and_entropy

    model = _tiny(tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts, comps = [[1, 10, 11], [1, 12]], [[20, 21, 2], [22, 2]]
    ids, attn, mask = pad_batch(prompts, comps, pad_id=0)
    with torch.no_grad():
        beh = token_logprobs(model, ids, attn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lp, ent = token_logprobs_and_entropy(model, ids, attn)
    norm = BatchNorm.from_lengths([len(c) for c in comps], max_len=4)
    out = policy_loss(LossInputs(lp, beh, torch.tensor([1.0, -1.0]), mask, entropy=ent), LossConfig(rho=2.0), norm)
    out.loss.backward()
    opt.step()
    assert math.isfinite(out.loss.item())
    assert finalize_metrics(out.metrics, norm)["entropy"] > 0
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(moved) >= len(before) // 2, moved
    with torch.no_grad():  # the positive-advantage completion became more likely
        after = token_logprobs(model, ids, attn)
    assert ((after - beh) * mask)[0].sum() > 0 > ((after - beh) * mask)[1].sum()


def test_learner_optimizer_gets_betas_eps_and_the_entropy_bonus_raises_the_entropy(tmp_path):
    from asyncrl.tiny_model import build_tiny_model
    from bench.t_train import fake_batch
    from trainer_svc.batch import TrainBatch
    from trainer_svc.learner import Learner
    from trainer_svc.logprobs import token_logprobs_and_entropy
    from trainer_svc.sink import flatten_batch

    path = build_tiny_model(tmp_path / "m", layers=1, hidden=32, heads=2, intermediate=64, seed=0)

    def learner(**algorithm):
        spec = jobspec.JobSpec(
            model_path=str(path),
            group_size=4,
            prompts_per_step=2,
            sampling={"max_tokens": 4},
            algorithm={"lr": 1e-3, **algorithm},
        )
        return Learner(spec, "cpu")

    plain = learner()
    assert plain.optimizer.param_groups[0]["betas"] == (0.9, 0.999) and plain.optimizer.param_groups[0]["eps"] == 1e-8
    bonus = learner(betas=[0.8, 0.95], eps=1e-6, entropy_coef=0.1)
    assert bonus.optimizer.param_groups[0]["betas"] == (0.8, 0.95) and bonus.optimizer.param_groups[0]["eps"] == 1e-6
    # equal rewards: every advantage is 0, so the entropy bonus is the whole gradient
    samples, _ = flatten_batch(fake_batch(2, 4, 4, plain.model.config.vocab_size))
    batch = TrainBatch.of(samples, torch.ones(2, 4))
    ids, attn, _, mask, temp = batch.micro_batch(0, len(batch), plain.pad_id)

    def entropy(lrn):
        with torch.no_grad():
            return float((token_logprobs_and_entropy(lrn.model, ids, attn, temp)[1] * mask).sum() / mask.sum())

    before = entropy(plain)
    assert entropy(bonus) == pytest.approx(before)  # the same initial model
    assert plain.step(batch)["entropy"] == pytest.approx(before, rel=1e-5)
    assert entropy(plain) == pytest.approx(before, abs=1e-7)  # no advantage, no bonus: no update
    assert bonus.step(batch)["entropy"] == pytest.approx(before, rel=1e-5)
    assert entropy(bonus) > before + 1e-4  # the bonus alone raised it
