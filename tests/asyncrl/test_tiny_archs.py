"""asyncrl.tiny_archs: each architecture's checkpoint loads in transformers as its family's class,
with the family's tokenizer type (round-trip, byte fallback), chat template and EOS ids; and the
default LoRA targets are found on every dense family (trainer_svc/lora.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from asyncrl.tiny_archs import ARCHITECTURES, arch_spec, build_tiny_arch  # noqa: E402

CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# what each family's chat template puts before the first user message's text
TEMPLATE_HEAD = {
    "llama": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n",
    "qwen2": "<|im_start|>user\n",
    "mistral": "<s>[INST] ",
    "gemma2": "<bos><start_of_turn>user\n",
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {a: build_tiny_arch(a, root / a) for a in ARCHITECTURES}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_checkpoint_class_tokenizer_and_eos(arch: str, built: dict[str, Path]) -> None:
    d = built[arch]
    assert set(CLASSES) == set(ARCHITECTURES)
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert type(model).__name__ == CLASSES[arch]
    assert model.config.vocab_size == len(tok)
    text = "Hello, world! 17+25=42\n\tnaïve €"  # "ï" and "€" are in no merge: bytes (or byte tokens)
    ids = tok(text).input_ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    pieces = tok.convert_ids_to_tokens(ids)
    spec = arch_spec(arch)
    if spec.tokenizer.__name__ == "byte_level_bpe":
        assert "Ġ" in "".join(pieces) and "â" in "".join(pieces)  # bytes as characters: space "Ġ", 0xE2 "â"
    else:
        assert "<0xE2>" in pieces and any(p.startswith("▁") for p in pieces)  # "€" = E2 82 AC; "▁" for space
    # a BOS only where the family has one (Qwen has none)
    assert (ids[0] == tok.bos_token_id) == (spec.specials.bos is not None)
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    assert tok.convert_ids_to_tokens(eos) == list(spec.specials.eos)
    chat = tok.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True, tokenize=False)
    head = next((h for a, h in TEMPLATE_HEAD.items() if arch_spec(a).chat_template == spec.chat_template), None)
    assert head is not None and chat.startswith(head + "3+4=")


def test_same_seed_same_weights(tmp_path: Path, built: dict[str, Path]) -> None:
    a = transformers.AutoModelForCausalLM.from_pretrained(built["qwen3"]).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(build_tiny_arch("qwen3", tmp_path / "again")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_architecture_lists_the_valid_ones() -> None:
    with pytest.raises(KeyError, match="valid: .*'qwen3'"):
        arch_spec("gpt2")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_default_lora_targets_found(arch: str, built: dict[str, Path]) -> None:
    from shared.jobspec import LoraSpec
    from trainer_svc import lora

    spec = LoraSpec()
    peft = lora.wrap(transformers.AutoModelForCausalLM.from_pretrained(built[arch]), spec)
    layers = transformers.AutoConfig.from_pretrained(built[arch]).num_hidden_layers
    assert lora.targets_found(peft, spec.target_modules) == {t: layers for t in spec.target_modules}


def test_a_target_the_model_lacks_is_named(built: dict[str, Path]) -> None:
    from shared.jobspec import LoraSpec
    from trainer_svc import lora

    model = transformers.AutoModelForCausalLM.from_pretrained(built["llama"])
    with pytest.raises(ValueError, match=r"\['w1'\] match no linear layer.*'q_proj'"):
        lora.wrap(model, LoraSpec(target_modules=["q_proj", "w1"]))
