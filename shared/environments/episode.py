"""An episode as token ids, and the driver that plays one against an environment.

The trainer must train on exactly the ids the generator conditioned on and sampled, so an
episode is never re-tokenized: a model turn appends the ids the engine sampled; an environment
reply is rendered and tokenized once, when it is appended, and its ids are kept. Decoding the
whole episode and tokenizing it again would not give the same ids (a BPE merge across a turn
boundary, a special token the model sampled that decodes to nothing), and the behaviour logprobs
would then belong to other tokens.

Completion-side layout (everything after the prompt), one entry per token in three parallel lists:

    ids       model turn ids ... | env reply ids ... | model turn ids ... | ...
    mask      1 ...               | 0 ...             | 1 ...               (1: sampled by the model)
    logprobs  sampled logprobs    | 0.0 ...           | sampled logprobs

so the trainer's loss mask is `mask` and its behaviour logprobs are `logprobs` (0.0 where masked).

Rendering (a Codec): with a chat template, the opening is rendered like any prompt
(shared.prompts) and a reply is the template's continuation: the conversation rendered with and
without the new `tool` (or `user`) message, the suffix taken (`render_reply_delta`); a template
without a tool role gets tool results as a user message wrapped in <tool_response> tags. Without a
template a reply is plain text (`plain_reply`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from shared.environments.base import (
    Environment,
    Message,
    ModelTurn,
    Opening,
    ReplyRole,
    Row,
    coerce_opening,
    coerce_step,
)
from shared.environments.spec import EpisodeLimits
from shared.prompts import ChatMode, Tokenizer, render, uses_chat

Tokenize = Callable[[str], Sequence[int]]
Decode = Callable[[Sequence[int]], str]
Generate = Callable[[list[int], int], Awaitable[tuple[Sequence[int], Sequence[float], str | None]]]
"""`generate(context_ids, max_new_tokens) -> (ids, logprobs, finish_reason)`: one model turn from
the whole context so far (prompt and completion side), at most `max_new_tokens` long; `logprobs`
are the sampled tokens' logprobs, one per id; `finish_reason` is the engine's ("stop", "length")."""

TurnKind = Literal["model", "env"]
MAX_REASON = 2000  # a stop reason's length bound (Scored.reward_reason's)
MAX_METRICS = 16  # an episode's metrics (Episode.metrics): at most this many, names this long
MAX_METRIC_NAME = 64


class TemplateDeltaError(ValueError):
    """The chat template cannot render an environment reply as a continuation of the conversation."""


# --- rendering ------------------------------------------------------------------------------------


def plain_reply(role: ReplyRole, text: str) -> str:
    """A reply as plain text (no chat template): a tool result in the Hermes/Qwen tags, anything
    else on a line of its own."""
    if role == "tool":
        return f"\n<tool_response>\n{text}\n</tool_response>\n"
    return f"\n{text}\n"


def render_reply_delta(
    tokenizer: Tokenizer, messages: Sequence[Message], message: Message, chat_kwargs: Mapping[str, Any] | None = None
) -> str:
    """The text the chat template adds for `message` after `messages`, ending with the generation
    prompt of the next assistant turn (`render_messages_delta` of one message)."""
    return render_messages_delta(tokenizer, messages, [message], chat_kwargs)


def render_messages_delta(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    new: Sequence[Message],
    chat_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The text the chat template adds for the `new` messages after `messages`, ending with the
    generation prompt of the next assistant turn.

    Rendered as the whole conversation with and without the new messages; the shorter must be a
    prefix of the longer, or the tokens the model already saw would change.

    Raises:
        TemplateDeltaError: the template renders the earlier conversation differently once the
            messages follow (where the two renderings part is in the message).
    """
    kw = dict(chat_kwargs or {})
    before = tokenizer.apply_chat_template(list(messages), add_generation_prompt=False, tokenize=False, **kw)
    after = tokenizer.apply_chat_template([*messages, *new], add_generation_prompt=True, tokenize=False, **kw)
    if not after.startswith(before):
        at = next(
            (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), min(len(before), len(after))
        )
        raise TemplateDeltaError(
            f"the chat template renders the conversation differently once a {new[0].get('role')!r} message "
            f"follows, so the reply cannot be appended without changing tokens the model already saw: "
            f"at character {at}, {before[max(0, at - 30) : at + 30]!r} becomes {after[max(0, at - 30) : at + 30]!r}. "
            "Use a template that renders earlier turns independently of later ones, or chat_template 'off'"
        )
    return after[len(before) :]


class Codec(Protocol):
    """How an episode's text becomes token ids: the opening, the replies, the model's turns' text."""

    def prompt_ids(self, opening: Opening) -> list[int]: ...

    def reply(
        self, messages: Sequence[Message], model_ids: Sequence[int], role: ReplyRole, text: str
    ) -> tuple[Message, list[int]]: ...

    def replies(
        self, messages: Sequence[Message], model_ids: Sequence[int], new: Sequence[Message]
    ) -> tuple[list[Message], list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class PlainCodec:
    """No chat template: the opening as text (messages' contents one per line, as shared.prompts
    does), replies as `plain_reply`, each tokenized once.

    Attributes:
        tokenize: text -> ids without special tokens (replies).
        decode: ids -> text, special tokens skipped (what `step` sees).
        tokenize_prompt: the opening's tokenization (with BOS, as the engine does with a text
            prompt); None: `tokenize`.
    """

    tokenize: Tokenize
    decode: Decode
    tokenize_prompt: Tokenize | None = None

    def prompt_ids(self, opening: Opening) -> list[int]:
        text = opening if isinstance(opening, str) else "\n".join(str(m.get("content", "")) for m in opening)
        return list((self.tokenize_prompt or self.tokenize)(text))

    def reply(
        self, messages: Sequence[Message], model_ids: Sequence[int], role: ReplyRole, text: str
    ) -> tuple[Message, list[int]]:
        return {"role": role, "content": text}, list(self.tokenize(plain_reply(role, text)))

    def replies(
        self, messages: Sequence[Message], model_ids: Sequence[int], new: Sequence[Message]
    ) -> tuple[list[Message], list[int]]:
        """Several messages after a model turn, each as `plain_reply`, tokenized as one text."""
        rendered = [{"role": m["role"], "content": m["content"]} for m in new]
        return rendered, list(self.tokenize("".join(plain_reply(m["role"], m["content"]) for m in rendered)))


_PROBE = "\x00asyncrl-probe\x00"


class ChatCodec:
    """The tokenizer's chat template: the opening rendered as shared.prompts renders prompts,
    replies as the template's continuation (`render_reply_delta`).

    A model turn ends where the engine stopped, usually at the end-of-turn token; the template
    closes an assistant message with more than that (Qwen: "<|im_end|>\\n"). The part of that
    closing the model's ids do not already end with is put before the reply, so the transcript
    reads as the template would render it.

    Raises (constructor):
        TemplateDeltaError: the template fails the continuation check on a probe conversation.
    """

    def __init__(self, tokenizer: Tokenizer, chat_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_kwargs = dict(chat_kwargs or {})
        probe: list[Message] = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE}]
        closed = self._template(probe, add_generation_prompt=False)
        # What the template writes after an assistant message's content.
        self.turn_close = closed[closed.rindex(_PROBE) + len(_PROBE) :] if _PROBE in closed else ""
        try:
            tool = render_reply_delta(tokenizer, probe, {"role": "tool", "content": _PROBE}, self.chat_kwargs)
            self.tool_role = _PROBE in tool
        except TemplateDeltaError:
            raise
        except Exception:  # a template that rejects the role (raise_exception) has none
            self.tool_role = False
        render_reply_delta(tokenizer, probe, {"role": "user", "content": "r"}, self.chat_kwargs)

    def _template(self, messages: list[Message], *, add_generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **self.chat_kwargs
            )
        )

    def prompt_ids(self, opening: Opening) -> list[int]:
        if isinstance(opening, str):
            return render(self.tokenizer, opening, None, chat=True, chat_kwargs=self.chat_kwargs).ids
        return render(self.tokenizer, "", opening, chat=True, chat_kwargs=self.chat_kwargs).ids

    def reply(
        self, messages: Sequence[Message], model_ids: Sequence[int], role: ReplyRole, text: str
    ) -> tuple[Message, list[int]]:
        rendered, ids = self.replies(messages, model_ids, [{"role": role, "content": text}])
        return rendered[0], ids

    def replies(
        self, messages: Sequence[Message], model_ids: Sequence[int], new: Sequence[Message]
    ) -> tuple[list[Message], list[int]]:
        """Messages after a model turn (`model_ids`), as the template renders them, and their ids:
        tool results as user messages in <tool_response> tags where the template has no tool role."""
        rendered: list[Message] = [
            {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            if m["role"] == "tool" and not self.tool_role
            else {"role": m["role"], "content": m["content"]}
            for m in new
        ]
        delta = render_messages_delta(self.tokenizer, messages, rendered, self.chat_kwargs)
        return rendered, self._ids(self._unclosed(model_ids) + delta)

    def _unclosed(self, model_ids: Sequence[int]) -> str:
        """The part of the template's turn closing the model's ids do not end with."""
        close = self.turn_close
        raw = str(self.tokenizer.decode(list(model_ids), skip_special_tokens=False))  # type: ignore[attr-defined]
        have = next(k for k in range(len(close), -1, -1) if raw.endswith(close[:k]))
        return close[have:]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))  # type: ignore[attr-defined]


def codec_for(
    tokenizer: Tokenizer, mode: ChatMode = "auto", chat_kwargs: Mapping[str, Any] | None = None
) -> ChatCodec | PlainCodec:
    """The codec for a job's tokenizer and `chat_template` mode (as shared.prompts.renderer chooses)."""
    if uses_chat(tokenizer, mode):
        return ChatCodec(tokenizer, chat_kwargs)
    decode = tokenizer.decode  # type: ignore[attr-defined]
    return PlainCodec(
        tokenize=lambda t: tokenizer(t, add_special_tokens=False)["input_ids"],
        decode=lambda ids: str(decode(list(ids), skip_special_tokens=True)),
        tokenize_prompt=lambda t: tokenizer(t, add_special_tokens=True)["input_ids"],
    )


# --- the episode ----------------------------------------------------------------------------------


def _figure(key: Any, value: Any) -> bool:
    """A metric an episode can carry: a short printable name and a finite number (or bool)."""
    return (
        isinstance(key, str)
        and 0 < len(key) <= MAX_METRIC_NAME
        and key.isprintable()
        and isinstance(value, bool | int | float)
        and math.isfinite(value)
    )


@dataclass(frozen=True)
class TurnRecord:
    """One turn of an episode.

    Attributes:
        kind: "model" (sampled) or "env" (a reply).
        start, end: its span [start, end) in Episode.ids.
        text: a model turn's decoded text; a reply's content as the environment gave it.
        reward: a model turn's reward from the step that answered it (None: none given).
        info: a model turn's info from that step.
        finish_reason: a model turn's, from the engine.
    """

    kind: TurnKind
    start: int
    end: int
    text: str
    reward: float | None = None
    info: Mapping[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None


@dataclass
class Episode:
    """One episode: the prompt ids, then the completion side as three parallel lists (see the module
    docstring), its turns in order and why it ended.

    Stop reasons: "done" (the environment said so), "max_turns", "max_tokens" (EpisodeLimits),
    "length" (the engine cut a turn at its own per-turn limit), "model_stop" (the engine ended a
    turn for another reason, e.g. "abort"; `finish_reason` says which), "env_timeout" (a call over
    `step_timeout_s`), "env_error: <what failed>" (the environment raised, returned something of
    the wrong shape, or its reply could not be rendered).
    """

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)  # the conversation, for templates and logs
    stop_reason: str | None = None
    finish_reason: str | None = None  # the engine's, of the last model turn
    env_metrics: dict[str, Any] = field(default_factory=dict)  # the environment's own metrics(), if any
    unanswered: bool = False  # the last model turn ended the episode without a step (see run_episode)

    @property
    def num_turns(self) -> int:
        """Model turns."""
        return sum(t.kind == "model" for t in self.turns)

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    @property
    def final_text(self) -> str:
        """The last model turn's text: the episode's answer ("" before any turn)."""
        return next((t.text for t in reversed(self.turns) if t.kind == "model"), "")

    @property
    def rewards(self) -> list[float | None]:
        """Each model turn's reward, in order."""
        return [t.reward for t in self.turns if t.kind == "model"]

    def metrics(self) -> dict[str, float]:
        """The episode's figures: per info key with a number or bool value, its mean over the
        model turns that carry it (the tools environment's `ok`: the share of its calls that
        succeeded); `reward`, the sum of the turns' rewards where any was given; then what the
        environment's own `metrics()` returned at the end (an episode-level figure such as the
        tools environment's `tool_success`), over a turn average of the same name. The first
        MAX_METRICS keys; non-finite values, non-numbers and bad names are skipped.

        They travel with the sample (Rollout.env_metrics): the trainer logs each as `env/<key>`
        per step and per evaluation round, and a reward function may read them (`episode`)."""
        values: dict[str, list[float]] = {}
        for t in self.turns:
            if t.kind == "model":
                for k, v in t.info.items():
                    if _figure(k, v) and (k in values or len(values) < MAX_METRICS - 1):
                        values.setdefault(k, []).append(float(v))
        out = {k: sum(v) / len(v) for k, v in values.items()}
        given = [r for r in self.rewards if r is not None and math.isfinite(r)]
        if given:
            out["reward"] = float(sum(given))
        for k, v in self.env_metrics.items():
            if _figure(k, v) and (k in out or len(out) < MAX_METRICS):
                out[k] = float(v)
        return out

    def append_model(
        self, ids: Sequence[int], logprobs: Sequence[float], text: str, finish_reason: str | None
    ) -> TurnRecord:
        """Append a model turn: exactly the sampled ids, mask 1, their logprobs.

        Raises:
            ValueError: ids and logprobs differ in length.
        """
        if len(ids) != len(logprobs):
            raise ValueError(
                f"a model turn has {len(ids)} ids but {len(logprobs)} logprobs; generate must return one per id"
            )
        turn = TurnRecord("model", len(self.ids), len(self.ids) + len(ids), text, finish_reason=finish_reason)
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": text})
        self.finish_reason = finish_reason
        return turn

    def append_env(self, ids: Sequence[int], text: str, message: Message) -> TurnRecord:
        """Append an environment reply's ids (tokenized once, by the caller): mask 0, logprob 0.0."""
        turn = TurnRecord("env", len(self.ids), len(self.ids) + len(ids), text)
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.turns.append(turn)
        self.messages.append(message)
        return turn

    def score_last_turn(self, reward: float | None, info: Mapping[str, Any]) -> None:
        """Record the step's reward and info on the last model turn."""
        i = max(i for i, t in enumerate(self.turns) if t.kind == "model")
        self.turns[i] = replace(self.turns[i], reward=reward, info=dict(info))

    def end(self, reason: str) -> Episode:
        self.stop_reason = reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 14] + " ...(truncated)"
        return self


# --- the driver -----------------------------------------------------------------------------------


class _Raised(Exception):
    """The environment's own exception, told apart from the time budget's TimeoutError."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(exc)
        self.exc = exc


async def _call(fn: Callable[[Any], Any], arg: Any, timeout_s: float) -> Any:
    """`fn(arg)` under the time budget: in the loop if it is async, else in a thread."""

    async def run() -> Any:
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(arg)
            value = await asyncio.to_thread(fn, arg)
            return await value if inspect.isawaitable(value) else value
        except (Exception, SystemExit) as exc:
            raise _Raised(exc) from exc

    return await asyncio.wait_for(run(), timeout_s)


def _error(where: str, exc: BaseException) -> str:
    return f"env_error: {where}: {type(exc).__name__}: {exc}"


async def run_episode(env: Environment, row: Row, generate: Generate, codec: Codec, limits: EpisodeLimits) -> Episode:
    """Play one episode: start, then model turn -> environment step until done or a limit; then
    the environment's own `end(turn)`, where it has one, with the model turn that ended the episode
    unstepped (cut by the token budget or the engine: still the conversation's last message), and
    its own `metrics()`, where it has one (see `Episode.metrics`).

    Never raises for the environment: its exception, a call over `limits.step_timeout_s` or a
    return value of the wrong shape ends this episode with the reason (`Episode.stop_reason`), and
    other episodes on the loop go on. Never blocks the loop: a sync environment's calls run in a
    thread (abandoned, not killed, when over the budget: it keeps a worker of the default executor
    until it returns), an async one's in the loop under `asyncio.wait_for`.

    Args:
        env: a fresh environment (one per episode).
        row: the dataset row (`start`'s argument).
        generate: one model turn (`Generate`); its exceptions propagate (the caller's engine).
        codec: how text becomes ids (`codec_for`, `PlainCodec`, `ChatCodec`).
        limits: the episode's bounds.

    Raises:
        ValueError: generate returned ids and logprobs of different lengths.
    """
    ep = await _play(env, row, generate, codec, limits)
    end = getattr(env, "end", None)
    if callable(end) and ep.unanswered:
        last = ep.turns[-1]
        turn = ModelTurn(last.text, tuple(ep.ids[last.start : last.end]), last.finish_reason, ep.num_turns - 1)
        with contextlib.suppress(Exception):  # like metrics(): the episode itself is played
            await _call(end, turn, limits.step_timeout_s)
    own = getattr(env, "metrics", None)
    if callable(own) and ep.ids:
        try:
            value = await _call(lambda _: own(), None, limits.step_timeout_s)
            ep.env_metrics = dict(value) if isinstance(value, Mapping) else {}
        except Exception:  # figures only: a failing metrics() costs the episode nothing else
            ep.env_metrics = {}
    return ep


async def _play(env: Environment, row: Row, generate: Generate, codec: Codec, limits: EpisodeLimits) -> Episode:
    timeout = limits.step_timeout_s
    try:
        opening = coerce_opening(await _call(env.start, row, timeout))
    except TimeoutError:
        return Episode([]).end("env_timeout")
    except _Raised as r:
        return Episode([]).end(_error("start", r.exc))
    except Exception as exc:  # the opening's shape
        return Episode([]).end(f"env_error: {exc}")
    try:
        prompt_ids = codec.prompt_ids(opening)
    except Exception as exc:
        return Episode([]).end(_error("rendering the opening", exc))
    ep = Episode(list(prompt_ids))
    ep.messages = [{"role": "user", "content": opening}] if isinstance(opening, str) else list(opening)

    while True:
        # model turn
        if ep.num_turns >= limits.max_turns:
            return ep.end("max_turns")
        room = limits.max_total_tokens - ep.total_tokens
        if room <= 0:
            return ep.end("max_tokens")
        sampled, sampled_logprobs, finish = await generate(ep.prompt_ids + ep.ids, room)
        if len(sampled) != len(sampled_logprobs):
            raise ValueError(f"generate returned {len(sampled)} ids but {len(sampled_logprobs)} logprobs; one per id")
        ids, logprobs = list(sampled)[:room], list(sampled_logprobs)[:room]
        ep.append_model(ids, logprobs, codec.decode(ids), finish)
        ep.unanswered = finish != "stop" or len(sampled) > room
        if len(sampled) > room or (finish == "length" and ep.total_tokens >= limits.max_total_tokens):
            return ep.end("max_tokens")
        if finish == "length":
            return ep.end("length")  # a cut-off turn is no message to answer
        if finish != "stop":
            return ep.end("model_stop")

        # environment step
        turn = ModelTurn(ep.final_text, tuple(ids), finish, ep.num_turns - 1)
        try:
            result = coerce_step(await _call(env.step, turn, timeout))
        except TimeoutError:
            return ep.end("env_timeout")
        except _Raised as r:
            return ep.end(_error("step", r.exc))
        except Exception as exc:  # the return value's shape, or a missing step method
            return ep.end(f"env_error: {exc}")
        ep.unanswered = False
        ep.score_last_turn(result.reward, result.info)
        if result.text:
            try:
                message, reply_ids = codec.reply(ep.messages, ids, result.role, result.text)
            except Exception as exc:
                return ep.end(_error("rendering the reply", exc))
            if ep.total_tokens + len(reply_ids) > limits.max_total_tokens:
                # No partial reply: it would be text the environment never said.
                return ep.end("done" if result.done else "max_tokens")
            ep.append_env(reply_ids, result.text, message)
        if result.done:
            return ep.end("done")
