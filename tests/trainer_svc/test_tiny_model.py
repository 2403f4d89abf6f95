"""asyncrl.tiny_model, trainer_svc.logprobs and a warm-start smoke run, on CPU."""

from __future__ import annotations

import random
import string
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from asyncrl.tiny_model import BOS, EOS, PAD, build_tiny_model  # noqa: E402
from trainer_svc.logprobs import pad_batch, sequence_logprobs, token_logprobs  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tok(tiny_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir: Path):
    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


# --- checkpoint and tokenizer ---------------------------------------------------------------


def test_checkpoint_files_and_config(tiny_dir: Path, model, tok) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tiny_dir / name).is_file(), name
    cfg = model.config
    assert cfg.model_type == "llama"
    assert model.dtype == torch.float32
    assert cfg.vocab_size == len(tok) == 104
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.convert_tokens_to_ids(BOS),
        tok.convert_tokens_to_ids(EOS),
        tok.convert_tokens_to_ids(PAD),
    )
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    assert cfg.max_position_embeddings == 256


def test_param_count_in_range(model) -> None:
    n = sum(p.numel() for p in model.parameters())
    assert 200_000 <= n <= 5_000_000, n


def test_same_seed_same_weights(tmp_path: Path, model) -> None:
    again = transformers.AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "a"))
    other = transformers.AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "b", seed=1))
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(again.state_dict()[w], model.state_dict()[w])
    assert not torch.equal(other.state_dict()[w], model.state_dict()[w])


def test_rejects_heads_not_dividing_hidden(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of heads"):
        build_tiny_model(tmp_path / "x", hidden=130, heads=4)


def test_tokenizer_one_token_per_char_with_bos(tok) -> None:
    ids = tok.encode("17+25=")
    assert ids[0] == tok.bos_token_id
    assert tok.convert_ids_to_tokens(ids[1:]) == list("17+25=")
    assert tok.encode("42", add_special_tokens=False) == tok.convert_tokens_to_ids(["4", "2"])


@pytest.mark.parametrize(
    "text",
    [
        string.printable,
        "  leading and trailing  ",
        "a  b\tc\nd",
        "<s>literal specials</s><pad><unk>",
        "",
    ],
)
def test_tokenizer_round_trip(tok, text: str) -> None:
    ids = tok.encode(text)
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_round_trip_random_text(tok) -> None:
    rng = random.Random(0)
    for _ in range(50):
        text = "".join(rng.choices(string.printable, k=rng.randint(1, 60)))
        assert tok.decode(tok.encode(text)) == text


def test_decode_drops_eos_and_pad(tok) -> None:
    ids = [*tok.encode("7"), tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids) == "7"


# --- pad_batch ------------------------------------------------------------------------------


def test_pad_batch_hand_example() -> None:
    # Row 0: prompt [1, 5], completion [7]  -> tokens 1 5 7 .  ; 7 is scored at shifted pos 1.
    # Row 1: prompt [1], completion [8 9 2] -> tokens 1 8 9 2  ; 8 9 2 at shifted pos 0, 1, 2.
    input_ids, attention_mask, completion_mask = pad_batch([[1, 5], [1]], [[7], [8, 9, 2]], 0)
    assert input_ids.tolist() == [[1, 5, 7, 0], [1, 8, 9, 2]]
    assert attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert completion_mask.tolist() == [[0, 1, 0], [1, 1, 1]]
    assert completion_mask.dtype == torch.float32


def test_pad_batch_errors() -> None:
    with pytest.raises(ValueError, match="2 prompts but 1"):
        pad_batch([[1], [1]], [[2]], 0)
    with pytest.raises(ValueError, match="empty batch"):
        pad_batch([], [], 0)
    with pytest.raises(ValueError, match="at least one token"):
        pad_batch([[]], [[2]], 0)


# --- sequence_logprobs ----------------------------------------------------------------------


def _naive_logprobs(model, prompt: list[int], completion: list[int], temperature: float):
    """One unpadded sequence at a time: log softmax(logits / T) at each completion position."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0] / temperature  # (L, V)
    logp = torch.log_softmax(logits, dim=-1)
    return (
        torch.stack([logp[len(prompt) + j - 1, t] for j, t in enumerate(completion)]) if completion else torch.zeros(0)
    )


def _random_batch(seed: int, n: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(4, 104) for _ in range(rng.randint(0, 12))] for _ in range(n)]
    comps = [[rng.randrange(0, 104) for _ in range(rng.randint(0, 9))] for _ in range(n)]
    comps[0] = comps[0] or [2]  # at least one scored token
    return prompts, comps


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sequence_logprobs_matches_naive_loop(model, temperature: float) -> None:
    prompts, comps = _random_batch(0, 6)
    with torch.no_grad():
        batched = sequence_logprobs(model, prompts, comps, temperature=temperature)
    assert [t.shape for t in batched] == [torch.Size([len(c)]) for c in comps]
    for got, p, c in zip(batched, prompts, comps, strict=True):
        torch.testing.assert_close(got, _naive_logprobs(model, p, c, temperature), atol=1e-5, rtol=0)


def test_padding_does_not_change_results(model) -> None:
    prompts, comps = _random_batch(1, 4)
    long_prompt, long_comp = [1] + list(range(4, 40)), list(range(40, 80))
    with torch.no_grad():
        alone = sequence_logprobs(model, prompts, comps)
        padded = sequence_logprobs(model, [*prompts, long_prompt], [*comps, long_comp], pad_id=3)
    for a, b in zip(alone, padded[:-1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_logprobs_carry_gradients(model) -> None:
    input_ids, attention_mask, mask = pad_batch([[1, 5, 6], [1]], [[7, 2], [9]], 0)
    logprobs = token_logprobs(model, input_ids, attention_mask)  # (B, L-1)
    assert logprobs.shape == mask.shape == (2, 4)
    assert (logprobs <= 0).all()
    (logprobs * mask).sum().backward()
    grad = model.model.embed_tokens.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_temperature_must_be_positive(model) -> None:
    with pytest.raises(ValueError, match="temperature"):
        sequence_logprobs(model, [[1]], [[2]], temperature=0.0)


# --- warm start -----------------------------------------------------------------------------


def test_teacher_answer() -> None:
    from asyncrl.warmstart import teacher_answer

    rng = random.Random(0)
    assert {teacher_answer("41", 1.0, rng) for _ in range(5)} == {"42"}
    assert {teacher_answer("41", 0.0, rng) for _ in range(5)} == {"41"}
    assert teacher_answer("-1", 1.0, rng) == "0"
    assert teacher_answer("3.5", 1.0, rng) == "3.5"  # only integers get the off-by-one
    got = [teacher_answer("9", 0.7, rng) for _ in range(2000)]
    assert 0.65 < got.count("10") / len(got) < 0.75


@pytest.mark.slow
def test_warm_start_smoke(tiny_dir: Path, tmp_path: Path) -> None:
    from asyncrl.warmstart import warm_start

    out = tmp_path / "warm"
    metrics = warm_start(tiny_dir, out, steps=5, n_train=50, n_test=10, seed=0)
    assert set(metrics) >= {"greedy_acc", "pass_at_8", "sample_acc", "final_loss", "seconds"}
    assert all(0.0 <= metrics[k] <= 1.0 for k in ("greedy_acc", "pass_at_8", "sample_acc"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    before = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    w = "lm_head.weight"
    assert not torch.equal(reloaded.state_dict()[w], before.state_dict()[w]), "params did not move"
    assert transformers.AutoTokenizer.from_pretrained(out).decode([1, 8, 2]) == "4"
