"""Multi-turn samples: the environment's tokens are in the sequence but not in the loss.

Hand-computed: one sample of prompt [1, 5] and completion [7, 8, 9, 10] where 9 was appended by the
environment (model_mask 1 1 0 1), beside a single-turn sample with no mask (all the model's).
"""

from __future__ import annotations

import pytest
import torch

from shared.schema import Rollout, Scored, pack_f32, pack_i32
from trainer_svc.algorithms import BatchNorm, LossConfig, LossInputs, policy_loss
from trainer_svc.batch import TrainBatch


def _scored(i: int, completion: list[int], logprobs: list[float], mask: bytes = b"", turns: int = 1) -> Scored:
    r = Rollout(
        job_id="j",
        msg_id=f"j/g{i}/0",
        group_id=f"j/g{i}",
        policy_version=0,
        policy_version_max=0,
        prompt_index=0,
        sample_index=0,
        group_size=1,
        generator_id="g",
        prompt_ids=pack_i32([1, 5]),
        completion_ids=pack_i32(completion),
        logprobs=pack_f32(logprobs),
        model_mask=mask,
        turns=turns,
        completion="",
        answer="",
    )
    return Scored(job_id="j", msg_id=r.msg_id, group_id=r.group_id, policy_version=0, rollout=r, reward=1.0)


def test_the_mask_reaches_the_micro_batch_and_the_token_counts() -> None:
    multi = _scored(0, [7, 8, 9, 10], [-0.5, -0.25, 0.0, -1.0], bytes([1, 1, 0, 1]), turns=2)
    single = _scored(1, [7, 8], [-0.5, -0.25])
    assert multi.rollout.num_model_tokens == 3 and single.rollout.num_model_tokens == 2
    batch = TrainBatch.of([multi, single], torch.tensor([[1.0], [0.0]]))
    assert batch.model_token_counts() == [3, 2]
    ids, attn, behaviour, mask, _ = batch.micro_batch(0, 2, pad_id=0)
    # completion token j is scored at shifted position j - 1: positions 1..4 for the first row
    assert ids.tolist() == [[1, 5, 7, 8, 9, 10], [1, 5, 7, 8, 0, 0]]
    assert mask.tolist() == [[0, 1, 1, 0, 1], [0, 1, 1, 0, 0]]
    assert behaviour.tolist() == [[0, -0.5, -0.25, 0.0, -1.0], [0, -0.5, -0.25, 0, 0]]
    assert attn.tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]


def test_environment_tokens_get_no_loss_gradient_or_importance_weight() -> None:
    multi = _scored(0, [7, 8, 9, 10], [-0.5, -0.25, 0.0, -1.0], bytes([1, 1, 0, 1]), turns=2)
    batch = TrainBatch.of([multi], torch.tensor([[1.0]]))
    _, _, behaviour, mask, _ = batch.micro_batch(0, 1, pad_id=0)
    # the trainer's logprobs: equal to the behaviour's on the model's tokens (weight 1), and
    # anything at all on the environment's token (shifted position 3)
    lp = torch.tensor([[0.0, -0.5, -0.25, -3.0, -1.0]], requires_grad=True)
    norm = BatchNorm.from_lengths(batch.model_token_counts(), max_len=8)
    out = policy_loss(LossInputs(lp, behaviour, torch.tensor([2.0]), mask), LossConfig(), norm)
    out.loss.backward()
    # AIPO, token-mean over the 3 model tokens, weight exp(0) = 1, advantage 2:
    # loss = -(1/3) * sum_t w_t * A * lp_t -> d loss / d lp_t = -(2/3) on model tokens, 0 elsewhere
    assert lp.grad is not None
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -2 / 3, -2 / 3, 0.0, -2 / 3])
    # importance weights are counted over the model's 3 tokens only (each 1.0 here)
    assert out.metrics["is/applied_n"] == 3.0 and out.metrics["is/applied_sum"] == pytest.approx(3.0)
    moved = policy_loss(
        LossInputs(lp.detach() + torch.tensor([[0, 0, 0, 7.0, 0]]), behaviour, torch.tensor([2.0]), mask),
        LossConfig(),
        norm,
    )
    assert moved.loss.item() == pytest.approx(out.loss.item())


@pytest.mark.parametrize(
    "mask, logprobs, why",
    [
        (bytes([1, 1]), [-0.5, -0.25, -0.1], "one per token"),
        (bytes([1, 2, 1]), [-0.5, -0.25, -0.1], "other than 0"),
        (bytes([1, 0, 1]), [-0.5, -0.25, -0.1], "environment token"),
    ],
)
def test_a_bad_mask_is_refused_at_the_wire(mask: bytes, logprobs: list[float], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        _scored(0, [7, 8, 9], logprobs, mask)
