"""Python reward functions: a built-in by name or a user's function by import path.

A function written for verl, TRL or verifiers is called as that framework calls it
(shared.rewards.conventions: the spec's `convention`, or recognised from the signature). This
project's own calling convention (`asyncrl`), per sample (`batched: false`):

    def score(completion: str, answer: str, *, prompt: str, metadata: dict, finish_reason: str | None,
              episode: dict[str, float], **kwargs) -> float | dict[str, float]

`completion` and `answer` come positionally (the first two parameters, whatever their names);
`prompt`, `metadata` (the dataset row's other columns), `finish_reason` and `episode` (a multi-turn
episode's metrics, shared.environments: `reward` the sum of the environment's per-turn rewards;
empty for a single turn) come by keyword, each
only if the signature names it (or takes **kwargs), so `def score(completion, answer)` is a valid
reward; the spec's `kwargs` come by keyword too and must be accepted. `async def` works the same.
Batched (`batched: true`), every input is a list of the same length and so is the return value:

    def score(completions: list[str], answers: list[str], *, prompts: list[str],
              metadata: list[dict], finish_reasons: list[str | None], episodes: list[dict],
              **kwargs) -> list[float | dict]

A number is the reward. A dict of named numbers is the reward's components: the reward is their sum
and each is logged by name (Scored.details). Anything else, or an exception, is status `error` with
the reason; running past `timeout_s` is status `timeout`.

Where it runs: `async def` functions run concurrently in an event loop of their own, in a thread
of the reward service (shared.rewards.loops): they must not block, but one that does costs its
time budget and that loop (abandoned and replaced), never the service. Sync functions run in
worker processes (REWARD_WORKERS > 0: a worker over the budget is killed and replaced) or in
threads (REWARD_WORKERS=0: a thread over the budget is abandoned, still running; see
shared.rewards.pool).

A file outside the project, `path/to/my_rewards.py:score`, is imported as a module of its own
(relative paths from the reward service's working directory); `my_rewards:score` needs the module
on the reward service's PYTHONPATH. The module is imported when the service builds the job's
scorer, first in a child process under a time limit (shared.rewards.pool `probe_import`): an
import that raises, calls sys.exit, crashes the interpreter or hangs is a RewardLoadError naming
what failed (the job fails with it), not the service's end.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.rewards.base import (
    BuildContext,
    RewardInput,
    RewardLoadError,
    RewardResult,
    coerce,
    coerce_batch,
    error_from,
    failed,
)
from shared.rewards.builtin import REWARD_FUNCTIONS
from shared.rewards.conventions import Convention, RewardCall, TrlCall, VerifiersCall, VerlCall, recognise
from shared.rewards.loops import Blocked, LoopThread
from shared.rewards.spec import BuiltinReward, PythonReward

log = logging.getLogger(__name__)


def import_object(path: str, what: str = "reward function") -> Any:
    """The object at 'package.module:attr' or 'path/to/file.py:attr' (attr may be dotted).

    `what` names the plug-in in errors ("reward function", "environment").

    Raises:
        RewardLoadError: naming the module or file and what failed (the import's own error).
    """
    module_part, sep, attr = path.rpartition(":")
    if not sep or not module_part or not attr:
        raise RewardLoadError(f"{path!r} is not an import path 'package.module:function' or 'path/to/file.py:function'")
    if module_part.endswith(".py"):
        file = Path(module_part).expanduser().resolve()
        if not file.is_file():
            raise RewardLoadError(f"{what} {path!r}: file {str(file)!r} does not exist")
        # A name of its own per file, so two files both called rewards.py do not collide.
        name = f"asyncrl_reward_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, file)
            if spec is None or spec.loader is None:
                raise RewardLoadError(f"{what} {path!r}: {str(file)!r} cannot be loaded as a module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # before exec: dataclasses and typing look the module up
            try:
                spec.loader.exec_module(module)
            except (Exception, SystemExit) as exc:  # sys.exit at import: the plug-in's error, not the caller's end
                del sys.modules[name]
                raise RewardLoadError(f"{what} {path!r}: importing {str(file)!r} failed: {_why(exc)}") from exc
        where = repr(str(file))
    else:
        try:
            module = importlib.import_module(module_part)
        except (Exception, SystemExit) as exc:
            raise RewardLoadError(f"{what} {path!r}: cannot import module {module_part!r}: {_why(exc)}") from exc
        where = f"module {module_part!r}"
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RewardLoadError(f"{what} {path!r}: {where} has no attribute {attr!r}") from None
    return obj


def _why(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


@dataclass(frozen=True)
class LoadedFunction:
    """A reward function and how to call it (the convention in this module's docstring)."""

    fn: Callable[..., Any]
    label: str  # for reasons: the import path or built-in name
    batched: bool
    is_async: bool
    inputs: tuple[str, ...]  # the keyword inputs the signature accepts
    kwargs: dict[str, Any] = field(default_factory=dict)

    def _call_args(self, items: Sequence[RewardInput]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.batched:
            pos: tuple[Any, ...] = ([it.completion for it in items], [it.answer for it in items])
            values: dict[str, Any] = {
                "prompts": [it.prompt for it in items],
                "metadata": [dict(it.metadata) for it in items],
                "finish_reasons": [it.finish_reason for it in items],
                "episodes": [dict(it.episode) for it in items],
            }
        else:
            (it,) = items
            pos = (it.completion, it.answer)
            values = {
                "prompt": it.prompt,
                "metadata": dict(it.metadata),
                "finish_reason": it.finish_reason,
                "episode": dict(it.episode),
            }
        return pos, {**{k: values[k] for k in self.inputs}, **self.kwargs}

    def _results(self, value: Any, n: int) -> list[RewardResult]:
        out = coerce_batch(value, n) if self.batched else [coerce(value)]
        return [r if r.ok else failed(r.status, f"{self.label}: {r.reason}") for r in out]

    def call_sync(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        """Score `items` (one item unless batched) in this thread; never raises for the function's errors."""
        try:
            args, kwargs = self._call_args(items)
            return self._results(self.fn(*args, **kwargs), len(items))
        except Exception as exc:
            return [error_from(exc, self.label)] * len(items)

    async def call_async(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        try:
            args, kwargs = self._call_args(items)
            return self._results(await self.fn(*args, **kwargs), len(items))
        except Exception as exc:
            return [error_from(exc, self.label)] * len(items)


def load_function(spec: BuiltinReward | PythonReward) -> RewardCall:
    """Import the spec's function and check it can be called by its convention (the spec's
    `convention`, else the one its signature is recognised as: shared.rewards.conventions).

    Raises:
        RewardLoadError: the import failed, the object is not callable, or its signature does not
            take what its convention passes (here: (completion, answer) positionally plus the
            spec's kwargs).
    """
    return load_with_convention(spec)[0]


def load_with_convention(spec: BuiltinReward | PythonReward) -> tuple[RewardCall, Convention, str]:
    """`load_function`, with the convention it is called by and why (declared or recognised)."""
    if isinstance(spec, BuiltinReward):
        return _load_native(REWARD_FUNCTIONS[spec.name], spec.name, False, {}), "asyncrl", "a built-in"
    fn = import_object(spec.function)
    label, extra = str(spec.function), dict(spec.kwargs)
    if spec.convention is not None:
        convention: Convention = spec.convention
        why = "declared in the spec"
    else:
        convention, why = recognise(fn, spec.batched)
    if convention == "verl":
        call: RewardCall = VerlCall.load(fn, label, extra)
    elif convention == "trl":
        call = TrlCall.load(fn, label, extra)
    elif convention == "verifiers":
        call = VerifiersCall.load(fn, label, extra, spec.weights)
    else:
        call = _load_native(fn, label, spec.batched, extra)
    return call, convention, why


def _load_native(fn: Any, label: str, batched: bool, extra: dict[str, Any]) -> LoadedFunction:
    if not callable(fn):
        raise RewardLoadError(f"reward function {label!r} is {type(fn).__name__}, not callable")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: pass the two positionals only
        return LoadedFunction(fn, label, batched, _is_async(fn), (), extra)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {
        p.name for p in positional
    }
    offered = (
        ("prompts", "metadata", "finish_reasons", "episodes")
        if batched
        else ("prompt", "metadata", "finish_reason", "episode")
    )
    inputs = tuple(n for n in offered if takes_any or n in named)
    try:
        sig.bind(None, None, **dict.fromkeys(inputs), **extra)
    except TypeError as exc:
        two = "completions, answers" if batched else "completion, answer"
        kw = ", ".join(f"{k}=..." for k in (*inputs, *extra))
        raise RewardLoadError(
            f"reward function {label!r} with signature {sig} cannot be called as "
            f"{label.rsplit(':', 1)[-1]}({two}{', ' if kw else ''}{kw}): {exc}"
        ) from None
    return LoadedFunction(fn, label, batched, _is_async(fn), inputs, extra)


class FunctionScorer:
    """Built-in and python kinds: async functions in the event loop, sync ones through the runner
    (worker processes or threads), each call under the spec's time budget."""

    def __init__(self, spec: BuiltinReward | PythonReward, ctx: BuildContext) -> None:
        # imported here too: an import error fails start-up
        self._fn, convention, why = load_with_convention(spec)
        if isinstance(spec, PythonReward):
            log.info("reward %s: called by the %s convention (%s)", self._fn.label, convention, why)
        self._timeout = spec.timeout_s
        self._chunk = spec.batch_size if isinstance(spec, PythonReward) and self._fn.batched else 1
        self._ctx = ctx
        self._leaf = None if self._fn.is_async else ctx.register_sync(spec, self._fn)
        self._loop = LoopThread(self._fn.label) if self._fn.is_async else None

    async def score(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        chunks = [list(items[i : i + self._chunk]) for i in range(0, len(items), self._chunk)]
        done = await asyncio.gather(*(self._one(c) for c in chunks))
        return [r for chunk in done for r in chunk]

    async def _one(self, chunk: list[RewardInput]) -> list[RewardResult]:
        if self._loop is None:
            assert self._leaf is not None
            return await self._ctx.runner.run(self._leaf, chunk, self._timeout)
        try:
            return await self._loop.run(lambda: self._fn.call_async(chunk), self._timeout)
        except Blocked:
            why = "it blocked its event loop, which is abandoned and replaced (an async def must not block)"
        except TimeoutError:
            why = "cancelled"
        return [
            failed("timeout", f"{self._fn.label}: over the time budget of {self._timeout:g} s (timeout_s); {why}")
        ] * len(chunk)

    async def aclose(self) -> None:
        if self._loop is not None:
            self._loop.close()
