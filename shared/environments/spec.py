"""The job spec's `environment` section (light: pydantic only, like shared.rewards.spec).

    {"name": "tools", "kwargs": {"tools": ["calculator"]}, "limits": {"max_turns": 4}}
    {"name": "path/to/my_env.py:MyEnv", "limits": {"step_timeout_s": 10}}

Only the shape is validated here, so the API can accept a spec without importing the user's code;
the environment itself is imported where episodes run (shared.environments.registry).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, field_validator

from shared.rewards.spec import IMPORT_PATH, check_kwargs
from shared.spectypes import CONTROL_CHARS, SpecModel

ENVIRONMENTS = ("single_turn", "tools", "agent", "verifiers")
"""The built-in environments' names (registry.ENVIRONMENTS, and AGENT; a test keeps them in step)."""

AGENT = "agent"
"""No environment object: an external agent program plays each episode through the job's
OpenAI-compatible endpoint (generator_svc/agents.py)."""


def _env_name(value: str) -> str:
    if value in ENVIRONMENTS or (IMPORT_PATH.match(value) and not CONTROL_CHARS.search(value)):
        return value
    raise ValueError(
        f"unknown environment {value!r}: give a built-in name ({', '.join(ENVIRONMENTS)}) or an import path "
        "'package.module:Class' or 'path/to/file.py:Class'"
    )


EnvName = Annotated[str, AfterValidator(_env_name), Field(max_length=1000)]


class EpisodeLimits(SpecModel):
    """Bounds of one episode. Whichever is reached first ends it, with its stop reason."""

    max_turns: int = Field(8, ge=1, le=1024, description="Model turns per episode (stop reason `max_turns`).")
    max_total_tokens: int = Field(
        4096,
        ge=2,
        le=1_048_576,
        description="Prompt plus every model and environment token of the episode: the context the trainer "
        "trains on (stop reason `max_tokens`).",
    )
    step_timeout_s: float = Field(
        30.0,
        gt=0.0,
        le=3600.0,
        description="Time budget of one environment call (`start` or `step`); over it the episode ends with "
        "`env_timeout`. A sync environment's call is abandoned in its thread, not killed.",
    )


class EnvironmentSpec(SpecModel):
    """The environment episodes run in: a built-in by name or a user's class by import path."""

    name: EnvName = Field(
        "single_turn",
        description=f"A built-in ({', '.join(ENVIRONMENTS)}) or 'package.module:Class' / 'path/to/file.py:Class': "
        "a class (or factory) called with `kwargs` once per episode. 'agent': an agent program of your own plays "
        "the episodes through the job's OpenAI-compatible endpoint (POST /jobs/{id}/episodes; "
        "limits.step_timeout_s is then how long it may take between the calls of an episode).",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the constructor (JSON values)."
    )
    limits: EpisodeLimits = Field(default_factory=EpisodeLimits, description="Per-episode limits.")

    @field_validator("kwargs")
    @classmethod
    def _kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_kwargs(v)
