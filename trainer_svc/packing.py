"""Sequence packing: a micro-batch as one row of whole samples back to back, not padded rows.

Padded micro-batches (`TrainBatch.micro_batch`) cost every row the longest row's length; with a
long-tailed spread of completion lengths most positions are padding. Packed, a micro-batch is the
samples that fit a token budget laid end to end in one row (`first_fit_decreasing`), with
position ids that restart at 0 for each sample (`position_ids`) so every token's rotary position
is what it is unpacked::

    input_ids      a0 a1 a2 b0 b1 c0 c1 c2 c3      (1, L), L = sum of the lengths
    position_ids    0  1  2  0  1  0  1  2  3
    segments        0  0  0  1  1  2  2  2  2      (what transformers derives from them)

Attention is confined to each sample by the model, from those position ids (transformers >= 5,
`masking_utils.find_packed_sequence_indices`, when `attention_mask` is None and no cache is
built): a block-diagonal causal mask for sdpa/eager (on CPU), varlen kernels (`cu_seqlens`) for
flash_attention_2 on CUDA. `check_packing` verifies this on the loaded model before a job uses it,
so a model whose attention ignores the reset cannot silently mix samples.

The loss never sees the packed layout: logprobs are gathered back to one row per sample
(`PackedMicroBatch.unpack`), so `policy_loss` and its global-batch normalisation are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Bin-pack samples into micro-batches of at most `budget` tokens each.

    First-fit decreasing: longest first (ties by index), each into the first bin with room, else a
    new bin. A sample longer than the budget gets a bin of its own. Deterministic, so every rank
    computes every rank's bins alike (trainer_svc/dist.py `Ranks.packed_micro_batches`).

    Args:
        lengths: tokens of each sample (prompt + completion), >= 1.
        budget: tokens per bin, >= 1.
    Returns:
        Bins of sample indices (each ascending), in order of creation; every index exactly once.
    Raises:
        ValueError: on budget < 1 or a length < 1.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1 token, got {budget}")
    if any(n < 1 for n in lengths):
        raise ValueError(f"every sample needs at least 1 token, got lengths {list(lengths)}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return [sorted(b) for b in bins]


def position_ids(lengths: Sequence[int]) -> torch.Tensor:
    """(sum lengths,) int64: 0..n-1 for each sample in turn (the reset that marks a new sample)."""
    if not lengths:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])


@dataclass(frozen=True)
class PackedMicroBatch:
    """b samples packed into one row of L tokens, and the map back to one row per sample.

    The model scores token t+1 at position t, so a row of L tokens gives L - 1 shifted logprobs;
    sample k's completion token j (of C_k) is scored at shifted position `index[k, j]`.
    """

    samples: torch.Tensor  # (b,) int64: the samples' indices in the global batch
    input_ids: torch.Tensor  # (1, L) int64
    position_ids: torch.Tensor  # (1, L) int64, restarting at 0 for each sample
    temperatures: torch.Tensor  # (1, L-1) float32: the temperature of the sample each position belongs to
    index: torch.Tensor  # (b, C) int64: shifted position of each completion token; 0 past C_k
    behaviour_logprobs: torch.Tensor  # (b, C) float32, 0 past C_k
    mask: torch.Tensor  # (b, C) float32: 1 where the model sampled the token (model_mask), 0 past C_k
    top_ks: torch.Tensor  # (1, L-1) int64: the top-k of the sample each position belongs to (0: none)
    top_ps: torch.Tensor  # (1, L-1) float32: its top-p (1.0: none)

    def to(self, device: str | torch.device) -> PackedMicroBatch:
        return PackedMicroBatch(
            *(
                t.to(device)
                for t in (
                    self.samples,
                    self.input_ids,
                    self.position_ids,
                    self.temperatures,
                    self.index,
                    self.behaviour_logprobs,
                    self.mask,
                    self.top_ks,
                    self.top_ps,
                )
            )
        )

    def unpack(self, shifted: torch.Tensor) -> torch.Tensor:
        """(1, L-1) per-position values (logprobs, entropy) -> (b, C), one row per sample's
        completion; entries past a sample's length are meaningless (`mask` is 0 there)."""
        return shifted.reshape(-1)[self.index]


@torch.no_grad()
def check_packing(model: torch.nn.Module) -> float:
    """That `model` confines attention to each packed sample: the logits of two short samples
    packed into one row (reset position ids, no attention mask, no cache) must equal their logits
    run alone. Call it on the unwrapped model (FSDP2: before `fully_shard`; no collective).

    Returns:
        The largest logit difference, packed vs alone.
    Raises:
        ValueError: if the packed logits of the second sample are off by more than 5 % of what
            ignoring the reset would do to them (and over 1e-4): the model's attention (or its
            transformers version) does not derive segments from position ids, and packing would
            mix samples.
    """
    device = next(model.parameters()).device
    embeddings = cast("PreTrainedModel", model).get_input_embeddings()  # an HF model's (typed nn.Module)
    vocab = int(cast(torch.nn.Embedding, embeddings).num_embeddings)
    a = (torch.arange(5, device=device) * 7 + 3) % vocab
    b = (torch.arange(6, device=device) * 11 + 5) % vocab
    ids = torch.cat([a, b])[None]
    pos = position_ids([5, 6]).to(device)[None]

    def logits(x: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
        return model(input_ids=x, position_ids=p, use_cache=False).logits.float()

    alone = torch.cat([logits(a[None]), logits(b[None])], dim=1)
    err = float((logits(ids, pos) - alone).abs().max())
    ignored = float((logits(ids) - alone)[:, 5:].abs().max())  # the second sample seeing the first
    if err > max(1e-4, 0.05 * ignored):
        raise ValueError(
            f"{type(model).__name__} (attention {getattr(model.config, '_attn_implementation', '?')}) does not "
            f"confine attention to packed samples: their logits differ from unpacked by {err:.3g} (ignoring the "
            f"reset would differ by {ignored:.3g}); set algorithm.packing to false"
        )
    return err
