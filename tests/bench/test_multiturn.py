"""bench.multiturn's warm start teaches exactly the ids an episode holds."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from asyncrl.tiny_model import build_tiny_model
from bench.multiturn import teacher_episodes


def test_teacher_episodes_are_laid_out_as_the_generator_plays_them(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", layers=1, hidden=32, heads=2, intermediate=64)
    tok = AutoTokenizer.from_pretrained(model)
    rows = [{"question": "1234+4321=", "target": "5555"}]
    [(prompt, ids, mask)] = teacher_episodes(model, rows, share=1.0, seed=0)
    assert prompt == tok("1234+4321=")["input_ids"]  # BOS first, as the engine tokenizes a text prompt
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1234+4321"}}</tool_call>'
    reply = "\n<tool_response>\n5555\n</tool_response>\n"
    eos = tok.eos_token_id
    want = [
        *tok(call, add_special_tokens=False)["input_ids"],
        eos,
        *tok(reply, add_special_tokens=False)["input_ids"],
        *tok("5555", add_special_tokens=False)["input_ids"],
        eos,
    ]
    assert ids == want
    n_call, n_reply = len(call) + 1, len(reply)  # one token per character, plus EOS
    assert mask == [1] * n_call + [0] * n_reply + [1] * 5  # the tool's reply carries no loss
    [(_, direct, direct_mask)] = teacher_episodes(model, rows, share=0.0, seed=0)
    assert direct == [*tok("5555", add_special_tokens=False)["input_ids"], eos] and direct_mask == [1] * 5
