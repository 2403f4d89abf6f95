"""shared.environments: the episode as token ids, the driver's limits and failure isolation, the
built-in environments (single_turn, tools: calculator, python in the sandbox) and loading."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from shared.environments import (
    ENVIRONMENTS,
    ChatCodec,
    EnvironmentLoadError,
    EnvironmentSpec,
    Episode,
    EpisodeLimits,
    ModelTurn,
    PlainCodec,
    SingleTurnEnv,
    StepResult,
    TemplateDeltaError,
    ToolCall,
    ToolCallError,
    ToolEnv,
    ToolError,
    calculate,
    codec_for,
    load_environment,
    parse_tool_call,
    render_reply_delta,
    run_episode,
)
from shared.environments import episode as env_episode
from shared.environments import spec as env_spec
from shared.environments.episode import plain_reply
from shared.environments.tools import count_tool_calls
from shared.tasks import Problem

# --- a toy tokenizer where joining text changes the ids ---------------------------------------------
# One token per character (its code point), except that "a\n" is one token (1000): so a model turn
# ending in "a" followed by a reply starting with "\n" tokenizes differently once joined.
MERGED = {"a\n": 1000}
BOS = 1


def toy_tokenize(text: str) -> list[int]:
    out, i = [], 0
    while i < len(text):
        if text[i : i + 2] in MERGED:
            out.append(MERGED[text[i : i + 2]])
            i += 2
        else:
            out.append(ord(text[i]))
            i += 1
    return out


def toy_decode(ids: Sequence[int]) -> str:
    back = {v: k for k, v in MERGED.items()}
    return "".join(back[i] if i in back else "" if i == BOS else chr(i) for i in ids)


class CountingTokenize:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, text: str) -> list[int]:
        self.calls.append(text)
        return toy_tokenize(text)


def toy_codec(tokenize: Any = toy_tokenize) -> PlainCodec:
    return PlainCodec(tokenize=tokenize, decode=toy_decode, tokenize_prompt=lambda t: [BOS, *toy_tokenize(t)])


class ScriptedModel:
    """generate() answering each call with the next scripted (text, finish_reason); logprob of the
    k-th token of a turn is -(k + 1) / 4. Honours max_new_tokens like an engine (finish "length")."""

    def __init__(self, turns: Sequence[tuple[str, str]], *, ignore_budget: bool = False, delay_s: float = 0.0) -> None:
        self.turns = list(turns)
        self.contexts: list[list[int]] = []
        self.budgets: list[int] = []
        self.ignore_budget = ignore_budget
        self.delay_s = delay_s

    async def __call__(self, context: list[int], max_new_tokens: int) -> tuple[list[int], list[float], str]:
        self.contexts.append(list(context))
        self.budgets.append(max_new_tokens)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        text, finish = self.turns[min(len(self.contexts), len(self.turns)) - 1]
        ids = toy_tokenize(text)
        if len(ids) > max_new_tokens and not self.ignore_budget:
            ids, finish = ids[:max_new_tokens], "length"
        return ids, [-(k + 1) / 4 for k in range(len(ids))], finish


class Scripted:
    """Replies with the scripted StepResults in order (a plain, sync environment)."""

    def __init__(self, replies: Sequence[Any]) -> None:
        self.replies = list(replies)
        self.seen: list[ModelTurn] = []

    def start(self, row: Any) -> Any:
        return row["prompt"]

    def step(self, turn: ModelTurn) -> Any:
        self.seen.append(turn)
        return self.replies[turn.index]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


LIMITS = EpisodeLimits(max_turns=8, max_total_tokens=200, step_timeout_s=5.0)
ROW = {"prompt": "Q"}


# --- the episode as ids -------------------------------------------------------------------------------


def test_mask_and_logprobs_line_up_and_no_retokenization() -> None:
    # Turn 1: the model says "a"; the env replies "ok" (user role: "\nok\n" in plain text).
    # Turn 2: the model says "b"; the env says done.
    tokenize = CountingTokenize()
    env = Scripted([StepResult("ok", reward=0.5, role="user"), StepResult(done=True, reward=1.0)])
    model = ScriptedModel([("a", "stop"), ("b", "stop")])
    ep = run(run_episode(env, ROW, model, toy_codec(tokenize), LIMITS))

    assert ep.stop_reason == "done"
    assert ep.prompt_ids == [BOS, ord("Q")]
    reply = toy_tokenize("\nok\n")
    assert reply == [10, 111, 107, 10]
    # Hand-checked: model "a" (97), the reply's 4 ids, model "b" (98).
    assert ep.ids == [97, 10, 111, 107, 10, 98]
    assert ep.mask == [1, 0, 0, 0, 0, 1]
    assert ep.logprobs == [-0.25, 0.0, 0.0, 0.0, 0.0, -0.25]
    assert len(ep.ids) == len(ep.mask) == len(ep.logprobs)
    # The reply was tokenized exactly once, as rendered.
    assert tokenize.calls == [plain_reply("user", "ok")]
    # Joining the text and tokenizing it again gives other ids ("a\n" merges): the episode keeps the
    # concatenation of what was sampled and what was appended.
    assert toy_tokenize("a" + "\nok\n" + "b") == [1000, 111, 107, 10, 98] != ep.ids
    # The second turn was generated from exactly the prompt and the ids so far.
    assert model.contexts[1] == [BOS, ord("Q"), 97, 10, 111, 107, 10]
    # Turns: kinds, spans, per-turn rewards.
    assert [(t.kind, t.start, t.end, t.reward) for t in ep.turns] == [
        ("model", 0, 1, 0.5),
        ("env", 1, 5, None),
        ("model", 5, 6, 1.0),
    ]
    assert ep.num_turns == 2 and ep.rewards == [0.5, 1.0]
    assert ep.final_text == "b" and env.seen[0] == ModelTurn("a", (97,), "stop", 0)


def test_model_ids_kept_when_they_do_not_decode_back() -> None:
    # The model samples the merged token 1000 ("a\n") and BOS, which decodes to nothing: the episode
    # keeps the sampled ids, not a tokenization of the decoded text.
    class Model:
        async def __call__(self, context: list[int], n: int) -> tuple[list[int], list[float], str]:
            return [1000, BOS, 98], [-1.0, -2.0, -3.0], "stop"

    ep = run(run_episode(SingleTurnEnv(), ROW, Model(), toy_codec(), LIMITS))
    assert ep.ids == [1000, BOS, 98] and ep.logprobs == [-1.0, -2.0, -3.0] and ep.mask == [1, 1, 1]
    assert ep.final_text == "a\nb" and toy_tokenize(ep.final_text) == [1000, 98]


def test_single_turn_is_todays_behaviour() -> None:
    ep = run(
        run_episode(SingleTurnEnv(), Problem(0, "17+25=", "42"), ScriptedModel([("42", "stop")]), toy_codec(), LIMITS)
    )
    assert ep.prompt_ids == [BOS, *toy_tokenize("17+25=")]
    assert ep.ids == toy_tokenize("42") and ep.mask == [1, 1] and ep.stop_reason == "done" and ep.num_turns == 1
    assert ep.finish_reason == "stop" and ep.final_text == "42"
    msgs = Problem(0, "p", "", messages=({"role": "system", "content": "s"}, {"role": "user", "content": "p"}))
    assert SingleTurnEnv().start(msgs) == [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}]


def test_episode_rejects_mismatched_logprobs() -> None:
    with pytest.raises(ValueError, match="2 ids but 1 logprobs"):
        Episode([1]).append_model([1, 2], [0.0], "x", "stop")


# --- limits ---------------------------------------------------------------------------------------------


def forever(role: str = "user") -> Scripted:
    return Scripted([StepResult("r", role=role)] * 100)  # type: ignore[arg-type]


def test_max_turns() -> None:
    ep = run(
        run_episode(
            forever(), ROW, ScriptedModel([("x", "stop")]), toy_codec(), LIMITS.model_copy(update={"max_turns": 3})
        )
    )
    assert ep.stop_reason == "max_turns" and ep.num_turns == 3
    assert [t.kind for t in ep.turns] == ["model", "env", "model", "env", "model", "env"]


def test_max_tokens_cuts_a_model_turn() -> None:
    # Prompt 2 + "x" 1 + reply "\nr\n" 3 = 6; the budget of 9 leaves 3 for the second turn's 5 tokens.
    model = ScriptedModel([("x", "stop"), ("hello", "stop")])
    ep = run(run_episode(forever(), ROW, model, toy_codec(), LIMITS.model_copy(update={"max_total_tokens": 9})))
    assert model.budgets == [7, 3]
    assert ep.stop_reason == "max_tokens" and ep.total_tokens == 9 and ep.ids[-3:] == toy_tokenize("hel")


def test_max_tokens_with_an_engine_that_overshoots() -> None:
    model = ScriptedModel([("hello world", "stop")], ignore_budget=True)
    ep = run(run_episode(forever(), ROW, model, toy_codec(), LIMITS.model_copy(update={"max_total_tokens": 6})))
    assert ep.stop_reason == "max_tokens" and len(ep.ids) == len(ep.mask) == len(ep.logprobs) == 4


def test_max_tokens_reply_that_does_not_fit_is_not_appended() -> None:
    # 2 + 1 = 3 used; the reply's 3 ids do not fit in 5: nothing of it is appended.
    ep = run(
        run_episode(
            forever(),
            ROW,
            ScriptedModel([("x", "stop")]),
            toy_codec(),
            LIMITS.model_copy(update={"max_total_tokens": 5}),
        )
    )
    assert ep.stop_reason == "max_tokens" and ep.ids == [ord("x")] and [t.kind for t in ep.turns] == ["model"]


def test_engine_length_and_other_stops() -> None:
    ep = run(run_episode(forever(), ROW, ScriptedModel([("xy", "length")]), toy_codec(), LIMITS))
    assert ep.stop_reason == "length" and ep.finish_reason == "length" and ep.num_turns == 1
    ep = run(run_episode(forever(), ROW, ScriptedModel([("xy", "abort")]), toy_codec(), LIMITS))
    assert ep.stop_reason == "model_stop" and ep.finish_reason == "abort"


def test_limits_are_validated() -> None:
    assert EpisodeLimits() == EpisodeLimits(max_turns=8, max_total_tokens=4096, step_timeout_s=30.0)
    for bad in (
        {"max_turns": 0},
        {"max_total_tokens": 1},
        {"step_timeout_s": 0},
        {"step_timeout_s": float("inf")},
        {"turns": 3},
    ):
        with pytest.raises(ValidationError):
            EpisodeLimits(**bad)  # type: ignore[arg-type]


# --- failures end only their own episode -------------------------------------------------------------


class Raises:
    def start(self, row: Any) -> str:
        return "Q"

    def step(self, turn: ModelTurn) -> StepResult:
        raise RuntimeError("boom")


class HangsSync:
    release = threading.Event()

    def start(self, row: Any) -> str:
        return "Q"

    def step(self, turn: ModelTurn) -> StepResult:
        self.release.wait(30)  # released when the test ends: the abandoned thread must not linger
        return StepResult(done=True)


class HangsAsync:
    async def start(self, row: Any) -> str:
        return "Q"

    async def step(self, turn: ModelTurn) -> StepResult:
        await asyncio.sleep(60)
        return StepResult(done=True)


class Garbage(Scripted):
    pass


class BadStart:
    def start(self, row: Any) -> Any:
        return None

    def step(self, turn: ModelTurn) -> StepResult:
        return StepResult(done=True)


class SlowSyncGood:
    """A sync step that blocks its thread (not the loop) for 0.5 s."""

    def start(self, row: Any) -> str:
        return "Q"

    def step(self, turn: ModelTurn) -> StepResult:
        time.sleep(0.5)
        return StepResult(done=True, reward=1.0)


def test_failing_environments_end_only_their_own_episode() -> None:
    limits = LIMITS.model_copy(update={"step_timeout_s": 1.0})
    envs: list[Any] = [
        Raises(),
        HangsSync(),
        HangsAsync(),
        Garbage([42]),
        Garbage([StepResult(reward="high")]),  # type: ignore[arg-type]
        Garbage([{"txt": "typo"}]),
        BadStart(),
        SlowSyncGood(),
        SingleTurnEnv(),
        SlowSyncGood(),
    ]
    ticks = 0

    async def ticker(stop: asyncio.Event) -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    async def main() -> tuple[list[Episode], float]:
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        t0 = time.monotonic()
        eps = await asyncio.gather(
            *(run_episode(e, ROW, ScriptedModel([("x", "stop")]), toy_codec(), limits) for e in envs)
        )
        took = time.monotonic() - t0
        HangsSync.release.set()  # asyncio.run waits for the default executor's threads at exit
        stop.set()
        await tick
        return list(eps), took

    try:
        eps, took = run(main())
    finally:
        HangsSync.release.set()
    reasons = [e.stop_reason for e in eps]
    assert reasons[0] == "env_error: step: RuntimeError: boom"
    assert reasons[1] == reasons[2] == "env_timeout"
    assert reasons[3] is not None and reasons[3].startswith("env_error: step returned 42 (int)")
    assert reasons[4] is not None and reasons[4].startswith("env_error: step returned reward 'high' (str)")
    assert reasons[5] is not None and "unknown keys ['txt']" in reasons[5]
    assert reasons[6] is not None and reasons[6].startswith("env_error: start returned None (NoneType)")
    assert reasons[7:] == ["done", "done", "done"] and eps[7].rewards == [1.0]
    # The failed ones kept what happened before the failure.
    assert eps[0].ids == [ord("x")] and eps[0].mask == [1] and eps[6].prompt_ids == []
    # Concurrently (two 0.5 s sleeps and two 1 s budgets in well under their sum), and the loop kept
    # running while sync steps blocked their threads (a blocked loop would tick about once).
    assert took < 2.9, took
    assert ticks > 20, ticks


def test_async_environment() -> None:
    class Echo:
        async def start(self, row: Any) -> list[dict[str, str]]:
            await asyncio.sleep(0)
            return [{"role": "user", "content": row["prompt"]}]

        async def step(self, turn: ModelTurn) -> dict[str, Any]:
            await asyncio.sleep(0)
            if turn.index == 0:
                return {"text": f"you said {turn.text}", "role": "user", "info": {"n": turn.index}}
            return {"done": True, "reward": 1}

    ep = run(run_episode(Echo(), ROW, ScriptedModel([("a", "stop"), ("b", "stop")]), toy_codec(), LIMITS))
    assert ep.stop_reason == "done" and ep.rewards == [None, 1.0] and ep.turns[0].info == {"n": 0}
    assert ep.turns[1].text == "you said a" and ep.ids[ep.turns[1].start : ep.turns[1].end] == toy_tokenize(
        "\nyou said a\n"
    )


# --- chat templates ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_tokenizer() -> Any:
    tiny = pytest.importorskip("asyncrl.tiny_model")
    tok = tiny.build_tokenizer()
    tok.chat_template = tiny.CHAT_TEMPLATE
    return tok


def test_chat_reply_is_the_templates_continuation(chat_tokenizer: Any) -> None:
    tok = chat_tokenizer
    codec = codec_for(tok, "auto")
    assert isinstance(codec, ChatCodec) and codec.tool_role and codec.turn_close == "\n"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "123+456"}}</tool_call>'
    eos = tok.eos_token_id

    class Model:
        turns = [call, "The answer is 579."]

        async def __call__(self, context: list[int], n: int) -> tuple[list[int], list[float], str]:
            ids = tok(self.turns.pop(0), add_special_tokens=False)["input_ids"] + [eos]
            return ids, [-0.5] * len(ids), "stop"

    ep = run(
        run_episode(
            ToolEnv(tools=["calculator"], system_prompt=False), Problem(0, "123+456?", "579"), Model(), codec, LIMITS
        )
    )
    assert ep.stop_reason == "done" and ep.num_turns == 2
    assert tok.decode(ep.prompt_ids) == "<|user|>123+456?\n<|assistant|>"
    model1, reply, model2 = ep.turns
    # The template closes an assistant message with "\n", which the model (stopping at EOS) did not
    # write: it goes before the tool message, so the transcript reads as the template renders it.
    assert tok.decode(ep.ids[reply.start : reply.end]) == "\n<|tool|>579\n<|assistant|>"
    assert ep.ids[model1.start : model1.end][-1] == eos and ep.mask == [1] * model1.end + [0] * (
        reply.end - reply.start
    ) + [1] * (model2.end - model2.start)
    assert model1.info == {"tool_call": True, "parsed": True, "tool": "calculator", "ok": True}
    assert model2.info == {"tool_call": False} and ep.final_text == "The answer is 579."
    full = tok.apply_chat_template(ep.messages, tokenize=False)
    assert tok.decode(ep.prompt_ids + ep.ids) == full.rstrip("\n")  # up to the last turn's closing "\n"


def test_chat_template_without_a_tool_role(chat_tokenizer: Any) -> None:
    tok = chat_tokenizer
    no_tool = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    codec = ChatCodec(_with_template(tok, no_tool))
    assert not codec.tool_role
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    message, ids = codec.reply(msgs, tok("a\n", add_special_tokens=False)["input_ids"], "tool", "7")
    assert message == {"role": "user", "content": "<tool_response>\n7\n</tool_response>"}
    assert tok.decode(ids) == "<|user|><tool_response>\n7\n</tool_response>\n<|assistant|>"  # "a\n" already closed


def test_chat_template_that_rewrites_earlier_turns_is_refused(chat_tokenizer: Any) -> None:
    marks_last = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if loop.last %}<|end|>{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok = _with_template(chat_tokenizer, marks_last)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(TemplateDeltaError, match="renders the conversation differently once a 'tool' message follows"):
        render_reply_delta(tok, msgs, {"role": "tool", "content": "r"})
    with pytest.raises(TemplateDeltaError):
        ChatCodec(tok)


def test_plain_codec_without_a_template(chat_tokenizer: Any) -> None:
    tiny = pytest.importorskip("asyncrl.tiny_model")
    tok = tiny.build_tokenizer()  # no chat template
    codec = codec_for(tok, "auto")
    assert isinstance(codec, PlainCodec)
    assert codec.prompt_ids("1+2=") == tok("1+2=")["input_ids"]  # with BOS, as shared.prompts renders it
    _, ids = codec.reply([], [], "tool", "3")
    assert tok.decode(ids) == "\n<tool_response>\n3\n</tool_response>\n"


def _with_template(tok: Any, template: str) -> Any:
    import copy

    other = copy.deepcopy(tok)
    other.chat_template = template
    return other


# --- the calculator ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("123+456", 579),
        ("2*(3+4)", 14),
        ("7//2", 3),
        ("-7//2", -4),
        ("7%3", 1),
        ("2**10", 1024),
        ("-3", -3),
        ("7/2", 3.5),
        ("2**-1", 0.5),
        ("((1))", 1),
        ("1.5*2", 3.0),
        (" 10 - 2 - 3 ", 5),
        ("9" * 400 + "-" + "9" * 400, 0),
    ],
)
def test_calculator(expr: str, value: float) -> None:
    assert calculate(expr) == value


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os')",
        "__import__('os').system('id')",
        "().__class__",
        "open('/etc/passwd')",
        "x",
        "a.b",
        "[1, 2]",
        "lambda: 1",
        "1 if 1 else 2",
        "2 < 3",
        "~1",
        "1 << 100000",
        "True + 1",
        "'a' * 3",
        "1j",
        "f'{1}'",
        "9**9**9",
        "10**5000",
        "2**4097",
        "(9**999) * (9**999)",
        "1e400",
        "1e308 * 10",
        "10.0 ** 400",
        "(-8) ** 0.5",
        "1/0",
        "1 % 0",
        "9" * 1001,
        "-" * 500 + "1",
        "(" * 300 + "1" + ")" * 300,
        "",
        "1 +",
        "import os",
    ],
)
def test_calculator_refuses(expr: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ToolError):
        calculate(expr)
    assert time.monotonic() - t0 < 1.0  # refused before any large computation


# --- tool calls -------------------------------------------------------------------------------------


def test_parse_tool_call() -> None:
    assert parse_tool_call(
        'I will add. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    ) == ToolCall("calculator", {"expression": "1+2"})
    assert parse_tool_call(
        '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>'
    ) == ToolCall("python", {"code": "print(1)"})
    assert parse_tool_call('<tool_call>{"name": "noargs"}</tool_call>') == ToolCall("noargs", {})
    assert parse_tool_call("no call here") is None
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert parse_tool_call(two) == ToolCall("a", {}) and count_tool_calls(two) == 2
    for bad, why in [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "calculator"', "without </tool_call>"),
        ('<tool_call>["calculator"]</tool_call>', "JSON object"),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "JSON object"),
        ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
        ('<tool_call>{"name": "c", "arguments": "nope"}</tool_call>', "not a JSON object"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "not valid JSON"),
    ]:
        with pytest.raises(ToolCallError, match=why):
            parse_tool_call(bad)


def _step(env: ToolEnv, text: str) -> StepResult:
    return env.step(ModelTurn(text, (), "stop", 0))


def test_tool_env_steps() -> None:
    env = ToolEnv(tools=["calculator"])
    r = _step(env, '<tool_call>{"name": "calculator", "arguments": {"expression": "123+456"}}</tool_call>')
    assert (r.text, r.done, r.role, r.info) == (
        "579",
        False,
        "tool",
        {"tool_call": True, "parsed": True, "tool": "calculator", "ok": True},
    )
    r = _step(env, '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>')
    assert (
        r.text.startswith("error: Call is not allowed")
        and not r.done
        and r.info["ok"] is False
        and r.info["parsed"] is True
    )
    r = _step(env, '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>')
    assert r.text == "error: unknown tool 'python'; available: ['calculator']" and r.info["ok"] is False
    r = _step(env, '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>')
    assert "unexpected arguments ['expr']" in r.text and r.info["ok"] is False
    r = _step(env, '<tool_call>{"name": "calculator", "arguments": {"expression": 12}}</tool_call>')
    assert "must be a string" in r.text
    r = _step(env, "<tool_call>{oops}</tool_call>")
    assert r.text.startswith("error: the tool call is not valid JSON") and r.info == {
        "tool_call": True,
        "parsed": False,
        "ok": False,
        "error": r.text.removeprefix("error: "),
    }
    r = _step(
        env,
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>',
    )
    assert r.text == "2\n(only the first tool call of a turn runs; 1 more ignored)"
    r = _step(env, "The answer is 579.")
    assert r.done and r.text == "" and r.info == {"tool_call": False}
    with pytest.raises(ValueError, match="unknown tools"):
        ToolEnv(tools=["shell"])


def test_tool_env_opening() -> None:
    env = ToolEnv(tools=["calculator"])
    opening = env.start(Problem(0, "1+2?", "3"))
    assert [m["role"] for m in opening] == ["system", "user"] and '"name": "calculator"' in opening[0]["content"]
    sys_row = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]}
    opening = env.start(sys_row)
    assert len(opening) == 2 and opening[0]["content"].startswith("Be brief.\n\nYou may call tools.")
    assert ToolEnv(system_prompt=False).start({"prompt": "q"}) == [{"role": "user", "content": "q"}]


@pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap (bwrap) is not installed: the python tool runs only in the sandbox",
)
def test_python_tool_in_the_sandbox() -> None:
    env = ToolEnv(tools=["python"], python_wall_s=10.0)
    r = _step(env, '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>')
    assert r.text == "42\n" and r.info["ok"] is True
    r = _step(
        env,
        '<tool_call>{"name": "python", "arguments": '
        '{"code": "import sys; print(open(\'/etc/passwd\').read()); sys.exit(0)"}}</tool_call>',
    )
    assert r.info["ok"] is False and "FileNotFoundError" in r.text and r.text.endswith("[exit status 1]")
    r = _step(env, '<tool_call>{"name": "python", "arguments": {"code": "raise SystemExit(3)"}}</tool_call>')
    assert r.info["ok"] is False and r.text.endswith("[exit status 3]")


def test_tool_episode_plain_text() -> None:
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    model = ScriptedModel([(call, "stop"), ("42", "stop")])
    ep = run(run_episode(ToolEnv(tools=["calculator"], system_prompt=False), ROW, model, toy_codec(), LIMITS))
    assert ep.stop_reason == "done" and ep.final_text == "42"
    reply = ep.turns[1]
    assert toy_decode(ep.ids[reply.start : reply.end]) == "\n<tool_response>\n42\n</tool_response>\n"
    calls = [t.info for t in ep.turns if t.kind == "model" and t.info.get("tool_call")]
    assert sum(i["ok"] for i in calls) / len(calls) == 1.0  # the tool-call success rate


def test_episode_metrics_average_each_info_key_over_the_turns_that_carry_it() -> None:
    # turn 0: a good call; turn 1: a call to an unknown tool; turn 2: the answer (no call)
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    bad = '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>'
    model = ScriptedModel([(good, "stop"), (bad, "stop"), ("42", "stop")])
    roomy = LIMITS.model_copy(update={"max_total_tokens": 1000})
    ep = run(run_episode(ToolEnv(tools=["calculator"], system_prompt=False), ROW, model, toy_codec(), roomy))
    assert ep.stop_reason == "done"
    # tool_call on all 3 turns (1, 1, 0); parsed and ok only on the 2 with a call: (1, 1), (1, 0);
    # "tool" and "error" are strings, not figures
    # and the environment's own: two calls, one succeeded
    assert ep.metrics() == {"tool_call": 2 / 3, "parsed": 1.0, "ok": 0.5, "tool_calls": 2.0, "tool_success": 1.0}
    direct = run(
        run_episode(
            ToolEnv(tools=["calculator"], system_prompt=False), ROW, ScriptedModel([("41", "stop")]), toy_codec(), roomy
        )
    )
    assert direct.metrics() == {"tool_call": 0.0, "tool_calls": 0.0, "tool_success": 0.0}


class FailingMetrics(Scripted):
    def metrics(self) -> dict:
        raise RuntimeError("no figures today")


def test_an_environment_whose_metrics_fail_loses_only_its_figures() -> None:
    ep = run(
        run_episode(
            FailingMetrics([StepResult(done=True, info={"x": 2})]),
            ROW,
            ScriptedModel([("a", "stop")]),
            toy_codec(),
            LIMITS,
        )
    )
    assert ep.stop_reason == "done" and ep.metrics() == {"x": 2.0}


def test_episode_metrics_sum_the_turn_rewards_and_skip_what_is_not_a_figure() -> None:
    replies = [
        StepResult("r", reward=0.25, info={"x": 1, "nan": float("nan"), "s": "text"}),
        StepResult("r", info={"x": True}),
        StepResult(reward=-1.0, done=True),
    ]
    model = ScriptedModel([("a", "stop")] * 3)
    ep = run(run_episode(Scripted(replies), ROW, model, toy_codec(), LIMITS))
    assert ep.metrics() == {"x": 1.0, "reward": -0.75}  # 0.25 + (none) + -1.0
    many = [StepResult("r", info={f"k{i}": i for i in range(40)}), StepResult(done=True)]
    ep = run(run_episode(Scripted(many), ROW, ScriptedModel([("a", "stop")] * 2), toy_codec(), LIMITS))
    assert len(ep.metrics()) == env_episode.MAX_METRICS - 1  # room kept for "reward"


# --- loading ----------------------------------------------------------------------------------------


def test_load_by_name() -> None:
    assert set(ENVIRONMENTS) | {env_spec.AGENT} == set(env_spec.ENVIRONMENTS)
    assert isinstance(load_environment("single_turn")(), SingleTurnEnv)
    env = load_environment(EnvironmentSpec(name="tools", kwargs={"tools": ["calculator"]}))()
    assert isinstance(env, ToolEnv) and list(env.tools) == ["calculator"]
    with pytest.raises(EnvironmentLoadError, match="cannot be built with kwargs"):
        load_environment(EnvironmentSpec(name="tools", kwargs={"tool": ["calculator"]}))
    with pytest.raises(ValidationError, match="unknown environment 'nope'"):
        EnvironmentSpec(name="nope")


def test_load_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "my_env.py"
    path.write_text(
        "class Countdown:\n"
        "    def __init__(self, n=2):\n"
        "        self.n = n\n"
        "    def start(self, row):\n"
        "        return row['prompt']\n"
        "    async def step(self, turn):\n"
        "        self.n -= 1\n"
        "        return {'text': str(self.n), 'done': self.n == 0, 'role': 'user'}\n"
        "NotAnEnv = 3\n"
        "class NoStep:\n"
        "    def start(self, row):\n"
        "        return ''\n"
    )
    make = load_environment(EnvironmentSpec(name=f"{path}:Countdown", kwargs={"n": 3}))
    ep = run(run_episode(make(), ROW, ScriptedModel([("x", "stop")]), toy_codec(), LIMITS))
    assert (
        ep.stop_reason == "done"
        and ep.num_turns == 3
        and [t.text for t in ep.turns if t.kind == "env"] == ["2", "1", "0"]
    )
    assert make() is not make()  # a fresh environment per episode
    with pytest.raises(EnvironmentLoadError, match="is int; expected a class or factory"):
        load_environment(f"{path}:NotAnEnv")
    with pytest.raises(EnvironmentLoadError, match="has no method step"):
        load_environment(f"{path}:NoStep")
    with pytest.raises(EnvironmentLoadError, match=r"^environment .*: file .* does not exist"):
        load_environment(f"{tmp_path}/missing.py:Env")
    with pytest.raises(EnvironmentLoadError, match="has no attribute 'Nope'"):
        load_environment(f"{path}:Nope")


def test_spec_kwargs_are_bounded() -> None:
    with pytest.raises(ValidationError, match="not a Python identifier"):
        EnvironmentSpec(name="tools", kwargs={"not-an-id": 1})
    with pytest.raises(ValidationError, match="bytes as JSON"):
        EnvironmentSpec(name="tools", kwargs={"x": "a" * 70_000})
    assert EnvironmentSpec().name == "single_turn" and EnvironmentSpec().limits == EpisodeLimits()
