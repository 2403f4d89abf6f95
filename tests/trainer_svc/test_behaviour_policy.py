"""The trainer scores each token under the distribution the sampler drew it from: logits /
temperature, cut to the top-k, then to the top-p nucleus, renormalised (trainer_svc/logprobs.py
`dropped`, `truncate`; ARCHITECTURE.md "The behaviour policy")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shared.schema import Rollout, Scored, pack_f32, pack_i32
from trainer_svc.batch import TrainBatch
from trainer_svc.logprobs import dropped, token_logprobs, token_logprobs_and_entropy, truncate

# probabilities 0.5, 0.25, 0.15, 0.1 (logits are their logs: softmax gives them back)
PROBS = torch.tensor([0.5, 0.25, 0.15, 0.1])
LOGITS = PROBS.log().view(1, 1, 4)


def _out(top_k: int, top_p: float, logits: torch.Tensor = LOGITS) -> list[bool]:
    k = torch.full(logits.shape[:2], top_k, dtype=torch.long)
    p = torch.full(logits.shape[:2], top_p)
    return dropped(logits, k, p)[0, 0].tolist()


def test_top_p_keeps_the_smallest_top_set_that_reaches_p():
    # ascending 0.1, 0.15, 0.25, 0.5: cumulative 0.1, 0.25, 0.5, 1.0; out where <= 1 - p.
    # p = 0.7: 1 - p = 0.3 -> 0.1 and 0.15 out; {0.5, 0.25} (mass 0.75 >= 0.7) stays
    assert _out(0, 0.7) == [False, False, True, True]
    # p = 0.8: 1 - p = 0.2 -> only 0.1 out: 0.5 + 0.25 = 0.75 < 0.8, so 0.15 is needed
    assert _out(0, 0.8) == [False, False, False, True]
    # p = 0.3: the top token alone reaches it; p = 1e-6 still keeps the top token
    assert _out(0, 0.3) == [False, True, True, True]
    assert _out(0, 1e-6) == [False, True, True, True]
    assert _out(0, 1.0) == [False] * 4


def test_top_k_comes_first_and_top_p_applies_to_what_it_left():
    # top_k 3 keeps 0.5, 0.25, 0.15: renormalised 5/9, 2.5/9, 1.5/9 = 0.556, 0.278, 0.167;
    # top_p 0.8 on those: 1 - p = 0.2 >= 0.167 -> 0.15 out too. (top_p 0.8 on the full
    # distribution keeps 0.15, above: the order matters.)
    assert _out(3, 0.8) == [False, False, True, True]
    assert _out(3, 1.0) == [False, False, False, True]
    assert _out(1, 1.0) == [False, True, True, True]
    assert _out(4, 1.0) == _out(0, 1.0) == _out(99, 1.0) == [False] * 4  # k >= V: no cut


def test_top_k_keeps_every_token_tied_with_the_kth():
    tied = torch.tensor([[[1.0, 1.0, 1.0, 0.0]]])
    assert _out(2, 1.0, tied) == [False, False, False, True]
    assert _out(2, 0.999, tied) == [False, False, False, True]  # the sort path alike


def test_truncated_logprob_and_entropy_by_hand():
    # top_p 0.7 keeps {0.5, 0.25}: renormalised 2/3, 1/3
    targets = torch.tensor([[[1]]])
    z = truncate(LOGITS, targets, torch.tensor([[0]]), torch.tensor([[0.7]]))
    assert torch.isneginf(z[0, 0, 2:]).all()
    lp = torch.log_softmax(z, -1)[0, 0]
    assert lp[0].item() == pytest.approx(math.log(2 / 3), abs=1e-6)
    assert lp[1].item() == pytest.approx(math.log(1 / 3), abs=1e-6)
    # the sampled token always stays in: token 3 (0.1) is out of the nucleus, so its logprob is
    # over {0.5, 0.25, 0.1}: 0.1 / 0.85
    z3 = truncate(LOGITS, torch.tensor([[[3]]]), torch.tensor([[0]]), torch.tensor([[0.7]]))
    assert torch.log_softmax(z3, -1)[0, 0, 3].item() == pytest.approx(math.log(0.1 / 0.85), abs=1e-6)
    assert torch.isneginf(z3[0, 0, 2])


class _Logits(torch.nn.Module):
    """A "model" whose logits at every position are the given row: the hand numbers above."""

    def __init__(self, row: torch.Tensor):
        super().__init__()
        self.row = torch.nn.Parameter(row.clone())

    def forward(self, input_ids, attention_mask=None, **_):
        class Out:
            logits = self.row.expand(*input_ids.shape, -1)

        return Out()


def test_token_logprobs_and_entropy_of_the_truncated_distribution():
    model = _Logits(PROBS.log())
    ids = torch.tensor([[0, 1, 0]])
    lp, ent = token_logprobs_and_entropy(model, ids, torch.ones_like(ids), 1.0, top_p=0.7)
    assert lp[0].tolist() == pytest.approx([math.log(1 / 3), math.log(2 / 3)], abs=1e-6)
    # H(2/3, 1/3) = ln 3 - (2/3) ln 2
    assert ent[0].tolist() == pytest.approx([math.log(3) - 2 / 3 * math.log(2)] * 2, abs=1e-6)
    # temperature first: logits / 0.5 squares the odds -> 0.25 : 0.0625 : 0.0225 : 0.01,
    # normalised 0.7163, 0.1791, 0.0645, 0.0287 (sum 0.345); top_p 0.8: 0.7163 < 0.8 needs
    # 0.1791 too, and 0.8954 reaches it: keep {0, 1}, token 1's logprob log(0.0625 / 0.3125)
    lp_t = token_logprobs(model, ids[:, :2], None, 0.5, top_p=0.8)
    assert lp_t[0, 0].item() == pytest.approx(math.log(0.2), abs=1e-6)
    # no cut: the full softmax
    assert token_logprobs(model, ids[:, :2], None, 1.0)[0, 0].item() == pytest.approx(math.log(0.25), abs=1e-6)


def test_gradient_reaches_only_the_kept_logits():
    model = _Logits(PROBS.log())
    ids = torch.tensor([[0, 1]])
    token_logprobs(model, ids, None, 1.0, top_p=0.7).sum().backward()
    g = model.row.grad
    assert g is not None
    # d/dz log softmax(z)[1] over {0, 1} = onehot(1) - (2/3, 1/3): (-2/3, 2/3); 0 outside
    assert g.tolist() == pytest.approx([-2 / 3, 2 / 3, 0.0, 0.0], abs=1e-6)


def _reference_kept(z: np.ndarray, k: int, p: float) -> set[int]:
    """The cut spelled out, in float64, one distribution at a time: the k most likely (ties with
    the k-th kept), then the most likely of those, in order, while the mass taken is < p."""
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if 0 < k < len(z):
        order = [i for i in order if z[i] >= z[order[k - 1]]]
    w = np.exp(z[order] - z[order].max())
    w /= w.sum()
    kept, mass = set(), 0.0
    for i, wi in zip(order, w, strict=True):
        if mass >= p:
            break
        kept.add(i)
        mass += wi
    return kept


@pytest.mark.parametrize(("k", "p"), [(0, 0.9), (20, 1.0), (20, 0.9), (5, 0.5), (0, 0.3)])
def test_the_vectorised_cut_matches_the_spelled_out_one(k: int, p: float):
    g = torch.Generator().manual_seed(k * 100 + int(p * 10))
    logits = torch.randn(3, 16, 97, generator=g) * 2  # (B, n, V)
    out = dropped(logits, torch.full((3, 16), k), torch.full((3, 16), p))
    for b in range(3):
        for t in range(16):
            kept = set(torch.nonzero(~out[b, t]).flatten().tolist())
            assert kept == _reference_kept(logits[b, t].double().numpy(), k, p)


def test_the_cut_is_vllms():
    """The same rows through vLLM's own top-k/top-p (the CPU sampler's path): the same tokens out,
    per row knobs mixed (a row without top-k, a row without top-p, as one vLLM batch has them)."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 3
    k = torch.tensor([0, 20, 20, 1, 300, 7])
    p = torch.tensor([0.9, 1.0, 0.9, 0.5, 0.95, 1.0])
    ours = dropped(logits[:, None], k[:, None], p[:, None])[:, 0]
    vk = torch.where(k == 0, 300, k).to(torch.int32)  # vLLM's batch holds "no top-k" as the vocabulary size
    theirs = torch.isneginf(apply_top_k_top_p_pytorch(logits.clone(), vk, p, allow_cpu_sync=True))
    assert torch.equal(ours, theirs)
    only_k = torch.isneginf(apply_top_k_top_p_pytorch(logits.clone(), vk, None, allow_cpu_sync=True))
    assert torch.equal(dropped(logits[:, None], k[:, None], torch.ones(6, 1))[:, 0], only_k)


def _scored(i: int, prompt: list[int], comp: list[int], logprobs: list[float], top_k: int, top_p: float) -> Scored:
    r = Rollout(
        job_id="j",
        msg_id=f"j/g0/{i}",
        group_id="j/g0",
        policy_version=0,
        policy_version_max=0,
        prompt_index=0,
        sample_index=i,
        group_size=4,
        generator_id="x",
        prompt_ids=pack_i32(prompt),
        completion_ids=pack_i32(comp),
        logprobs=pack_f32(logprobs),
        completion="",
        answer="0",
        temperature=0.8,
        top_k=top_k,
        top_p=top_p,
    )
    return Scored(job_id="j", msg_id=r.msg_id, group_id=r.group_id, policy_version=0, rollout=r, reward=float(i % 2))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from asyncrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m"), layers=1, hidden=32, heads=2, intermediate=64, seed=0)


def _on_policy_batch(model: torch.nn.Module, knobs: list[tuple[int, float]]) -> TrainBatch:
    """One group sampled from `model` itself at temperature 0.8 and each sample's (top_k, top_p),
    token by token from the spelled-out cut (`_reference_kept`), with its behaviour logprobs."""
    rng = np.random.default_rng(0)
    samples = []
    for i, (k, p) in enumerate(knobs):
        prompt, comp, lps = [1, 5 + i], [], []
        for _ in range(5):
            with torch.no_grad():
                z = model(input_ids=torch.tensor([prompt + comp])).logits[0, -1].double().numpy() / 0.8
            kept = sorted(_reference_kept(z, k, p))
            w = np.exp(z[kept] - z[kept].max())
            w /= w.sum()
            j = int(rng.choice(len(kept), p=w))
            comp.append(kept[j])
            lps.append(float(np.log(w[j])))
        samples.append(_scored(i, prompt, comp, lps, k, p))
    return TrainBatch.of(samples, torch.tensor([[0.0, 1.0, 0.0, 1.0]]))


@pytest.mark.parametrize("layout", ["padded", "packed", "chunked"])
def test_the_learner_scores_samples_under_their_own_cut(tiny, layout: str):
    """At the weights that sampled them, every importance weight is 1 and the mismatch KL 0,
    whatever each sample's top-k / top-p, in padded, packed and chunked micro-batches alike; scored
    under the full softmax instead, the weights would carry the kept mass (is/mean < 1)."""
    from shared.jobspec import JobSpec
    from trainer_svc.learner import Learner

    algorithm = {"lr": 1e-3, "micro_batch_size": 2, "entropy_coef": 0.01, "kl_coef": 0.1}
    if layout == "packed":
        algorithm.update(packing=True, micro_batch_tokens=16)
    if layout == "chunked":
        algorithm["logprob_chunk_tokens"] = 2
    spec = JobSpec(
        model_path=str(tiny), group_size=4, prompts_per_step=1, sampling={"max_tokens": 5}, algorithm=algorithm
    )
    learner = Learner(spec, "cpu")
    batch = _on_policy_batch(learner.model, [(0, 0.7), (5, 1.0), (8, 0.9), (0, 1.0)])
    assert batch.top_ks.tolist() == [0, 5, 8, 0] and batch.top_ps.tolist() == pytest.approx([0.7, 1.0, 0.9, 1.0])
    m = learner.step(batch)
    assert m["is/mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["is/max"] == pytest.approx(1.0, abs=1e-5)
    assert m["mismatch_kl"] < 1e-9
    assert m["kl_ref"] < 1e-9  # the reference (the same weights) under the same cut
    assert math.isfinite(m["entropy"])
