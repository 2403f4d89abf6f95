"""Build a tiny randomly initialised Llama with a character-level tokenizer.

The checkpoint is a plain Hugging Face directory (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json`` ...) that both transformers and vLLM load, so
the whole system can run end to end on a CPU with no model download.

    python -m asyncrl.tiny_model --out /tmp/tiny [--layers 2 --hidden 128 --heads 4 \
        --intermediate 256 --seed 0]

Tokenizer contract: every printable ASCII character (``string.printable``, including space,
tab and newline) is one token; ``encode`` prepends ``<s>``; completions end with ``</s>``;
``decode(encode(s)) == s`` for any such text.
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # ids 0..3
CHARS = string.printable  # 100 characters: digits, letters, punctuation, whitespace
MAX_POSITIONS = 256
# A chat template in the usual shape (role headers, a generation prompt), in characters this
# tokenizer has: for tests of chat-templated prompts (`--chat-template`).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer: 4 special tokens then one token per printable character."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own piece; whitespace is kept as a token, not dropped.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    # Decoding maps special tokens to "" (so decode(encode(s)) == s even though encode adds
    # <s>) and joins characters with nothing in between. Replace acts on whole tokens, so the
    # literal text "<s>", three character tokens, survives.
    tok.decoder = decoders.Sequence([decoders.Replace(t, "") for t in (PAD, BOS, EOS)] + [decoders.Fuse()])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        # Literal "<s>" in text stays three characters, so any printable text round-trips.
        split_special_tokens=True,
        model_max_length=MAX_POSITIONS,
    )


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    """The id of one token the tokenizer knows."""
    i = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(i, int):
        raise TypeError(f"{token!r} is not one token of the tiny tokenizer")
    return i


def build_tiny_model(
    out_dir: str | Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    intermediate: int = 256,
    seed: int = 0,
    chat_template: str | None = None,
) -> Path:
    """Write a random-init fp32 ``LlamaForCausalLM`` and its tokenizer to ``out_dir``.

    Args:
        out_dir: created if missing; existing files of the same names are overwritten.
        layers, hidden, heads, intermediate: Llama shape; ``hidden`` must divide by ``heads``.
        seed: fixes the initial weights.

    Returns:
        ``out_dir`` as a Path.
    """
    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    ids = {t: _token_id(tokenizer, t) for t in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="directory to write")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", action="store_true", help="give the tokenizer a chat template (CHAT_TEMPLATE)")
    a = p.parse_args(argv)
    out = build_tiny_model(
        a.out,
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        intermediate=a.intermediate,
        seed=a.seed,
        chat_template=CHAT_TEMPLATE if a.chat_template else None,
    )
    n = sum(t.numel() for t in LlamaForCausalLM.from_pretrained(out).parameters())
    print(f"wrote {out} ({n:,} parameters)")


if __name__ == "__main__":
    main()
