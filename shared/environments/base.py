"""The environment interface: what a multi-turn, tool-using rollout talks to between model turns.

An environment is a class (or any factory) loaded by name or import path
(shared.environments.registry) and called with the spec's kwargs once per episode, so an instance
holds one episode's state. Two methods, each a plain method or `async def`:

    start(row: Problem | Mapping) -> str | list[dict]           the episode's opening
    step(turn: ModelTurn) -> StepResult                          the reply to one model turn

`start` gets the dataset row (a shared.tasks.Problem, or a dict with "prompt" and optionally
"messages") and returns the prompt: a list of chat messages ({"role", "content"}) or a plain prompt
string. `step` gets the model's turn (its text and the token ids it sampled) and returns the text
to append (may be empty), an optional reward for that turn, whether the episode is over, and an
optional info dict. A plain dict with those keys is accepted for a StepResult.

Optionally, `end(turn: ModelTurn)` (plain or `async def`), called when the episode ended on a model
turn that was not stepped (cut by the token budget or the engine): the conversation's last message,
for an environment that scores the whole conversation (the `verifiers` environment).

Optionally, `metrics() -> dict[str, float]` (plain or `async def`), called once when the episode
has ended: episode-level figures (the tools environment's `tool_success`). They and the info's
numbers, averaged over turns, travel with the sample; the trainer logs them as `env/<key>` per
step and per evaluation round, and reward functions may read them (`episode=`).

Where they run (shared.environments.episode.run_episode): `async def` methods in the event loop
that runs every episode (they must not block it); plain methods in a thread (`asyncio.to_thread`).
Each call has the time budget `EpisodeLimits.step_timeout_s`; an exception, a timeout or a return
value of the wrong shape ends that episode with the reason, never the caller.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from shared.environments.spec import EnvironmentSpec, EpisodeLimits
from shared.tasks import Problem

Message = dict[str, Any]
Opening = str | list[Message]
Row = Problem | Mapping[str, Any]
ReplyRole = Literal["tool", "user"]

__all__ = [
    "Environment",
    "EnvironmentShapeError",
    "EnvironmentFactory",
    "EnvironmentSpec",
    "EpisodeLimits",
    "Message",
    "ModelTurn",
    "Opening",
    "ReplyRole",
    "Row",
    "StepResult",
    "coerce_opening",
    "coerce_step",
    "row_messages",
]


@dataclass(frozen=True)
class ModelTurn:
    """One model turn, as `step` receives it.

    Attributes:
        text: the sampled ids decoded, special tokens skipped.
        ids: exactly the ids the engine sampled (the episode keeps these, never a re-tokenization).
        finish_reason: the engine's ("stop"; a turn cut at "length" ends the episode unstepped).
        index: 0 for the first model turn of the episode.
    """

    text: str
    ids: tuple[int, ...]
    finish_reason: str | None = "stop"
    index: int = 0


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one model turn.

    Attributes:
        text: the reply's content to append ("" appends nothing); rendered as a `role` message
            with the chat template, or as plain text (shared.environments.episode).
        reward: this turn's reward, or None.
        done: the episode is over (the text, if any, is still appended).
        info: anything to record for the turn (JSON-like values), e.g. whether a tool call parsed.
        role: "tool" (a tool's result) or "user" (anything else the environment says).
    """

    text: str = ""
    reward: float | None = None
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)
    role: ReplyRole = "tool"


class Environment(Protocol):
    """One episode's environment (either method may be `async def`; see the module docstring)."""

    def start(self, row: Row) -> Opening | Awaitable[Opening]: ...

    def step(self, turn: ModelTurn) -> StepResult | Mapping[str, Any] | Awaitable[StepResult | Mapping[str, Any]]: ...


EnvironmentFactory = Callable[[], Environment]
"""Builds a fresh environment for one episode (the spec's kwargs already bound)."""


class EnvironmentShapeError(ValueError):
    """An environment returned something of the wrong shape (the message says what was expected)."""


def row_messages(row: Row) -> list[Message]:
    """The row's conversation: its messages if it has any, else its prompt as the one user turn."""
    if isinstance(row, Problem):
        prompt, messages = row.prompt, row.messages
    else:
        prompt, messages = str(row.get("prompt", "")), row.get("messages")
    if messages:
        return [dict(m) for m in messages]
    return [{"role": "user", "content": prompt}]


def coerce_opening(value: Any) -> Opening:
    """`start`'s return value checked: a string, or a non-empty list of messages with str role and content.

    Raises:
        EnvironmentShapeError: naming what was returned and what is expected.
    """
    if isinstance(value, str):
        return value
    if (
        isinstance(value, Sequence)
        and value
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        return [dict(m) for m in value]
    raise EnvironmentShapeError(
        f"start returned {_describe(value)}; expected a prompt string or a non-empty list of "
        "{'role': str, 'content': str} messages"
    )


def coerce_step(value: Any) -> StepResult:
    """`step`'s return value checked: a StepResult, or a dict with its fields.

    Raises:
        EnvironmentShapeError: naming the offending field or type.
    """
    if isinstance(value, Mapping):
        unknown = set(value) - {"text", "reward", "done", "info", "role"}
        if unknown:
            raise EnvironmentShapeError(
                f"step returned a dict with unknown keys {sorted(map(str, unknown))}; "
                "expected text, reward, done, info, role"
            )
        value = StepResult(**value)
    if not isinstance(value, StepResult):
        raise EnvironmentShapeError(
            f"step returned {_describe(value)}; expected a StepResult or a dict with its fields"
        )
    if not isinstance(value.text, str):
        raise EnvironmentShapeError(f"step returned text {_describe(value.text)}; expected a str")
    if value.reward is not None and (
        isinstance(value.reward, bool) or not isinstance(value.reward, int | float) or not math.isfinite(value.reward)
    ):
        raise EnvironmentShapeError(f"step returned reward {_describe(value.reward)}; expected a finite number or None")
    if not isinstance(value.done, bool):
        raise EnvironmentShapeError(f"step returned done {_describe(value.done)}; expected a bool")
    if not isinstance(value.info, Mapping) or not all(isinstance(k, str) for k in value.info):
        raise EnvironmentShapeError(f"step returned info {_describe(value.info)}; expected a dict with str keys")
    if value.role not in ("tool", "user"):
        raise EnvironmentShapeError(f"step returned role {_describe(value.role)}; expected 'tool' or 'user'")
    reward = None if value.reward is None else float(value.reward)
    return StepResult(value.text, reward, value.done, dict(value.info), value.role)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{text[:80]}{'...' if len(text) > 80 else ''} ({type(value).__name__})"
