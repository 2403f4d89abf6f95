"""Every problem is rendered once before a job trains (shared.prompts.usable): a row the chat
template refuses or the tokenizer cannot encode is a bad row (named, or dropped and counted); a
chat template that loops, builds a huge string or a huge output breaks a limit and fails the load
with the reason (the template runs in a child process with a time, output and memory limit:
shared/chat_render.py), where it used to hang the trainer at step 0 or get it OOM-killed."""

from __future__ import annotations

import logging
import time

import pytest

from asyncrl.tiny_model import CHAT_TEMPLATE, build_tokenizer
from shared.datasets import DatasetError
from shared.prompts import Renderer, RenderLimits, TemplateLimitError, renderer, usable
from shared.tasks import Problem

pytestmark = pytest.mark.hostile

LIMITS = RenderLimits(timeout_s=0.5, max_chars=100_000, memory_bytes=256 << 20)


def _problems(n: int) -> list[Problem]:
    return [Problem(i, f"{i}+1=", str(i + 1), origin=f"d.jsonl line {i + 1}") for i in range(n)]


def _chat(template: str) -> Renderer:
    tok = build_tokenizer()
    tok.chat_template = template
    return Renderer(tok, "on", limits=LIMITS)


def test_plain_prompts_the_tokenizer_refuses_are_bad_rows(caplog: pytest.LogCaptureFixture) -> None:
    problems = [*_problems(3), Problem(3, "a\udc80", "1", origin="d.jsonl line 4"), *_problems(6)[4:]]
    render = renderer(build_tokenizer())
    assert usable(_problems(6), render, "reject", "training") == _problems(6)
    with pytest.raises(DatasetError, match=r"^d.jsonl line 4: the tokenizer cannot encode it \(TypeError"):
        usable(problems, render, "reject", "training")
    with caplog.at_level(logging.WARNING, logger="shared.prompts"):
        kept = usable(problems, render, "drop", "training")
    assert [p.index for p in kept] == [0, 1, 2, 4, 5]
    assert "training: 1 problems dropped (task.bad_rows=drop), 5 kept; first: d.jsonl line 4" in caplog.text


def test_a_chat_template_that_raises_on_a_row_makes_it_a_bad_row() -> None:
    # one child renders them all: the template's own error names the row, the rest render
    refuses = "{% if messages[-1].content == '2+1=' %}{{ raise_exception('no twos') }}{% endif %}" + CHAT_TEMPLATE
    assert _chat(refuses).failures(_problems(5)) == [(2, "the chat template refuses it (TemplateError: no twos)")]


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CHAT_TEMPLATE,
            r"rendering one conversation took over 0.5 s",
        ),
        (
            "{{ 'x' * 10000000000 }}" + CHAT_TEMPLATE,
            r"rendering one conversation ran out of memory or stack \(MemoryError\)",
        ),
        (
            "{% for i in range(1000) %}{{ messages[-1].content * 100 }}{% endfor %}" + CHAT_TEMPLATE,
            r"one conversation renders to \d+ characters, over the limit of 100000",
        ),
    ],
    ids=["nested_loop", "huge_string", "huge_output"],
)
def test_a_chat_template_that_breaks_a_limit_fails_the_load_whatever_bad_rows_says(template: str, reason: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match=rf"broke a limit on d.jsonl line 1: {reason}; fix the template"):
        usable(_problems(3), _chat(template), "drop", "training")
    assert time.monotonic() - t0 < 60  # the trainer used to hang here for ever, or be OOM-killed
