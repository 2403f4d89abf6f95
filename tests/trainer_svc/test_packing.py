"""Sequence packing (issue 17 item 4): the bin packing, the position ids and the packed layout by
hand; packed and padded micro-batches give the same loss, metrics and gradients on a tiny Llama
(uneven lengths, mixed temperatures, multi-turn masks, chunked logprobs, entropy bonus, KL)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.jobspec import JobSpec
from shared.schema import Rollout, Scored, pack_f32, pack_i32
from trainer_svc.batch import TrainBatch
from trainer_svc.dist import Ranks
from trainer_svc.packing import check_packing, first_fit_decreasing, position_ids


def test_first_fit_decreasing_by_hand() -> None:
    # longest first: 8 (i2) -> bin A (room 2); 5 (i0) -> B (room 5); 4 (i4) -> B (room 1);
    # 3 (i1) -> C (room 7); 2 (i3) -> A (room 0)
    assert first_fit_decreasing([5, 3, 8, 2, 4], 10) == [[2, 3], [0, 4], [1]]
    # a sample over the budget has a bin of its own; the rest still pack
    assert first_fit_decreasing([12, 3, 7], 10) == [[0], [1, 2]]
    assert first_fit_decreasing([], 10) == []
    with pytest.raises(ValueError, match="budget"):
        first_fit_decreasing([1], 0)
    with pytest.raises(ValueError, match="at least 1 token"):
        first_fit_decreasing([3, 0], 10)


def test_first_fit_decreasing_invariants() -> None:
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, 60, 200)]
    bins = first_fit_decreasing(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(200))  # every sample exactly once
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert len(bins) <= 2 * sum(lengths) / 100 + 1  # no bin less than half full but one (first fit)


def test_position_ids_restart_and_transformers_finds_the_segments() -> None:
    from transformers.masking_utils import find_packed_sequence_indices

    pos = position_ids([3, 2, 4])
    assert pos.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    # what the model's mask is built from: the same sample <=> the same segment
    assert find_packed_sequence_indices(pos[None]).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    # samples of length 1 back to back are still separate segments
    assert find_packed_sequence_indices(position_ids([1, 1, 2])[None]).tolist() == [[0, 1, 2, 2]]


def _scored(
    i: int,
    prompt: list[int],
    completion: list[int],
    logprobs: list[float],
    temperature: float = 1.0,
    mask: bytes = b"",
    n: int = 1,
    reward: float = 1.0,
) -> Scored:
    r = Rollout(
        job_id="j",
        msg_id=f"j/g{i // n}/{i % n}",
        group_id=f"j/g{i // n}",
        policy_version=0,
        policy_version_max=0,
        prompt_index=i // n,
        sample_index=i % n,
        group_size=n,
        generator_id="g",
        prompt_ids=pack_i32(prompt),
        completion_ids=pack_i32(completion),
        logprobs=pack_f32(logprobs),
        model_mask=mask,
        temperature=temperature,
        completion="",
        answer="",
    )
    return Scored(job_id="j", msg_id=r.msg_id, group_id=r.group_id, policy_version=0, rollout=r, reward=reward)


def test_packed_micro_batch_by_hand() -> None:
    a = _scored(0, [1, 5], [6, 7], [-0.5, -0.25], temperature=0.7)
    b = _scored(1, [1], [8, 9, 10], [-1.0, 0.0, -2.0], temperature=1.3, mask=bytes([1, 0, 1]))
    batch = TrainBatch.of([a, b], torch.tensor([[1.0], [0.0]]))
    assert batch.sample_lengths() == [4, 4]
    mb = batch.packed_micro_batch([0, 1])
    assert mb.input_ids.tolist() == [[1, 5, 6, 7, 1, 8, 9, 10]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    # token j of a sample starting at s is scored at shifted position s + j - 1:
    # a's completion (tokens 2, 3) at 1, 2; b's (tokens 5, 6, 7) at 4, 5, 6
    assert mb.index.tolist() == [[1, 2, 0], [4, 5, 6]]
    assert mb.mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    assert mb.behaviour_logprobs.tolist() == [[-0.5, -0.25, 0], [-1.0, 0.0, -2.0]]
    # shifted position t is scored at the temperature of the sample token t belongs to
    assert mb.temperatures[0].tolist() == pytest.approx([0.7] * 4 + [1.3] * 3)
    assert mb.unpack(torch.arange(7.0)[None]).tolist() == [[1, 2, 0], [4, 5, 6]]
    # the same samples in another order: b first
    assert batch.packed_micro_batch([1, 0]).index.tolist() == [[0, 1, 2], [5, 6, 0]]
    with pytest.raises(ValueError):
        batch.packed_micro_batch([])


def test_packed_micro_batches_pad_the_count_across_ranks() -> None:
    lengths = [10, 10, 10, 10, 10, 2, 2]  # shares [0, 4) and [4, 7)
    r0, r1 = Ranks(0, 2), Ranks(1, 2)
    assert r0.packed_micro_batches(lengths, 20) == [[0, 1], [2, 3]]
    assert r1.packed_micro_batches(lengths, 20) == [[4, 5, 6], None]  # padded to rank 0's count
    assert Ranks().packed_micro_batches(lengths, 20) == [[0, 1], [2, 3], [4, 5, 6]]


# --- packed == padded, in loss and gradients ----------------------------------------------------

GROUPS, N, MAX_TOKENS = 3, 4, 20


def _batch(vocab: int) -> TrainBatch:
    """Uneven prompts and completions, three temperatures, multi-turn masks with environment tokens."""
    rng = np.random.default_rng(3)
    samples = []
    for i in range(GROUPS * N):
        t = int(rng.integers(1, MAX_TOKENS + 1))
        mask = b""
        lp = -rng.random(t) * 3
        if i % 3 == 0 and t > 3:  # an episode: the environment appended tokens 1..2
            m = np.ones(t, dtype=np.uint8)
            m[1:3] = 0
            lp[1:3] = 0.0
            mask = m.tobytes()
        samples.append(
            _scored(
                i,
                [1, *rng.integers(4, vocab, int(rng.integers(1, 9)))],
                list(rng.integers(4, vocab, t)),
                list(lp),
                temperature=[0.7, 1.0, 1.3][i % 3],
                mask=mask,
                n=N,
                reward=float(rng.random()),
            )
        )
    return TrainBatch.of(samples, torch.tensor([s.reward for s in samples]).view(GROUPS, N))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from asyncrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", layers=2, hidden=64, heads=2, intermediate=128)


CONFIGS = {
    "aipo-token-mean": {},
    "gspo-seq-mean-chunked-entropy-kl": {
        "loss": "gspo",
        "aggregation": "seq-mean-token-mean",
        "logprob_chunk_tokens": 7,
        "entropy_coef": 0.01,
        "kl_coef": 0.05,
    },
    "ppo-sum-norm": {"loss": "ppo_clip", "aggregation": "seq-mean-token-sum-norm"},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_packed_and_padded_give_the_same_loss_and_gradients(tiny, config: str) -> None:
    from trainer_svc.learner import Learner

    torch.manual_seed(0)
    got = {}
    for packing in (False, True):
        # lr 0: the step computes and keeps the gradients, the weights stay; 1e6: no clipping.
        # Budget 24 tokens: several packed passes, and samples longer than it alone.
        spec = JobSpec(
            model_path=str(tiny),
            group_size=N,
            prompts_per_step=GROUPS,
            sampling={"max_tokens": MAX_TOKENS},
            algorithm={
                "micro_batch_size": 5,
                "packing": packing,
                "micro_batch_tokens": 24,
                "max_grad_norm": 1e6,
                **CONFIGS[config],
            },
        )
        learner = Learner(spec, "cpu")
        batch = _batch(learner.vocab_size)
        if packing:
            lengths = batch.sample_lengths()
            bins = first_fit_decreasing(lengths, 24)
            assert len(bins) > 3 and any(len(b) >= 2 for b in bins) and max(lengths) > 24
        metrics = learner.step(batch, lr=0.0)
        got[packing] = metrics, {n: p.grad.clone() for n, p in learner.model.named_parameters()}
    (m0, g0), (m1, g1) = got[False], got[True]
    assert set(m0) == set(m1)
    for key in m0:
        assert m1[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-6), key
    assert m0["grad_norm"] > 0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_check_packing_passes_llama_and_refuses_a_model_that_mixes_samples(tiny) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert check_packing(model) < 1e-5

    class Ignores(torch.nn.Module):  # drops the position ids: samples see each other
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def forward(self, input_ids, position_ids=None, **kwargs):
            return self.inner(input_ids=input_ids, **kwargs)

    with pytest.raises(ValueError, match="does not confine attention"):
        check_packing(Ignores(model))
