"""Tiny random models of the architectures users train most, each with its family's tokenizer type.

    python -m asyncrl.tiny_archs --arch qwen3 --out /tmp/tiny-qwen3

`build_tiny_arch(arch, out_dir)` writes a plain Hugging Face directory (config, safetensors,
tokenizer.json with a chat template, generation_config.json with the family's end-of-turn EOS) that
transformers and vLLM both load, so the trainer/vLLM checks run per architecture with no download.
`asyncrl.tiny_model` stays the project's default model (a character-level Llama).

Tokenizers are trained here, on a few lines of text, with the family's pipeline:

- byte-level BPE (Llama 3, Qwen): a GPT-4-style split regex, then bytes mapped to printable
  characters (`ByteLevel`); any text round-trips.
- SentencePiece-style BPE (Mistral, Gemma): spaces become "▁" (`Metaspace`), unknown characters fall
  back to `<0xNN>` byte tokens (`byte_fallback`), which is the tokenizer.json transformers converts a
  SentencePiece model to.
"""

from __future__ import annotations

import argparse
import json
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

MAX_POSITIONS = 256
VOCAB = 512  # tokenizer pieces before the special tokens (byte-level: 256 bytes + merges)

# Llama 3 / GPT-4's pre-tokenizer split (contractions, words, 1-3 digit numbers, punctuation, spaces).
_BYTE_LEVEL_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# What the tokenizers learn their merges from: arithmetic (the demo's task) and some prose.
_CORPUS = [
    "17+25=42",
    "3+4=7",
    "0+19=19",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Answer with the number only.",
    "What is the sum of the two numbers? Think step by step, then answer.",
    "You are a helpful assistant. The user asks a question and you answer it.",
    string.printable,
] * 4 + [f"{a}+{b}={a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)]


@dataclass(frozen=True)
class _Specials:
    """A family's special tokens: ids 0.. in this order; `eos` lists the generation_config EOS ids'
    tokens (end of text and end of turn)."""

    tokens: tuple[str, ...]
    bos: str | None
    eos: tuple[str, ...]
    pad: str
    unk: str | None = None


def byte_level_bpe(specials: _Specials) -> Tokenizer:
    """Llama 3 / Qwen style: split by regex, bytes as printable characters, BPE merges over them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_BYTE_LEVEL_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(specials.tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return tok


def sentencepiece_bpe(specials: _Specials, *, prefix_space: bool) -> Tokenizer:
    """Mistral / Gemma style (SentencePiece BPE as transformers converts it): "▁" for space, a
    leading "▁" on the text when `prefix_space` (SentencePiece's add_dummy_prefix: Mistral yes,
    Gemma no), and `<0x00>`..`<0xFF>` for any character the merges do not cover."""
    scheme = "first" if prefix_space else "never"
    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre
    alphabet = sorted(set("".join(_CORPUS).replace(" ", "▁")) | {"▁"})
    learner.train_from_iterator(
        _CORPUS,
        trainers.BpeTrainer(vocab_size=VOCAB - 256, initial_alphabet=alphabet, show_progress=False),
    )
    learned = json.loads(learner.to_str())["model"]
    # ids: special tokens, then the 256 byte tokens (SentencePiece's order), then the learned pieces
    vocab: dict[str, int] = {t: i for i, t in enumerate(specials.tokens)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=specials.unk, byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre
    strip = [decoders.Strip(" ", 1, 0)] if prefix_space else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    tok.add_special_tokens(list(specials.tokens))
    return tok


def _fast(tok: Tokenizer, specials: _Specials, chat_template: str) -> PreTrainedTokenizerFast:
    if specials.bos is not None:  # encode prepends BOS (Llama, Mistral, Gemma; Qwen has none)
        bos_id = tok.token_to_id(specials.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{specials.bos} $A",
            pair=f"{specials.bos} $A {specials.bos} $B",
            special_tokens=[(specials.bos, bos_id)],
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=specials.bos,
        eos_token=specials.eos[0],
        pad_token=specials.pad,
        unk_token=specials.unk,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = chat_template
    return fast


LLAMA3 = _Specials(
    ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    bos="<|begin_of_text|>",
    eos=("<|eot_id|>", "<|end_of_text|>"),
    pad="<|end_of_text|>",
)
CHATML = _Specials(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos=None, eos=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>"
)
MISTRAL = _Specials(("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), bos="<s>", eos=("</s>",), pad="</s>", unk="<unk>")
GEMMA = _Specials(
    ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
    bos="<bos>",
    eos=("<end_of_turn>", "<eos>"),
    pad="<pad>",
    unk="<unk>",
)

# The families' chat templates, cut to what these checks use (messages and a generation prompt).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# The shape every architecture shares: 2 layers, hidden 128, 4 query heads of 32 over 2 KV heads
# (grouped-query attention, as all these families use).
_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=MAX_POSITIONS,
)


@dataclass(frozen=True)
class Arch:
    """One architecture: its HF model_type, config overrides, tokenizer and chat template."""

    model_type: str
    config: dict[str, Any]
    specials: _Specials
    tokenizer: Callable[[_Specials], Tokenizer]
    chat_template: str
    notes: str


def _sp(prefix_space: bool) -> Callable[[_Specials], Tokenizer]:
    return lambda s: sentencepiece_bpe(s, prefix_space=prefix_space)


# name -> architecture. Sizes are tiny; the features that set each family apart are on.
ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch(
        "llama",
        {"tie_word_embeddings": False},
        LLAMA3,
        byte_level_bpe,
        LLAMA3_TEMPLATE,
        "Llama 3 layout, byte-level BPE",
    ),
    "qwen2": Arch(
        "qwen2",
        {"tie_word_embeddings": True},
        CHATML,
        byte_level_bpe,
        CHATML_TEMPLATE,
        "tied embeddings, q/k/v bias, byte-level BPE, ChatML",
    ),
    "qwen3": Arch(
        "qwen3",
        {"tie_word_embeddings": True},
        CHATML,
        byte_level_bpe,
        CHATML_TEMPLATE,
        "q/k RMSNorm, tied embeddings, byte-level BPE",
    ),
    "mistral": Arch(
        "mistral",
        {"tie_word_embeddings": False, "sliding_window": None},
        MISTRAL,
        _sp(True),
        MISTRAL_TEMPLATE,
        "SentencePiece-style BPE with byte fallback, [INST] template",
    ),
    "gemma2": Arch(
        "gemma2",
        {"tie_word_embeddings": True, "sliding_window": 16, "query_pre_attn_scalar": 32},
        GEMMA,
        _sp(False),
        GEMMA_TEMPLATE,
        "logit and attention soft-capping, local/global layers (window 16), SentencePiece-style BPE",
    ),
    "gemma3": Arch(
        "gemma3_text",
        {
            "tie_word_embeddings": True,
            "sliding_window": 16,
            "query_pre_attn_scalar": 32,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        GEMMA,
        _sp(False),
        GEMMA_TEMPLATE,
        "q/k RMSNorm, local/global layers (window 16), SentencePiece-style BPE",
    ),
    "qwen3_moe": Arch(
        "qwen3_moe",
        {"tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
        CHATML,
        byte_level_bpe,
        CHATML_TEMPLATE,
        "mixture of experts (4 experts, top 2), byte-level BPE",
    ),
    "mixtral": Arch(
        "mixtral",
        {"tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
        MISTRAL,
        _sp(True),
        MISTRAL_TEMPLATE,
        "mixture of experts (4 experts, top 2), SentencePiece-style BPE",
    ),
}


def arch_spec(name: str) -> Arch:
    """The architecture `name`. Raises KeyError listing the valid names."""
    if name not in ARCHITECTURES:
        raise KeyError(f"unknown architecture '{name}'; valid: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def build_tiny_arch(arch: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a random-init float32 model of architecture `arch` (a key of ARCHITECTURES), its
    tokenizer (with chat template) and generation config (EOS: the family's end-of-turn and
    end-of-text tokens) to `out_dir`; returns it as a Path."""
    spec = arch_spec(arch)
    tok = _fast(spec.tokenizer(spec.specials), spec.specials, spec.chat_template)
    ids = {t: tok.convert_tokens_to_ids(t) for t in spec.specials.tokens}
    eos = [ids[t] for t in spec.specials.eos]
    bos = ids[spec.specials.bos] if spec.specials.bos is not None else None
    config = AutoConfig.for_model(
        spec.model_type,
        vocab_size=len(tok),
        bos_token_id=bos if bos is not None else eos[-1],
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=ids[spec.specials.pad],
        dtype="float32",
        **{**_SHAPE, **spec.config},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=ids[spec.specials.pad])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", required=True, choices=sorted(ARCHITECTURES))
    p.add_argument("--out", required=True, type=Path, help="directory to write")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = build_tiny_arch(a.arch, a.out, seed=a.seed)
    n = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(out).parameters())
    print(f"wrote {out} ({a.arch}, {n:,} parameters)")


if __name__ == "__main__":
    main()
