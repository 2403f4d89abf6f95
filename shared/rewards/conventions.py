"""Python rewards written for another framework, called exactly as that framework calls them.

A `python` reward declares `convention` (or leaves it out, and its signature decides: `recognise`):

- ``asyncrl``: this project's own (shared.rewards.python, `score(completion, answer, *, prompt, ...)`).
- ``verl``: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, one call per
  sample, by keyword, as verl's reward managers call it. `data_source` and `extra_info` are the row's
  columns of those names (None where the row has none), `ground_truth` the row's
  `reward_model.ground_truth` as stored (a list stays a list), else the task's answer. A float is
  the reward; a dict's `score` is, and its other numeric entries (bools as 0/1) are logged as reward
  components, as verl logs them as reward_extra_info (entries that are not numbers are left out).
- ``trl``: `reward_func(prompts=..., completions=..., completion_ids=..., **columns) -> list[float]`,
  one call per batch (`batch_size` samples), as TRL's GRPOTrainer calls it: `prompts` the rows'
  `prompt` column as stored (chat messages or text; the rendered prompt where the row has none),
  `completions` a string each for a standard prompt and `[{"role": "assistant", "content": ...}]`
  for a conversational one (decided from the batch's first row, as TRL does), `completion_ids` the
  sampled token ids, and every other column of the rows as a list. A None in the returned list is
  "does not apply": TRL sums a sample's rewards ignoring NaN, so it is 0.0 here. TRL's
  `trainer_state` (its Trainer's state object) has no counterpart and is not passed; several TRL
  reward functions with `reward_weights` are a `sum` reward of one term each.
- ``verifiers``: rubric functions whose arguments are chosen by parameter name (`prompt`,
  `completion`, `answer`, `state`, `task`, `info`, `parser`; everything to one taking ``**kwargs``),
  one call per sample, each returning a float. `function` may name one function, a list of them
  (weighted by the spec's `weights`) or a rubric (an object with `reward_funcs`/`funcs`,
  `reward_weights`/`weights` and optionally `parser`, as `verifiers.Rubric` has). Each function is a
  reward component under its name; the reward is their weighted sum. `prompt` and `completion` are
  chat messages when the row's `prompt` column is (task.format trl or verl), else text; `info` is
  the row's `info` column, or where it has none the row's other columns; `task` the row's `task`
  column or "default"; `parser` the rubric's, else `PlainParser`.

The data reaches a worker process as it reaches the native convention (RewardInput's JSON over
msgpack, shared.rewards.pool): nothing else crosses the process boundary. Errors name the
convention ("verl convention: compute_score returned a list; expected a float or a dict with 'score'").
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from shared.rewards.base import MAX_COMPONENTS, RewardInput, RewardLoadError, RewardResult, error_from, failed

Convention = Literal["asyncrl", "verl", "trl", "verifiers"]
CONVENTIONS: tuple[str, ...] = ("asyncrl", "verl", "trl", "verifiers")

VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
VERIFIERS_ARGS = ("prompt", "completion", "answer", "state", "task", "info", "parser")
# Columns TRL keeps out of a reward function's dataset keyword arguments (it passes them itself).
TRL_RESERVED = ("prompt", "completion", "completion_ids")


class RewardCall(Protocol):
    """A loaded reward function of any convention: what the runners (threads, worker processes,
    the event loop) call. `call_sync`/`call_async` never raise for the function's errors."""

    @property
    def label(self) -> str: ...

    @property
    def batched(self) -> bool: ...

    @property
    def is_async(self) -> bool: ...

    def call_sync(self, items: Sequence[RewardInput]) -> list[RewardResult]: ...

    async def call_async(self, items: Sequence[RewardInput]) -> list[RewardResult]: ...


def _name(label: str) -> str:
    return label.rsplit(":", 1)[-1].rsplit(".", 1)[-1]


def _number(v: Any) -> float | None:
    """``v`` as a float when it is a number (bools as 0/1, numpy scalars), else None."""
    if isinstance(v, (str, bytes)) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def is_messages(value: Any) -> bool:
    """A chat conversation: a non-empty list of {role, content} dicts (TRL's `is_conversational`)."""
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    )


def _params(fn: Callable[..., Any]) -> tuple[set[str], bool] | None:
    """The names a function takes by keyword and whether it takes **kwargs; None without a signature."""
    try:
        ps = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    named = {p.name for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind == p.VAR_KEYWORD for p in ps)


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def _rubric_parts(obj: Any) -> tuple[list[Any], list[float] | None, Any] | None:
    """(functions, weights, parser) of a rubric: a list of functions or an object holding them
    (verifiers.Rubric: reward_funcs, reward_weights, parser); None for anything else."""
    if isinstance(obj, (list, tuple)):
        return list(obj), None, None
    funcs = getattr(obj, "reward_funcs", None) or getattr(obj, "funcs", None)
    if isinstance(funcs, (list, tuple)) and not callable(obj):
        weights = getattr(obj, "reward_weights", None) or getattr(obj, "weights", None)
        return list(funcs), [float(w) for w in weights] if weights else None, getattr(obj, "parser", None)
    return None


def _required(fn: Callable[..., Any]) -> set[str]:
    """The parameters a call must pass (no default, not * or **)."""
    ps = inspect.signature(fn).parameters.values()
    return {p.name for p in ps if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def recognise(obj: Any, batched: bool) -> tuple[Convention, str]:
    """The convention a reward object is written for, and why (for the log line).

    A rubric (a list of functions, or an object holding them) is verifiers'; a signature naming
    data_source, solution_str and ground_truth is verl's; one naming `completions` and taking what
    TRL passes besides (**kwargs, or prompts and completion_ids), not declared `batched` (this
    project's own batched form), is TRL's; one requiring state, task, info or parser is verifiers';
    anything else is this project's own. Each rule matches only signatures this project's own
    convention cannot call (it passes completion and answer positionally and none of those names),
    so a reward that loaded before is still called the same way.
    """
    if _rubric_parts(obj) is not None:
        return "verifiers", "a rubric: a list of functions or an object holding reward_funcs"
    got = _params(obj) if callable(obj) else None
    if got is None:
        return "asyncrl", "no signature to read"
    names, takes_any = got
    if {"data_source", "solution_str", "ground_truth"} <= names:
        return "verl", "its signature names data_source, solution_str and ground_truth"
    if "completions" in names and not batched and (takes_any or {"prompts", "completion_ids"} <= names):
        return "trl", "its signature names completions and takes TRL's other arguments (batched is false)"
    if hit := sorted(_required(obj) & {"state", "task", "info", "parser"}):
        return "verifiers", f"its signature requires {', '.join(hit)}"
    return "asyncrl", "its signature names none of verl's, TRL's or verifiers' arguments"


# --- verl ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerlCall:
    """verl's `compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`, per sample."""

    fn: Callable[..., Any]
    label: str
    is_async: bool
    kwargs: dict[str, Any] = field(default_factory=dict)
    batched: bool = False

    @classmethod
    def load(cls, fn: Any, label: str, kwargs: dict[str, Any]) -> VerlCall:
        if not callable(fn):
            raise RewardLoadError(f"verl convention: {label!r} is {type(fn).__name__}, not callable")
        try:
            inspect.signature(fn).bind(**dict.fromkeys(VERL_ARGS), **kwargs)
        except TypeError as exc:
            raise RewardLoadError(
                f"verl convention: {label!r} cannot be called as verl calls it, {_name(label)}(data_source=..., "
                f"solution_str=..., ground_truth=..., extra_info=...{', ' if kwargs else ''}"
                f"{', '.join(f'{k}=...' for k in kwargs)}): {exc}"
            ) from None
        except ValueError:
            pass  # no signature to check: the call will say
        return cls(fn, label, _is_async(fn), dict(kwargs))

    def arguments(self, it: RewardInput) -> dict[str, Any]:
        md = it.metadata
        rm = md.get("reward_model")
        truth = rm["ground_truth"] if isinstance(rm, Mapping) and rm.get("ground_truth") is not None else it.answer
        return {
            "data_source": md.get("data_source"),
            "solution_str": it.completion,
            "ground_truth": truth,
            "extra_info": md.get("extra_info"),
            **self.kwargs,
        }

    def result(self, value: Any) -> RewardResult:
        what = f"verl convention: {_name(self.label)}"
        if isinstance(value, Mapping):
            if "score" not in value:
                keys = ", ".join(map(str, list(value)[:20]))
                return failed(
                    "error", f"{what} returned a dict without 'score' (keys: {keys}); verl reads the reward there"
                )
            score = _number(value["score"])
            if score is None:
                return failed("error", f"{what} returned score={value['score']!r:.200}; expected a number")
            extras = {str(k): n for k, v in value.items() if k != "score" and (n := _number(v)) is not None}
            if len(extras) > MAX_COMPONENTS:
                return failed(
                    "error", f"{what} returned {len(extras)} numeric entries besides 'score'; at most {MAX_COMPONENTS}"
                )
            return RewardResult(reward=score, components=extras)
        score = _number(value)
        if score is None:
            return failed(
                "error",
                f"{what} returned {type(value).__name__} {value!r:.200}; expected a float or a dict with 'score'",
            )
        return RewardResult(reward=score)

    def call_sync(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        try:
            return [self.result(self.fn(**self.arguments(it))) for it in items]
        except Exception as exc:
            return [error_from(exc, f"verl convention: {self.label}")] * len(items)

    async def call_async(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        try:
            return [self.result(await self.fn(**self.arguments(it))) for it in items]
        except Exception as exc:
            return [error_from(exc, f"verl convention: {self.label}")] * len(items)


# --- TRL -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrlCall:
    """TRL's `reward_func(prompts=, completions=, completion_ids=, **columns) -> list[float | None]`,
    one call per batch."""

    fn: Callable[..., Any]
    label: str
    is_async: bool
    kwargs: dict[str, Any] = field(default_factory=dict)
    batched: bool = True

    @classmethod
    def load(cls, fn: Any, label: str, kwargs: dict[str, Any]) -> TrlCall:
        if not callable(fn):
            raise RewardLoadError(f"trl convention: {label!r} is {type(fn).__name__}, not callable")
        got = _params(fn)
        if got is not None and not got[1]:
            missing = [a for a in ("prompts", "completions", "completion_ids") if a not in got[0]]
            raise RewardLoadError(
                f"trl convention: {label!r} takes no **kwargs{' nor ' + ', '.join(missing) if missing else ''}; TRL "
                f"calls every reward function as {_name(label)}(prompts=..., completions=..., completion_ids=..., "
                "**dataset_columns): add **kwargs"
            )
        return cls(fn, label, _is_async(fn), dict(kwargs))

    def arguments(self, items: Sequence[RewardInput]) -> dict[str, Any]:
        prompts = [it.metadata["prompt"] if it.metadata.get("prompt") is not None else it.prompt for it in items]
        if is_messages(prompts[0]):
            completions: list[Any] = [[{"role": "assistant", "content": it.completion}] for it in items]
        else:
            completions = [it.completion for it in items]
        keys = [k for k in items[0].metadata if k not in TRL_RESERVED]
        columns = {k: [it.metadata.get(k) for it in items] for k in keys}
        return {
            **columns,
            "prompts": prompts,
            "completions": completions,
            "completion_ids": [list(it.completion_ids) for it in items],
            **self.kwargs,
        }

    def results(self, values: Any, n: int) -> list[RewardResult]:
        what = f"trl convention: {_name(self.label)}"
        if (
            isinstance(values, (str, bytes, Mapping))
            or not isinstance(values, Sequence)
            and not hasattr(values, "tolist")
        ):
            return [failed("error", f"{what} returned {type(values).__name__}; expected a list of {n} floats")] * n
        values = list(values.tolist() if hasattr(values, "tolist") else values)
        if len(values) != n:
            return [failed("error", f"{what} returned {len(values)} values for {n} completions; expected one each")] * n
        out = []
        for i, v in enumerate(values):
            x = 0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else _number(v)
            if x is None:
                out.append(failed("error", f"{what} returned {v!r:.200} at position {i}; expected a float (or None)"))
            else:
                out.append(RewardResult(reward=x))
        return out

    def call_sync(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        try:
            return self.results(self.fn(**self.arguments(items)), len(items))
        except Exception as exc:
            return [error_from(exc, f"trl convention: {self.label}")] * len(items)

    async def call_async(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        try:
            return self.results(await self.fn(**self.arguments(items)), len(items))
        except Exception as exc:
            return [error_from(exc, f"trl convention: {self.label}")] * len(items)


# --- verifiers -----------------------------------------------------------------------------------


class PlainParser:
    """The parser a rubric function gets when its rubric has none: verifiers' base `Parser`
    behaviour (text as it is; the answer is the last assistant message's content)."""

    def parse(self, text: str) -> str:
        return text

    def parse_answer(self, completion: Any) -> str | None:
        if isinstance(completion, str):
            return self.parse(completion)
        for m in reversed(list(completion or [])):
            if isinstance(m, Mapping) and m.get("role") == "assistant":
                return self.parse(str(m.get("content", "")))
        return None


@dataclass(frozen=True)
class RubricFunc:
    name: str
    fn: Callable[..., Any]
    weight: float
    takes: frozenset[str] | None  # None: takes **kwargs (everything)


@dataclass(frozen=True)
class VerifiersCall:
    """Rubric functions, arguments by parameter name, each a named component; per sample."""

    funcs: tuple[RubricFunc, ...]
    parser: Any
    label: str
    is_async: bool
    kwargs: dict[str, Any] = field(default_factory=dict)
    batched: bool = False

    @classmethod
    def load(cls, obj: Any, label: str, kwargs: dict[str, Any], weights: Sequence[float] | None) -> VerifiersCall:
        parts = _rubric_parts(obj)
        funcs, own_weights, parser = parts if parts is not None else ([obj], None, None)
        if not funcs:
            raise RewardLoadError(f"verifiers convention: {label!r} holds no reward functions")
        chosen = list(weights) if weights is not None else own_weights or [1.0] * len(funcs)
        if len(chosen) != len(funcs):
            raise RewardLoadError(
                f"verifiers convention: {label!r} has {len(funcs)} reward functions but {len(chosen)} weights"
            )
        out: list[RubricFunc] = []
        for fn, w in zip(funcs, chosen, strict=True):
            if not callable(fn):
                raise RewardLoadError(f"verifiers convention: {label!r} holds {type(fn).__name__}, not a function")
            got = _params(fn)
            takes = None if got is None or got[1] else frozenset(got[0])
            out.append(RubricFunc(getattr(fn, "__name__", type(fn).__name__), fn, float(w), takes))
        names = [f.name for f in out]
        if len(set(names)) != len(names):
            raise RewardLoadError(
                f"verifiers convention: {label!r}: reward function names repeat ({names}); each is a logged term"
            )
        return cls(tuple(out), parser or PlainParser(), label, any(_is_async(f.fn) for f in out), dict(kwargs))

    def arguments(self, it: RewardInput) -> dict[str, Any]:
        md = it.metadata
        chat = is_messages(md.get("prompt"))
        prompt = md["prompt"] if chat else it.prompt
        completion: Any = [{"role": "assistant", "content": it.completion}] if chat else it.completion
        info = md["info"] if isinstance(md.get("info"), Mapping) else dict(md)
        task = md["task"] if isinstance(md.get("task"), str) else "default"
        state = {
            "prompt": prompt,
            "completion": completion,
            "answer": it.answer,
            "task": task,
            "info": info,
            "responses": [],
            "turn": 1,
            "finish_reason": it.finish_reason,
            "episode": dict(it.episode),
        }
        return {
            "prompt": prompt,
            "completion": completion,
            "answer": it.answer,
            "state": state,
            "task": task,
            "info": info,
            "parser": self.parser,
            **self.kwargs,
        }

    def _args_for(self, f: RubricFunc, args: dict[str, Any]) -> dict[str, Any]:
        return args if f.takes is None else {k: v for k, v in args.items() if k in f.takes}

    def _combine(self, values: list[tuple[RubricFunc, Any]]) -> RewardResult:
        comps: dict[str, float] = {}
        for f, v in values:
            x = _number(v)
            if x is None:
                return failed(
                    "error", f"verifiers convention: rubric function {f.name!r} returned {v!r:.200}; expected a float"
                )
            comps[f.name] = x
        return RewardResult(reward=math.fsum(f.weight * comps[f.name] for f, _ in values), components=comps)

    def call_sync(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        out = []
        for it in items:
            args, values = self.arguments(it), []
            for f in self.funcs:
                try:
                    values.append((f, f.fn(**self._args_for(f, args))))
                except Exception as exc:
                    out.append(error_from(exc, f"verifiers convention: rubric function {f.name!r}"))
                    break
            else:
                out.append(self._combine(values))
        return out

    async def call_async(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        out = []
        for it in items:
            args, values = self.arguments(it), []
            for f in self.funcs:
                try:
                    v = f.fn(**self._args_for(f, args))
                    values.append((f, await v if inspect.isawaitable(v) else v))
                except Exception as exc:
                    out.append(error_from(exc, f"verifiers convention: rubric function {f.name!r}"))
                    break
            else:
                out.append(self._combine(values))
        return out
