"""A global training batch as tensors: what the learner and the other ranks see.

Scored wire messages become a `TrainBatch` once, at the edge (`TrainBatch.of`); from there on the
step, the rank broadcast (trainer_svc/dist.py) and every micro-batch work on tensors. Ragged
sequences are stored flat with their lengths, so a micro-batch pads only its own rows (the same
padding `logprobs.pad_batch` does), or packs its samples into one row with no padding at all
(`packed_micro_batch`, trainer_svc/packing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from shared.schema import Scored
from trainer_svc.packing import PackedMicroBatch, position_ids


@dataclass(frozen=True)
class TrainBatch:
    """B samples in group order, G groups of n. Flat fields hold every sample's tokens back to
    back; `*_lens` cut them apart."""

    prompt_tokens: torch.Tensor  # (sum P_i,) int64
    prompt_lens: torch.Tensor  # (B,) int64
    completion_tokens: torch.Tensor  # (sum C_i,) int64
    completion_lens: torch.Tensor  # (B,) int64
    behaviour_logprobs: torch.Tensor  # (sum C_i,) float32: the sampler's logprob of each completion token
    # (sum C_i,) float32: 1 where the model sampled the token, 0 where a multi-turn episode's
    # environment appended it (no loss, no importance weight, no KL or entropy there)
    model_mask: torch.Tensor
    rewards: torch.Tensor  # (G, n) float32
    temperatures: torch.Tensor  # (B,) float32: each sample's sampling temperature
    # (B,) int64 and float32: each sample's top-k (0: none) and top-p (1.0: none); with the
    # temperature, the distribution it was drawn from (trainer_svc/logprobs.py `truncate`)
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    truncated: torch.Tensor  # (B,) bool: cut at max_tokens rather than ended by EOS or a stop rule
    versions: torch.Tensor  # (B,) int64: the policy version that generated each sample
    terms: torch.Tensor  # (K,) float64: the mean of each reward term (`term_names`) over the samples that have it
    term_names: tuple[str, ...] = ()

    @classmethod
    def of(cls, samples: Sequence[Scored], rewards: torch.Tensor) -> TrainBatch:
        """`samples` in group order, `rewards` (G, n) their rewards (the batch's, to shape later)."""
        prompts = [s.rollout.prompt_array() for s in samples]
        comps = [s.rollout.completion_array() for s in samples]
        sums: dict[str, list[float]] = {}
        for s in samples:
            for name, v in s.details.items():
                sums.setdefault(name, []).append(v)

        def flat(arrays: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(0)).to(dtype)

        return cls(
            prompt_tokens=flat(prompts, torch.int64),
            prompt_lens=torch.tensor([a.size for a in prompts], dtype=torch.int64),
            completion_tokens=flat(comps, torch.int64),
            completion_lens=torch.tensor([a.size for a in comps], dtype=torch.int64),
            behaviour_logprobs=flat([s.rollout.logprob_array() for s in samples], torch.float32),
            model_mask=flat([s.rollout.model_mask_array() for s in samples], torch.float32),
            rewards=rewards.to(torch.float32),
            temperatures=torch.tensor([s.rollout.temperature for s in samples], dtype=torch.float32),
            top_ks=torch.tensor([s.rollout.top_k for s in samples], dtype=torch.int64),
            top_ps=torch.tensor([s.rollout.top_p for s in samples], dtype=torch.float32),
            truncated=torch.tensor([s.rollout.finish_reason == "length" for s in samples], dtype=torch.bool),
            versions=torch.tensor([s.rollout.policy_version for s in samples], dtype=torch.int64),
            terms=torch.tensor([float(np.mean(v)) for v in sums.values()], dtype=torch.float64),
            term_names=tuple(sums),
        )

    def __len__(self) -> int:
        return int(self.prompt_lens.numel())

    def sample_lengths(self) -> list[int]:
        """Each sample's tokens, prompt + completion: what a packed micro-batch holds of it."""
        return (self.prompt_lens + self.completion_lens).tolist()

    def model_token_counts(self) -> list[int]:
        """Each sample's model-sampled completion tokens: the loss's token counts (an environment's
        tokens in a multi-turn episode are not the model's to learn)."""
        off = _offsets(self.completion_lens)
        return [
            int(self.model_mask[o : o + int(n)].sum()) for o, n in zip(off, self.completion_lens.tolist(), strict=True)
        ]

    def with_rewards(self, rewards: torch.Tensor) -> TrainBatch:
        """The same samples with other (G, n) rewards (the over-long treatment's)."""
        return replace(self, rewards=rewards)

    def reward_terms(self) -> dict[str, float]:
        """`reward/<term>`: each term of a weighted-sum reward on its own."""
        return {f"reward/{name}": float(v) for name, v in zip(self.term_names, self.terms.tolist(), strict=True)}

    # --- to and from the other ranks -----------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field by name (`from_tensors` inverts it with `term_names`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "term_names"}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], term_names: Sequence[str]) -> TrainBatch:
        return cls(**tensors, term_names=tuple(term_names))

    # --- one micro-batch -----------------------------------------------------------------------

    def micro_batch(
        self, lo: int, hi: int, pad_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Samples [lo, hi) as model inputs: input_ids (b, L), attention_mask (b, L), behaviour
        logprobs (b, L-1), completion mask (b, L-1) and temperatures (b,), with L the longest
        prompt + completion of these rows; right-padded like `logprobs.pad_batch`. The completion
        mask is 1 only on the tokens the model sampled (`model_mask`). Their top-k and top-p:
        `top_ks[lo:hi]`, `top_ps[lo:hi]`."""
        p_off = _offsets(self.prompt_lens)
        c_off = _offsets(self.completion_lens)
        lengths = self.prompt_lens[lo:hi] + self.completion_lens[lo:hi]
        b, seq_len = hi - lo, int(lengths.max())
        input_ids = torch.full((b, seq_len), pad_id, dtype=torch.long)
        attn = torch.zeros((b, seq_len), dtype=torch.long)
        mask = torch.zeros((b, max(seq_len - 1, 0)), dtype=torch.float32)
        behaviour = torch.zeros_like(mask)
        for row, i in enumerate(range(lo, hi)):
            p, c = int(self.prompt_lens[i]), int(self.completion_lens[i])
            input_ids[row, :p] = self.prompt_tokens[p_off[i] : p_off[i] + p]
            input_ids[row, p : p + c] = self.completion_tokens[c_off[i] : c_off[i] + c]
            attn[row, : p + c] = 1
            # token j (j in [p, p + c)) is scored at shifted position j - 1
            mask[row, p - 1 : p + c - 1] = self.model_mask[c_off[i] : c_off[i] + c]
            behaviour[row, p - 1 : p + c - 1] = self.behaviour_logprobs[c_off[i] : c_off[i] + c]
        return input_ids, attn, behaviour, mask, self.temperatures[lo:hi]

    def packed_micro_batch(self, indices: Sequence[int]) -> PackedMicroBatch:
        """Samples `indices` back to back in one row, position ids restarting for each (see
        trainer_svc/packing.py): no padding, so no pad id; once `unpack`ed, the same scores and
        masks per sample as `micro_batch` gives."""
        if not indices:
            raise ValueError("a packed micro-batch needs at least one sample")
        p_off = _offsets(self.prompt_lens)
        c_off = _offsets(self.completion_lens)
        plens = [int(self.prompt_lens[i]) for i in indices]
        clens = [int(self.completion_lens[i]) for i in indices]
        lengths = [p + c for p, c in zip(plens, clens, strict=True)]
        width = max(clens, default=0)
        pieces, temps, ks, ps = [], [], [], []
        index = torch.zeros((len(indices), width), dtype=torch.long)
        behaviour = torch.zeros((len(indices), width), dtype=torch.float32)
        mask = torch.zeros_like(behaviour)
        start = 0
        for k, i in enumerate(indices):
            p, c = plens[k], clens[k]
            pieces += [self.prompt_tokens[p_off[i] : p_off[i] + p], self.completion_tokens[c_off[i] : c_off[i] + c]]
            temps.append(self.temperatures[i].expand(p + c))
            ks.append(self.top_ks[i].expand(p + c))
            ps.append(self.top_ps[i].expand(p + c))
            # the row's token start + j (j in [p, p + c)) is scored at shifted position start + j - 1
            index[k, :c] = torch.arange(start + p - 1, start + p + c - 1)
            behaviour[k, :c] = self.behaviour_logprobs[c_off[i] : c_off[i] + c]
            mask[k, :c] = self.model_mask[c_off[i] : c_off[i] + c]
            start += p + c
        ids = torch.cat(pieces).to(torch.long)
        return PackedMicroBatch(
            samples=torch.tensor(list(indices), dtype=torch.long),
            input_ids=ids[None],
            position_ids=position_ids(lengths)[None],
            # position t scores token t + 1 of the same sample; a sample's last position scores the
            # next sample's first token, which no index points at
            temperatures=torch.cat(temps)[None, :-1].to(torch.float32),
            top_ks=torch.cat(ks)[None, :-1].to(torch.int64),
            top_ps=torch.cat(ps)[None, :-1].to(torch.float32),
            index=index,
            behaviour_logprobs=behaviour,
            mask=mask,
        )


def _offsets(lens: torch.Tensor) -> list[int]:
    """Start of each row in the flat tensor cut by `lens`."""
    return [0, *torch.cumsum(lens, 0).tolist()[:-1]]
