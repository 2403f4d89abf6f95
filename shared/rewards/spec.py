"""The job spec's `reward` section (light: pydantic only).

A reward is either a bare string or an object with a `kind`:

    "exact_match"                                   a built-in, by name (REWARDS)
    "my_rewards:score", "path/to/rw.py:score"       a Python function, by import path
    {"kind": "builtin", "name": "python_exec", "timeout_s": 20}
    {"kind": "python", "function": "my_rewards:score", "kwargs": {"scale": 2}, "batched": false}
    {"kind": "sum", "terms": [{"name": "correct", "weight": 1.0, "reward": "exact_match"},
                              {"name": "short", "weight": 0.1, "reward": "my_rewards:brevity"}]}
    {"kind": "http", "url": "http://scorer:8080/score", "batch_size": 64}
    {"kind": "judge", "base_url": "http://judge:8000/v1", "model": "judge", "rule": "number"}
    {"kind": "model", "path": "/models/rm", "batch_size": 16}

Every leaf has a per-sample time budget (`timeout_s`) and the outermost reward a failure policy
(`on_failure`): a sample whose reward timed out or raised gets reward 0.0 ("zero", with its status
and reason recorded) or is dead-lettered, so the trainer drops its group ("drop"). How each kind is
scored is in shared.rewards (one module per kind); this module only validates the shape, so the API
accepts a spec without importing the user's code. Import paths are checked for syntax here and
imported when the reward service starts (an import error fails the service at start-up).
"""

from __future__ import annotations

import json
import re
import string
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapSerializer,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from shared.spectypes import CONTROL_CHARS, PrintableStr, SpecModel

REWARDS = ("environment", "exact_match", "math_verify", "python_exec", "reasoning_gym", "verifiers")
"""The built-in reward functions' names (shared.rewards.builtin.REWARD_FUNCTIONS)."""

OnFailure = Literal["zero", "drop"]

# "package.module:function" or "path/to/file.py:function" (the attribute may be dotted: Class.method).
_ATTR = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
IMPORT_PATH = re.compile(rf"^(?:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*|[^:\s][^:]*\.py):{_ATTR}$")
_IMPORT_PATH_HELP = "an import path 'package.module:function' or 'path/to/file.py:function'"
# The arguments a reward function receives from the sample; the spec's kwargs may not shadow them.
INPUT_NAMES = ("completion", "answer", "prompt", "metadata", "finish_reason", "episode")


def _import_path(value: str) -> str:
    if not IMPORT_PATH.match(value) or CONTROL_CHARS.search(value):
        raise ValueError(f"{value!r} is not {_IMPORT_PATH_HELP}")
    return value


def _bare_reward(value: str) -> str:
    if value in REWARDS or (IMPORT_PATH.match(value) and not CONTROL_CHARS.search(value)):
        return value
    raise ValueError(
        f"unknown reward {value!r}: give a built-in name ({', '.join(REWARDS)}), {_IMPORT_PATH_HELP}, "
        f"or a reward object with a 'kind' ({', '.join(KINDS)})"
    )


ImportPath = Annotated[str, AfterValidator(_import_path)]
RewardName = Annotated[
    str,
    AfterValidator(_bare_reward),
    Field(json_schema_extra={"pattern": rf"^(?:{'|'.join(REWARDS)}|{IMPORT_PATH.pattern[1:-1]})$"}),
]


class _Strict(SpecModel):
    """Unknown fields rejected, numbers finite, strings bounded (shared.spectypes)."""


# A python reward's kwargs are free JSON; this bounds what a spec may carry to the function.
MAX_KWARGS_BYTES = 64 * 1024


def check_kwargs(v: dict[str, Any]) -> dict[str, Any]:
    """A plug-in's `kwargs` (a reward function's, an environment's): at most 64 keys, each a Python
    identifier, JSON values with finite numbers, at most MAX_KWARGS_BYTES as JSON.

    Raises:
        ValueError: saying which rule it breaks.
    """
    if len(v) > 64:
        raise ValueError(f"kwargs has {len(v)} keys; at most 64")
    try:
        size = len(json.dumps(v, allow_nan=False))
    except ValueError:
        raise ValueError("kwargs holds a NaN or infinite number; JSON numbers must be finite") from None
    except TypeError as exc:
        raise ValueError(f"kwargs must be JSON values ({exc})") from None
    if size > MAX_KWARGS_BYTES:
        raise ValueError(f"kwargs is {size} bytes as JSON; at most {MAX_KWARGS_BYTES}")
    bad = [k for k in v if not k.isidentifier()]
    if bad:
        raise ValueError(f"kwargs key {bad[0]!r} is not a Python identifier")
    return v


_TIMEOUT = (
    "Per-sample time budget in seconds (for a batched call: the whole call); over it the sample's status is `timeout`."
)
_ON_FAILURE = (
    "What a timed-out or failed sample gets: `zero` (reward 0.0, status and reason recorded; the "
    "default when unset) or `drop` (dead-lettered; the trainer drops its group). Set on the outermost "
    "reward only (a sum decides for its terms)."
)


class BuiltinReward(_Strict):
    """A built-in reward function by name (shared.rewards.builtin)."""

    kind: Literal["builtin"] = Field("builtin", description="Reward kind.")
    name: Literal["environment", "exact_match", "math_verify", "python_exec", "reasoning_gym", "verifiers"] = Field(
        ..., description=f"Built-in function: one of {', '.join(REWARDS)}."
    )
    timeout_s: float = Field(30.0, gt=0.0, le=3600.0, description=_TIMEOUT)
    on_failure: OnFailure | None = Field(None, description=_ON_FAILURE)


class PythonReward(_Strict):
    """A user function by import path; the calling convention is documented in shared.rewards.python."""

    kind: Literal["python"] = Field("python", description="Reward kind.")
    function: ImportPath = Field(
        ..., description="'package.module:function' (on the reward service's PYTHONPATH) or 'path/to/file.py:function'."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for every call (JSON values)."
    )
    batched: bool = Field(
        False,
        description="The function takes lists (completions, answers, ...) and returns a list, "
        "one call per batch_size samples.",
    )
    batch_size: int = Field(64, ge=1, le=100_000, description="Samples per call when batched.")
    timeout_s: float = Field(30.0, gt=0.0, le=3600.0, description=_TIMEOUT)
    on_failure: OnFailure | None = Field(None, description=_ON_FAILURE)
    convention: Literal["asyncrl", "verl", "trl", "verifiers"] | None = Field(
        None,
        description="How the function is called (shared.rewards.conventions): `asyncrl` (this "
        "project's score(completion, answer, ...)), `verl` (compute_score(data_source, solution_str, "
        "ground_truth, extra_info) -> float or dict with 'score'), `trl` (reward_func(prompts, "
        "completions, completion_ids, **dataset_columns) -> list of floats, once per batch_size "
        "samples) or `verifiers` (rubric functions, arguments by parameter name; `function` may name "
        "a list of them or a rubric). None: recognised from the signature (the reward service logs which).",
    )
    weights: list[Annotated[float, Field(ge=-1e6, le=1e6, allow_inf_nan=False)]] | None = Field(
        None,
        max_length=64,
        description="verifiers convention: the weight of each rubric function, in order (default: the "
        "rubric's own, else 1.0 each). The reward is the weighted sum; each function is logged by name.",
    )

    @field_validator("kwargs")
    @classmethod
    def _kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in check_kwargs(v):
            if key in INPUT_NAMES or key in {f"{n}s" for n in INPUT_NAMES}:
                raise ValueError(f"kwargs key {key!r} is a sample input the function receives anyway; rename it")
        return v

    @model_validator(mode="after")
    def _convention(self) -> PythonReward:
        if self.batched and self.convention in ("verl", "verifiers"):
            raise ValueError(
                f"convention {self.convention!r} calls the function once per sample, as {self.convention} does: "
                "remove batched"
            )
        if self.weights is not None and self.convention in ("asyncrl", "verl", "trl"):
            raise ValueError(
                f"weights weigh verifiers rubric functions; convention {self.convention!r} has one function "
                "(combine several with kind 'sum')"
            )
        return self


class HttpReward(_Strict):
    """A remote scorer: POST {"items": [{prompt, completion, answer, metadata}]} -> {"rewards": [...]}."""

    kind: Literal["http"] = Field("http", description="Reward kind.")
    url: str = Field(..., pattern=r"^https?://\S+$", max_length=2000, description="Endpoint that takes the POST.")
    headers: dict[
        Annotated[PrintableStr, Field(min_length=1, max_length=200)], Annotated[PrintableStr, Field(max_length=8192)]
    ] = Field(
        default_factory=dict,
        max_length=64,
        description="Extra request headers (e.g. a static auth header); "
        "no control characters (CR/LF would split a header).",
    )
    batch_size: int = Field(64, ge=1, le=100_000, description="Samples per request.")
    retries: int = Field(
        2,
        ge=0,
        le=20,
        description="Retries of a request after a connection error, a timeout of the attempt, 429 or 5xx, "
        "with exponential back-off.",
    )
    timeout_s: float = Field(
        60.0,
        gt=0.0,
        le=3600.0,
        description="Time budget of one request batch, retries included; over it the batch's samples are `timeout`.",
    )
    on_failure: OnFailure | None = Field(None, description=_ON_FAILURE)


JUDGE_TEMPLATE = (
    "Rate the response to the task on a scale from 0 to 1.\n\nTask:\n{prompt}\n\nReference answer:\n{answer}\n\n"
    "Response:\n{completion}\n\nReply with the number only."
)
_TEMPLATE_FIELDS = ("prompt", "completion", "answer", "metadata")


def _template_fields(template: str) -> set[str]:
    """The replacement fields of a str.format template (a judge's or a reward model's)."""
    try:
        return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ValueError(
            f"template is not a str.format template ({exc}); write literal braces as {{{{ and }}}}"
        ) from None


class JudgeReward(_Strict):
    """An LLM judge behind an OpenAI-compatible `/v1/chat/completions` endpoint."""

    kind: Literal["judge"] = Field("judge", description="Reward kind.")
    base_url: str = Field(
        ...,
        pattern=r"^https?://\S+$",
        max_length=2000,
        description="API root, e.g. http://judge:8000/v1 (the request goes to <base_url>/chat/completions).",
    )
    model: str = Field(..., min_length=1, max_length=500, description="The served model name the request asks for.")
    template: str = Field(
        JUDGE_TEMPLATE,
        min_length=1,
        max_length=100_000,
        description="User message, a str.format template over {prompt} {completion} {answer} {metadata[...]}; "
        "double literal braces.",
    )
    system: str | None = Field(None, max_length=100_000, description="Optional system message.")
    rule: Literal["number", "yes_no"] = Field(
        "number",
        description="How the reply becomes a score: `number` (the first number in the reply, which must lie in [0, 1]) "
        "or `yes_no` (first word yes -> 1.0, no -> 0.0).",
    )
    max_tokens: int = Field(16, ge=1, le=32768, description="Reply length limit.")
    temperature: float = Field(0.0, ge=0.0, le=10.0, description="Judge sampling temperature (0: greedy).")
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable of the reward service holding the bearer token, if the endpoint needs one.",
    )
    concurrency: int = Field(8, ge=1, le=1024, description="Requests in flight at once.")
    retries: int = Field(
        2, ge=0, le=20, description="Retries after a connection error, an attempt's timeout, 429 or 5xx."
    )
    timeout_s: float = Field(120.0, gt=0.0, le=3600.0, description="Per-sample time budget, retries included.")
    on_failure: OnFailure | None = Field(None, description=_ON_FAILURE)

    @field_validator("template")
    @classmethod
    def _template(cls, v: str) -> str:
        for field in _template_fields(v):
            root = re.split(r"[.\[]", field, maxsplit=1)[0]
            if root not in _TEMPLATE_FIELDS:
                raise ValueError(
                    f"template field {{{field}}} is unknown; use {', '.join('{' + f + '}' for f in _TEMPLATE_FIELDS)}"
                )
        return v


class ModelReward(_Strict):
    """A learned reward model: a local HF AutoModelForSequenceClassification with one label."""

    kind: Literal["model"] = Field("model", description="Reward kind.")
    path: PrintableStr = Field(
        ..., min_length=1, max_length=4096, description="Local HF-format model directory (never downloaded)."
    )
    template: str = Field(
        "{prompt}{completion}",
        min_length=1,
        max_length=100_000,
        description="The text the model scores, a str.format template over {prompt} {completion} {answer}.",
    )
    batch_size: int = Field(16, ge=1, le=4096, description="Samples per forward pass.")
    max_length: int = Field(
        1024, ge=8, le=1_000_000, description="Tokens kept per sample (longer texts are truncated)."
    )
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?|mps)$", description="Torch device.")
    timeout_s: float = Field(300.0, gt=0.0, le=3600.0, description="Time budget of one forward batch.")
    on_failure: OnFailure | None = Field(None, description=_ON_FAILURE)

    @field_validator("template")
    @classmethod
    def _template(cls, v: str) -> str:
        fields = _template_fields(v)
        unknown = fields - {"prompt", "completion", "answer"}
        if unknown:
            raise ValueError(f"template fields {sorted(unknown)} are unknown; use {{prompt}} {{completion}} {{answer}}")
        return v


class SumTerm(_Strict):
    name: str = Field(
        ..., pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="The term's name in Scored.details and the ledger."
    )
    weight: float = Field(1.0, ge=-1e6, le=1e6, allow_inf_nan=False, description="Multiplies the term's reward.")
    reward: RewardSpec = Field(..., description="The term's reward (any kind, a sum included).")


class SumReward(_Strict):
    """reward = sum_i weight_i * reward_i; each term's own reward is logged under its name."""

    kind: Literal["sum"] = Field("sum", description="Reward kind.")
    terms: list[SumTerm] = Field(
        ..., min_length=1, max_length=64, description="The weighted terms, scored concurrently."
    )
    on_failure: OnFailure | None = Field(
        None,
        description="What a sample gets when any term timed out or failed: `zero` (the default when unset) or `drop`.",
    )

    @model_validator(mode="after")
    def _terms(self) -> SumReward:
        names = [t.name for t in self.terms]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"term names must be unique; repeated: {dupes}")
        for t in self.terms:
            if not isinstance(t.reward, str) and t.reward.on_failure is not None:
                raise ValueError(f"term {t.name!r} sets on_failure; set it on the sum, which decides for every term")
        return self


KINDS = ("builtin", "python", "sum", "http", "judge", "model")
"""Reward object kinds (the keys of shared.rewards.KINDS, the registry that scores them)."""


def _kind_of(value: Any) -> str | None:
    """The tag of the union below: a bare string, or the object's kind (None: no kind given)."""
    if isinstance(value, str):
        return "name"
    if isinstance(value, dict):
        kind = value.get("kind")
        return kind if isinstance(kind, str) else None
    return getattr(value, "kind", None)


RewardObject = Union[  # noqa: UP007 (a Union of Annotated members)
    Annotated[BuiltinReward, Tag("builtin")],
    Annotated[PythonReward, Tag("python")],
    Annotated[SumReward, Tag("sum")],
    Annotated[HttpReward, Tag("http")],
    Annotated[JudgeReward, Tag("judge")],
    Annotated[ModelReward, Tag("model")],
]

_KIND_ERROR = f"a reward is a name or an object whose 'kind' is one of: {', '.join(KINDS)}"


def _untagged(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Errors located at the field the user wrote (`reward.function`), not at the union's tag
    (`reward.python.function`): the tag is the kind the user already named."""
    try:
        return handler(value)
    except ValidationError as exc:
        details: list[InitErrorDetails] = []
        for e in exc.errors():
            loc = e["loc"][1:] if e["loc"] and e["loc"][0] in (*KINDS, "name") else e["loc"]
            kind = PydanticCustomError("reward_kind", _KIND_ERROR) if e["type"] == "reward_kind" else e["type"]
            details.append(InitErrorDetails(type=kind, loc=loc, input=e["input"], ctx=e.get("ctx", {})))
        raise ValidationError.from_exception_data(exc.title, details) from None


def _serialize(value: Any, handler: SerializerFunctionWrapHandler) -> Any:
    # A field that defaults to None for "unset" (an eval set's reward) serializes as null without
    # asking the discriminator for a tag None does not have.
    return None if value is None else handler(value)


RewardSpec = Annotated[
    Union[Annotated[RewardName, Tag("name")], RewardObject],  # noqa: UP007
    Discriminator(_kind_of, custom_error_type="reward_kind", custom_error_message=_KIND_ERROR),
    WrapValidator(_untagged),
    WrapSerializer(_serialize),
]
"""What `JobSpec.reward` accepts: a bare name / import path, or one of the reward objects."""

SumTerm.model_rebuild()
SumReward.model_rebuild()


def as_object(
    spec: str | BaseModel,
) -> BuiltinReward | PythonReward | SumReward | HttpReward | JudgeReward | ModelReward:
    """The object form of a reward: a bare built-in name becomes BuiltinReward, an import path PythonReward."""
    if isinstance(spec, str):
        _bare_reward(spec)
        return BuiltinReward.model_validate({"name": spec}) if spec in REWARDS else PythonReward(function=spec)
    if isinstance(spec, BuiltinReward | PythonReward | SumReward | HttpReward | JudgeReward | ModelReward):
        return spec
    raise TypeError(f"not a reward spec: {spec!r}")
