"""Environments: multi-turn, tool-using rollouts as token ids.

    make = load_environment(EnvironmentSpec(name="tools", limits={"max_turns": 4}))  # imports: fails fast
    codec = codec_for(tokenizer, "auto")             # chat template continuation, or plain text
    episode = await run_episode(make(), problem, generate, codec, spec.limits)
    episode.prompt_ids, episode.ids, episode.mask, episode.logprobs, episode.stop_reason

The interface is in shared.environments.base, the episode and its driver in
shared.environments.episode, the built-ins in shared.environments.builtin and
shared.environments.tools. Pure Python (no torch or vLLM): the generator runs episodes
(generator_svc/episodes.py), the API validates the spec (shared.environments.spec).
"""

from shared.environments.base import (
    Environment,
    EnvironmentFactory,
    EnvironmentShapeError,
    ModelTurn,
    Opening,
    Row,
    StepResult,
)
from shared.environments.builtin import SingleTurnEnv
from shared.environments.episode import (
    ChatCodec,
    Codec,
    Episode,
    Generate,
    PlainCodec,
    TemplateDeltaError,
    TurnRecord,
    codec_for,
    render_reply_delta,
    run_episode,
)
from shared.environments.registry import ENVIRONMENTS, EnvironmentLoadError, load_environment
from shared.environments.spec import EnvironmentSpec, EpisodeLimits
from shared.environments.tools import (
    ToolCall,
    ToolCallError,
    ToolEnv,
    ToolError,
    calculate,
    parse_tool_call,
)

__all__ = [
    "ENVIRONMENTS",
    "ChatCodec",
    "Codec",
    "Environment",
    "EnvironmentFactory",
    "EnvironmentLoadError",
    "EnvironmentShapeError",
    "EnvironmentSpec",
    "Episode",
    "EpisodeLimits",
    "Generate",
    "ModelTurn",
    "Opening",
    "PlainCodec",
    "Row",
    "SingleTurnEnv",
    "StepResult",
    "TemplateDeltaError",
    "ToolCall",
    "ToolCallError",
    "ToolEnv",
    "ToolError",
    "TurnRecord",
    "calculate",
    "codec_for",
    "load_environment",
    "parse_tool_call",
    "render_reply_delta",
    "run_episode",
]
