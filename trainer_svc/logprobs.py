"""Per-token log-probabilities of completions under a causal LM.

Layout (right padding, one row per sequence ``prompt + completion``)::

    input_ids        p0 p1 p2 c0 c1 PAD      (B, L)
    attention_mask    1  1  1  1  1  0       (B, L)
    shifted logprobs  .  .  c0 c1 PAD        (B, L-1): position t scores token t+1
    completion_mask   0  0  1  1  0          (B, L-1)

Right padding leaves every real token's position id and causal context exactly as in an
unpadded forward pass, so the results do not depend on what else is in the batch.

The distribution scored is the sampler's: logits / temperature, cut to the top-k tokens, then to
the top-p nucleus of what is left, renormalised (`truncate`; ARCHITECTURE.md "The behaviour
policy" says why and what the loss then optimises).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.utils.checkpoint


def pad_batch(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate and right-pad prompt + completion token ids.

    Args:
        prompt_ids: B non-empty lists of prompt token ids.
        completion_ids: B lists of completion token ids (may be empty).
        pad_id: filler id; padded positions are masked out, so any valid id works.

    Returns:
        ``input_ids`` (B, L) long, ``attention_mask`` (B, L) long, and ``completion_mask``
        (B, L-1) float, 1.0 where the shifted logprob at t scores a completion token t+1.
        ``L`` is the longest prompt + completion.

    Raises:
        ValueError: on mismatched batch sizes, an empty batch or an empty prompt.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if not prompt_ids:
        raise ValueError("empty batch")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (e.g. BOS) to condition on")
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    b, seq_len = len(lengths), max(lengths)
    input_ids = torch.full((b, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, seq_len), dtype=torch.long)
    completion_mask = torch.zeros((b, max(seq_len - 1, 0)), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor([*p, *c], dtype=torch.long)
        attention_mask[i, :n] = 1
        # Token j (j in [len(p), n)) is scored at shifted position j - 1.
        completion_mask[i, len(p) - 1 : n - 1] = 1.0
    return input_ids, attention_mask, completion_mask


def _temperature(temperature: float | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(temperature, dtype=torch.float32)
    if bool((t <= 0).any()):
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return t


def _divide(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """logits (B, n, V) / temperature: a scalar, one per row (B,), or one per position (B, n)
    (packed rows: each sample's positions at its own temperature)."""
    if t.ndim == 2:
        return logits / t.to(logits.device).unsqueeze(-1)
    return logits / (t.to(logits.device).view(-1, 1, 1) if t.ndim else t.item())


@torch.no_grad()
def dropped(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The tokens the sampler cannot draw, as vLLM's sampler decides (v1/sample/ops/
    topk_topp_sampler.py `apply_top_k_top_p_pytorch`, the path of its CPU and native samplers):

    - top-k: every token whose scaled logit is below the k-th largest is out; a tie with the
      k-th largest stays in (more than k tokens then);
    - top-p, on what top-k left, renormalised: tokens sorted by ascending logit, a token is out
      when the cumulative probability up to and including it is <= 1 - p (float32, as vLLM);
      the most likely token always stays. So a token stays iff the mass of the tokens sorted
      above it is < p: the nucleus is the smallest top set whose mass reaches p.

    Args:
        logits: (B, n, V) float32, already divided by the temperature.
        top_k: (B, n) int; 0, or >= V, keeps every token.
        top_p: (B, n) float32 in (0, 1]; 1 keeps every token top-k kept.

    Returns:
        (B, n, V) bool, True where the token is out.
    """
    v = logits.shape[-1]
    k = top_k.to(device=logits.device, dtype=torch.long)
    k = torch.where((k <= 0) | (k >= v), v, k)
    p = top_p.to(device=logits.device, dtype=torch.float32)
    if not bool((p < 1).any()):  # top-k alone: the k-th largest by topk, no sort of the vocabulary
        every = k >= v  # these rows keep every token: threshold -inf
        k = torch.where(every, 1, k)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).unsqueeze(-1))
        return logits < kth.masked_fill(every.unsqueeze(-1), float("-inf"))
    ascending, order = logits.sort(dim=-1)
    out = ascending < ascending.gather(-1, (v - k).unsqueeze(-1))  # top-k (k = V: nothing is below the least)
    cumulative = ascending.masked_fill(out, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
    out |= cumulative <= (1 - p).unsqueeze(-1)
    out[..., -1] = False
    return torch.zeros_like(out).scatter_(-1, order, out)


def truncate(logits: torch.Tensor, targets: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`logits` (B, n, V) with the tokens the sampler could not draw (`dropped`) at -inf: a
    softmax over them is the sampler's renormalised distribution. The token at `targets` (B, n, 1),
    the one sampled, always stays: where the trainer's own cut leaves it out (a token at the
    nucleus boundary that float rounding puts on the other side, or a stale sample's token the
    current policy would no longer draw) its logprob is taken over the cut plus it, finite,
    rather than -inf. Gradients flow to the kept logits only; the cut itself is a constant."""
    out = dropped(logits.detach(), top_k, top_p)
    out.scatter_(-1, targets, False)
    return logits.masked_fill(out, float("-inf"))


def _cut(top_k: int | torch.Tensor, top_p: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """top_k and top_p as tensors (scalar, per row or per position), or None when nothing cuts:
    the untruncated path then pays no sort."""
    k = torch.as_tensor(top_k, dtype=torch.long)
    p = torch.as_tensor(top_p, dtype=torch.float32)
    if bool((k < 0).any()):
        raise ValueError(f"top_k must be >= 0 (0: none), got {top_k}")
    if bool(((p <= 0) | (p > 1)).any()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not (bool((k > 0).any()) or bool((p < 1).any())):
        return None
    return k, p


def _expand(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A scalar, per-row (B,) or per-position (B, n) knob as (B, n)."""
    if x.ndim == 2:
        return x
    return (x.view(-1, 1) if x.ndim == 1 else x).expand(shape)


def _span(x: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """Positions [s, e) of a per-position (B, L-1) knob; a scalar or per-row one as it is."""
    return x[:, s:e] if x.ndim == 2 else x


def _forward(model, input_ids, attention_mask, position_ids, **kwargs):
    """The model's forward; with `position_ids` (packed rows, trainer_svc/packing.py) no attention
    mask and no cache, so transformers derives the per-sample attention from the position ids."""
    if position_ids is None:
        return model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)


def _scaled_logits(
    model, input_ids, attention_mask, temperature: float | torch.Tensor, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """logits[:, :-1] / temperature, in float32; temperature a scalar, per row (B,) or per
    position (B, L-1)."""
    t = _temperature(temperature)
    logits = _forward(model, input_ids, attention_mask, position_ids).logits[:, :-1].float()
    return _divide(logits, t)  # (B, L-1, V)


def _logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    entropy: bool,
    entropy_grad: bool,
    cut: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs (B, n) of `targets` (B, n, 1) and optionally the entropy (B, n) from
    scaled float32 logits (B, n, V), both of the distribution `cut` (top_k, top_p: `truncate`)
    leaves; the entropy keeps its graph only with `entropy_grad`."""
    if cut is not None:
        shape = logits.shape[:2]
        logits = truncate(logits, targets, _expand(cut[0], shape), _expand(cut[1], shape))
    lse = torch.logsumexp(logits, dim=-1)  # (B, n)
    # gather - logsumexp avoids materialising a second (B, n, V) log_softmax tensor.
    logprobs = logits.gather(-1, targets).squeeze(-1) - lse
    if not entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        z, m = (logits, lse) if entropy_grad else (logits.detach(), lse.detach())
        # a cut token has probability 0 and contributes 0 (0 x -inf would be NaN)
        zp = z if cut is None else z.masked_fill(torch.isneginf(z), 0.0)
        ent = m - (torch.exp(z - m.unsqueeze(-1)) * zp).sum(dim=-1)
    return logprobs, ent


def _chunkable(model: torch.nn.Module) -> bool:
    """Whether the chunked path applies: an HF causal LM with a linear output head, and unsharded
    (FSDP2's DTensor parameters would be used outside the module's forward: not done)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if not isinstance(head, torch.nn.Linear):
        return False
    return not any(type(p).__name__ == "DTensor" for p in model.parameters())


def _chunked(
    model,
    input_ids,
    attention_mask,
    temperature,
    chunk: int,
    entropy: bool,
    entropy_grad: bool,
    position_ids: torch.Tensor | None = None,
    cut: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`_logprobs_entropy` without full-vocabulary logits for the whole sequence: the final hidden
    states once, then the head, log-softmax and gather over `chunk` positions at a time; with
    autograd each chunk is checkpointed (its (B, chunk, V) logits are recomputed in the backward,
    not kept). None when the model's logits are not its head applied to its last hidden state (a
    logit scale or soft-cap, checked at the last position): use the full path then."""
    t = _temperature(temperature)
    # logits_to_keep=1: the head runs on the last position only, the check below.
    out = _forward(model, input_ids, attention_mask, position_ids, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1]  # (B, L, H), after the final norm
    head = model.get_output_embeddings()
    with torch.no_grad():
        if not torch.allclose(head(hidden[:, -1:]).float(), out.logits[:, -1:].float(), rtol=1e-5, atol=1e-5):
            return None
    hidden = hidden[:, :-1]
    targets = input_ids[:, 1:].unsqueeze(-1)  # (B, L-1, 1)

    def piece(
        h: torch.Tensor, tgt: torch.Tensor, tc: torch.Tensor, cc: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = _logprobs_entropy(_divide(head(h).float(), tc), tgt, entropy, entropy_grad, cc)
        return lp, (ent if ent is not None else lp.new_zeros(()))

    grad = torch.is_grad_enabled()
    lps, ents = [], []
    for s in range(0, hidden.shape[1], chunk):
        e = s + chunk
        h, tgt = hidden[:, s:e], targets[:, s:e]
        tc = _span(t, s, e)  # per-position temperatures and cuts follow the chunk
        cc = None if cut is None else (_span(cut[0], s, e), _span(cut[1], s, e))
        if grad:
            lp, ent = torch.utils.checkpoint.checkpoint(piece, h, tgt, tc, cc, use_reentrant=False)
        else:
            lp, ent = piece(h, tgt, tc, cc)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps, dim=1), (torch.cat(ents, dim=1) if entropy else None)


def _compute(
    model,
    input_ids,
    attention_mask,
    temperature,
    chunk_tokens: int,
    entropy: bool,
    entropy_grad: bool,
    position_ids: torch.Tensor | None = None,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
    cut = _cut(top_k, top_p)
    if chunk_tokens and _chunkable(model):
        got = _chunked(
            model, input_ids, attention_mask, temperature, chunk_tokens, entropy, entropy_grad, position_ids, cut
        )
        if got is not None:
            return got
    logits = _scaled_logits(model, input_ids, attention_mask, temperature, position_ids)
    return _logprobs_entropy(logits, input_ids[:, 1:].unsqueeze(-1), entropy, entropy_grad, cut)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    temperature: float | torch.Tensor = 1.0,
    chunk_tokens: int = 0,
    position_ids: torch.Tensor | None = None,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Log-probability of each next token under the sampler's distribution: ``log
    softmax(logits_t / temperature)[x_{t+1}]``, over the top-k / top-p cut when one is given
    (`truncate`).

    One forward pass; gradients flow (wrap in ``torch.no_grad()`` to score only).

    Args:
        model: a causal LM returning ``.logits`` (B, L, V).
        input_ids: (B, L) long, right-padded.
        attention_mask: (B, L), 1 for real tokens; ignored with `position_ids`.
        temperature: > 0; the sampler's temperature, so these match the behaviour policy. A
            scalar, or one per row (B,) when samples were drawn at different temperatures, or one
            per shifted position (B, L-1) for packed rows.
        chunk_tokens: > 0: the head and log-softmax over this many positions at a time, each
            chunk checkpointed, so no (B, L-1, V) float32 logits exist at once, in the forward nor
            kept for the backward (same values and gradients; the backward recomputes each
            chunk's head). 0: the model's full logits. Unsharded HF models with a linear head
            only; others take the full path.
        position_ids: (B, L) for packed rows (trainer_svc/packing.py): several samples back to
            back, positions restarting at 0 for each; the forward then passes no attention mask
            and no cache, and the model confines attention to each sample.
        top_k: the sampler's top-k (0: none), scalar, per row or per position like `temperature`.
        top_p: the sampler's top-p (1.0: none), likewise. Where some row cuts, the logits of each
            (chunk of) positions are sorted once more (`dropped`); otherwise nothing is added.

    Returns:
        (B, L-1) float32; entries at padding are meaningless, mask them with ``completion_mask``.
    """
    return _compute(
        model, input_ids, attention_mask, temperature, chunk_tokens, False, False, position_ids, top_k, top_p
    )[0]


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    temperature: float | torch.Tensor = 1.0,
    entropy_grad: bool = False,
    chunk_tokens: int = 0,
    position_ids: torch.Tensor | None = None,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` plus the entropy of each next-token distribution, from one forward pass.

    The entropy is that of the distribution the sampler draws from, ``softmax(z_t)``:
    ``H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_tv`` with ``z_t = logits_t / T`` and the
    tokens the top-k / top-p cut leaves out at -inf (probability 0, no term). As a metric
    it is computed without grad (no (B, L-1, V) activations kept for backward); `entropy_grad`
    keeps its graph, for the entropy bonus (one more (B, L-1, V) tensor held for backward, unless
    chunked: `chunk_tokens`).

    Args:
        model: a causal LM returning ``.logits`` (B, L, V).
        input_ids: (B, L) long, right-padded.
        attention_mask: (B, L), 1 for real tokens; ignored with `position_ids`.
        temperature: > 0, scalar, per row or per position, as in `token_logprobs`.
        entropy_grad: whether the entropy keeps its graph (gradients flow through it).
        chunk_tokens: as in `token_logprobs` (0: unchunked).
        position_ids: packed rows, as in `token_logprobs`.
        top_k, top_p: the sampler's cut, as in `token_logprobs`.

    Returns:
        ``logprobs`` (B, L-1) float32 with grad as in `token_logprobs`, and ``entropy`` (B, L-1)
        float32 in nats, detached unless `entropy_grad`; both meaningless at padding (mask with
        ``completion_mask``).
    """
    logprobs, entropy = _compute(
        model, input_ids, attention_mask, temperature, chunk_tokens, True, entropy_grad, position_ids, top_k, top_p
    )
    assert entropy is not None
    return logprobs, entropy


def sequence_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    pad_id: int = 0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[torch.Tensor]:
    """Log-probability of each completion token given the prompt and the earlier completion.

    Args:
        model: a causal LM (its device is used).
        prompt_ids: B non-empty token id lists.
        completion_ids: B token id lists.
        temperature: logits are divided by it before the softmax.
        top_k, top_p: the sampler's cut (`truncate`); 0 and 1.0: none.
        pad_id: filler for padding (masked, so its value does not change the result).

    Returns:
        B float32 tensors; the i-th has shape (len(completion_ids[i]),).
    """
    input_ids, attention_mask, completion_mask = pad_batch(prompt_ids, completion_ids, pad_id)
    device = next(model.parameters()).device
    logprobs = token_logprobs(
        model, input_ids.to(device), attention_mask.to(device), temperature, top_k=top_k, top_p=top_p
    )  # (B, L-1)
    mask = completion_mask.to(device).bool()
    return [row[m] for row, m in zip(logprobs, mask, strict=True)]
