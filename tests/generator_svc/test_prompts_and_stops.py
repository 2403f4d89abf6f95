"""Chat-templated prompts and stop rules through the real vLLM CPU engine: the engine generates
from exactly the ids the feeder rendered (what the trainer trains on), and a stop string ends the
completion the reward sees."""

from __future__ import annotations

import pytest

from shared.prompts import renderer, uses_chat
from shared.schema import SamplingParams
from shared.tasks import Problem

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from asyncrl.tiny_model import CHAT_TEMPLATE, build_tiny_model

    return str(
        build_tiny_model(
            tmp_path_factory.mktemp("chat"), layers=1, hidden=64, heads=2, intermediate=128, chat_template=CHAT_TEMPLATE
        )
    )


def test_rendered_ids_are_what_the_engine_generates_from_and_stops_end_the_text(chat_model: str) -> None:
    from transformers import AutoTokenizer

    from generator_svc.engine import Engine

    tok = AutoTokenizer.from_pretrained(chat_model)  # the trainer's tokenizer, from the model directory
    assert uses_chat(tok, "auto")
    problem = Problem(
        0, "12+3=", "15", messages=({"role": "system", "content": "Answer."}, {"role": "user", "content": "12+3="})
    )
    rendered = renderer(tok)(problem)
    assert rendered.text == "<|system|>Answer.\n<|user|>12+3=\n<|assistant|>"
    assert rendered.ids == tok(rendered.text, add_special_tokens=False)["input_ids"]  # the template holds the specials
    engine = Engine(chat_model, max_model_len=128)
    try:
        # The random model emits every character often: stopping at "e" or "\n" happens quickly.
        stop = SamplingParams(temperature=1.0, max_tokens=60, seed=1, stop=["e", "\n"])
        keep = stop.model_copy(update={"include_stop_str_in_output": True})
        plain = SamplingParams(temperature=1.0, max_tokens=60, seed=1)
        (a, b, c) = engine.generate([rendered.ids] * 3, [stop, keep, plain], [8, 8, 8])
        for s in a + b + c:
            assert s.prompt_ids == rendered.ids  # generated from exactly the rendered ids
            assert len(s.logprobs) == len(s.completion_ids)
        stopped = [s for s in a if s.finish_reason == "stop"]
        assert stopped, [s.text for s in a]
        for s in a:
            assert "e" not in s.text and "\n" not in s.text  # the text the reward sees ends before the stop
        assert any(s.text.endswith(("e", "\n")) for s in b if s.finish_reason == "stop")
        assert any(("e" in s.text or "\n" in s.text) for s in c)  # without stops the same sampler runs past them
        # min_tokens: no stop before 5 tokens
        (d,) = engine.generate([rendered.ids], [stop.model_copy(update={"min_tokens": 5})], [8])
        assert all(len(s.completion_ids) >= 5 for s in d)
    finally:
        engine.close()


def test_seeded_requests_past_one_engine_steps_token_budget(chat_model: str) -> None:
    """64 seeded prompts of 150 tokens (9,600 prefill tokens, over the 4,096 of one engine step):
    vLLM's CPU runner crashed ("CPU Generator does not use offset") when a seeded request's prefill
    was split across steps; the engine runs unchunked prefill on CPU. Seeds still reproduce."""
    from generator_svc.engine import Engine

    prompts = [[1] + [10 + (i + j) % 50 for j in range(150)] for i in range(64)]
    engine = Engine(chat_model, max_model_len=256)
    try:
        params = [SamplingParams(temperature=1.0, max_tokens=8, seed=i) for i in range(64)]
        first = engine.generate(prompts, params, [1] * 64)
        again = engine.generate(prompts[:2], params[:2], [1, 1])
        assert [g[0].completion_ids for g in first[:2]] == [g[0].completion_ids for g in again]
    finally:
        engine.close()
