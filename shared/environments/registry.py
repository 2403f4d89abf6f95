"""Environments by name or import path: what a job's `environment` section turns into."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from shared.environments.base import Environment, EnvironmentFactory
from shared.environments.builtin import SingleTurnEnv
from shared.environments.spec import AGENT, EnvironmentSpec
from shared.environments.tools import ToolEnv
from shared.rewards.base import RewardLoadError
from shared.rewards.python import import_object
from shared.vfenv import VerifiersEnv  # imports verifiers only when an episode starts

ENVIRONMENTS: dict[str, Callable[..., Environment]] = {
    "single_turn": SingleTurnEnv,
    "tools": ToolEnv,
    "verifiers": VerifiersEnv,
}
"""Built-in environments by name (shared.environments.spec.ENVIRONMENTS names the same)."""


class EnvironmentLoadError(ValueError):
    """An environment cannot be set up: it does not import, is not a class or factory with `start`
    and `step`, or does not take the spec's kwargs."""


def load_environment(spec: EnvironmentSpec | str) -> EnvironmentFactory:
    """A factory of fresh environments (one per episode) for the spec: a built-in by name or a class
    (or factory) by import path, with the spec's kwargs bound. The import happens here, so an error
    fails the caller's start-up, naming what failed.

    Raises:
        EnvironmentLoadError: the message says what failed (the import's own error included).
    """
    if isinstance(spec, str):
        spec = EnvironmentSpec(name=spec)
    if spec.name == AGENT:
        raise EnvironmentLoadError(
            "environment 'agent' has no environment object: an agent program plays its episodes through the "
            "job's OpenAI-compatible endpoint (generator_svc/agents.py)"
        )
    obj: Any
    if spec.name in ENVIRONMENTS:
        obj = ENVIRONMENTS[spec.name]
    else:
        try:
            obj = import_object(spec.name, "environment")
        except RewardLoadError as exc:
            raise EnvironmentLoadError(str(exc)) from exc
    label = spec.name
    if not callable(obj):
        raise EnvironmentLoadError(f"environment {label!r} is {type(obj).__name__}; expected a class or factory")
    if inspect.isclass(obj):
        missing = [m for m in ("start", "step") if not callable(getattr(obj, m, None))]
        if missing:
            raise EnvironmentLoadError(
                f"environment {label!r} has no method {' or '.join(missing)}; "
                "an environment defines start(row) and step(turn)"
            )
    try:
        inspect.signature(obj).bind(**spec.kwargs)
    except TypeError as exc:
        raise EnvironmentLoadError(
            f"environment {label!r} cannot be built with kwargs {sorted(spec.kwargs)}: {exc}"
        ) from None
    except ValueError:  # no signature to check (some builtins): the first episode will tell
        pass
    return functools.partial(obj, **spec.kwargs)
