"""The reward registry (kind -> scorer) and the scorer a service builds from a job's reward spec."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, TypeAdapter

from shared.rewards.base import (
    MAX_COMPONENT_NAME,
    MAX_COMPONENTS,
    BuildContext,
    KindScorer,
    RewardInput,
    RewardLimits,
    RewardResult,
    SyncRunner,
    error_from,
    failed,
)
from shared.rewards.combine import SumScorer
from shared.rewards.conventions import RewardCall
from shared.rewards.pool import ThreadRunner, WorkerPool, probe_import
from shared.rewards.python import FunctionScorer
from shared.rewards.remote import HttpScorer, JudgeScorer
from shared.rewards.spec import (
    BuiltinReward,
    OnFailure,
    PythonReward,
    RewardSpec,
    SumReward,
    as_object,
)

log = logging.getLogger(__name__)


def _model_scorer(spec: Any, ctx: BuildContext) -> KindScorer:
    from shared.rewards.model import ModelScorer  # torch: only for jobs that score with a model

    return ModelScorer(spec, ctx)


Builder = Callable[[Any, BuildContext], KindScorer]

KINDS: dict[str, Builder] = {
    "builtin": FunctionScorer,
    "python": FunctionScorer,
    "sum": SumScorer,
    "http": HttpScorer,
    "judge": JudgeScorer,
    "model": _model_scorer,
}
"""Reward kinds by name (the `kind` of a reward object; shared.rewards.spec.KINDS names the same)."""


class ScorerBuilder:
    """The BuildContext (shared.rewards.base) of one scorer build: the builder of nested rewards,
    the service's limits, and the runner of sync functions (set once every sync leaf is known)."""

    def __init__(self, limits: RewardLimits | None = None) -> None:
        self._limits = limits or RewardLimits()
        self.sync_specs: list[dict[str, Any]] = []
        self.sync_leaves: list[RewardCall] = []
        self._runner: SyncRunner | None = None

    def build(self, spec: str | BaseModel) -> KindScorer:
        obj = as_object(spec)
        try:
            builder = KINDS[obj.kind]
        except KeyError:
            raise ValueError(f"unknown reward kind {obj.kind!r}; valid: {sorted(KINDS)}") from None
        if isinstance(obj, PythonReward):  # a user's module: imported in a child first (pool.probe_import)
            probe_import(obj.model_dump(mode="json"), repr(obj.function), self._limits.import_timeout_s)
        return builder(obj, self)

    @property
    def limits(self) -> RewardLimits:
        return self._limits

    def register_sync(self, spec: BuiltinReward | PythonReward, fn: RewardCall) -> int:
        """A sync function leaf; returns its index for the runner."""
        self.sync_specs.append(spec.model_dump(mode="json"))
        self.sync_leaves.append(fn)
        return len(self.sync_leaves) - 1

    @property
    def runner(self) -> SyncRunner:
        assert self._runner is not None, "the runner is set when the scorer is built"
        return self._runner

    @runner.setter
    def runner(self, value: SyncRunner) -> None:
        self._runner = value


class RewardScorer:
    """A job's reward: `score(items)` -> one RewardResult per item, in order.

    Never raises for one bad sample: a timeout or failure is a result with that status and the
    reason (even a bug in a reward kind becomes every item's error). Use one scorer from one event
    loop: either `await score(...)` in yours, or `score_sync(...)`, which runs a private loop.
    `close()` (or `with`) stops worker processes and HTTP clients.
    """

    def __init__(self, root: KindScorer, runner: SyncRunner, on_failure: OnFailure, description: str) -> None:
        self._root = root
        self.runner = runner
        self.on_failure: OnFailure = on_failure
        self.description = description
        self._loop: asyncio.AbstractEventLoop | None = None

    async def score(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        items = list(items)
        if not items:
            return []
        try:
            results = await self._root.score(items)
        except Exception as exc:  # a kind's bug must not lose the batch: every item records it
            log.exception("reward %s raised on a batch of %d", self.description, len(items))
            return [error_from(exc, "reward")] * len(items)
        if len(results) != len(items):
            raise AssertionError(f"reward {self.description} returned {len(results)} results for {len(items)} items")
        return [_bounded(r) for r in results]

    def score_sync(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self.score(items))

    def reward_for(self, result: RewardResult) -> float | None:
        """The reward a sample gets under the policy: its own when ok, 0.0 for a failure under
        on_failure "zero", None (drop the sample) under "drop"."""
        if result.ok:
            return result.reward
        return 0.0 if self.on_failure == "zero" else None

    async def aclose(self) -> None:
        """Close HTTP clients (in the loop that used them) and stop worker processes."""
        try:
            await self._root.aclose()
        finally:
            self.runner.close()

    def close(self) -> None:
        """`aclose` from sync code (in the private loop of `score_sync`)."""
        loop = self._loop or asyncio.new_event_loop()
        try:
            loop.run_until_complete(self.aclose())
        finally:
            loop.close()
            self._loop = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bounded(r: RewardResult) -> RewardResult:
    """`r`, or an error if its components pass the bounds (a sum adds its terms' components up)."""
    if len(r.components) > MAX_COMPONENTS:
        return failed("error", f"the reward has {len(r.components)} named components; at most {MAX_COMPONENTS}")
    long = next((k for k in r.components if len(k) > MAX_COMPONENT_NAME), None)
    if long is not None:
        return failed("error", f"a component name of {len(long)} characters; at most {MAX_COMPONENT_NAME}")
    return r


def build_scorer(
    spec: str | BaseModel | dict[str, Any], workers: int = 0, limits: RewardLimits | None = None
) -> RewardScorer:
    """The scorer of a reward spec (JobSpec.reward), with its plug-ins imported and checked.

    Args:
        spec: a reward name / import path or a reward object (shared.rewards.spec.RewardSpec), or
            its JSON form (validated here).
        workers: processes for sync Python functions and the built-ins (REWARD_WORKERS); 0 runs
            them in threads (a hung one is abandoned, see shared.rewards.pool).
        limits: the service's bounds (HTTP answers, plug-in imports); default `RewardLimits()`.

    Raises:
        RewardLoadError: a plug-in does not import or cannot be called by the convention, a worker
            could not load the reward, a reward model does not load, a judge's key is missing.
        ValueError: an unknown kind (listing the valid ones) or an invalid spec (pydantic's
            ValidationError, a ValueError, for the JSON form).
    """
    if isinstance(spec, dict):
        spec = TypeAdapter(RewardSpec).validate_python(spec)
    assert isinstance(spec, str | BaseModel)
    ctx = ScorerBuilder(limits)
    root = ctx.build(spec)
    try:
        runner: SyncRunner = (
            WorkerPool(ctx.sync_specs, [f.label for f in ctx.sync_leaves], workers)
            if workers > 0 and ctx.sync_leaves
            else ThreadRunner(ctx.sync_leaves)
        )
    except BaseException:
        asyncio.run(root.aclose())
        raise
    ctx.runner = runner
    obj = as_object(spec)
    return RewardScorer(root, runner, obj.on_failure or "zero", describe(spec))


def describe(spec: str | BaseModel) -> str:
    """A short name of a reward for logs: "exact_match", "python my_rewards:score", "sum(a, b)"."""
    if isinstance(spec, str):
        return spec
    obj = as_object(spec)
    if isinstance(obj, SumReward):
        return f"sum({', '.join(t.name for t in obj.terms)})"
    what = {"builtin": "name", "python": "function", "http": "url", "judge": "model", "model": "path"}[obj.kind]
    return f"{obj.kind} {getattr(obj, what)}"
