"""The records every reward kind shares: one sample in, one result out, and the seam between them."""

from __future__ import annotations

import math
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Status = Literal["ok", "timeout", "error"]
MAX_REASON = 2000  # Scored.reward_reason's limit
# Named components of one sample's reward (a function's dict, an HTTP scorer's, a sum's terms and
# theirs) and the length of a name: each is a metric and a field of the scored message, so a
# plug-in that returns 200k of them is an error, not a 40 MiB stream entry.
MAX_COMPONENTS = 256
MAX_COMPONENT_NAME = 256


@dataclass(frozen=True)
class RewardLimits:
    """What the reward service bounds whatever the job's spec says (shared.settings.RewardSettings).

    Attributes:
        max_response_bytes: an HTTP scorer's or a judge's answer, on the wire and once decoded
            (gzip, deflate); a larger answer is the batch's error, read no further.
        import_timeout_s: importing a Python plug-in in a child process first (an import that
            exits, crashes or hangs fails the job with the reason, not the service).
    """

    max_response_bytes: int = 4 * 1024 * 1024
    import_timeout_s: float = 60.0


@dataclass(frozen=True)
class RewardInput:
    """One sample to score.

    Attributes:
        prompt: the rendered prompt text the policy saw.
        completion: the generated text.
        answer: the dataset row's reference answer ("" when the task has none).
        metadata: the row's other columns (test cases, ids, ...), JSON-like values.
        finish_reason: vLLM's, "stop" or "length" (None when unknown).
        episode: a multi-turn episode's metrics (Rollout.env_metrics: the environment's per-turn
            info averaged, `reward` the sum of its per-turn rewards); empty for a single turn.
        completion_ids: the sampled token ids (TRL's reward functions receive them); empty where
            the caller has none.
    """

    prompt: str
    completion: str
    answer: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    episode: Mapping[str, float] = field(default_factory=dict)
    completion_ids: Sequence[int] = ()

    def as_json(self, ids: bool = False) -> dict[str, Any]:
        """The wire form remote scorers receive; with `ids` the completion's token ids too (what
        worker processes receive, msgpack-encoded: a TRL reward function takes them)."""
        d: dict[str, Any] = {
            "prompt": self.prompt,
            "completion": self.completion,
            "answer": self.answer,
            "metadata": dict(self.metadata),
            "finish_reason": self.finish_reason,
            "episode": dict(self.episode),
        }
        if ids:
            d["completion_ids"] = list(self.completion_ids)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RewardInput:
        return cls(
            prompt=d["prompt"],
            completion=d["completion"],
            answer=d["answer"],
            metadata=d.get("metadata") or {},
            finish_reason=d.get("finish_reason"),
            episode=d.get("episode") or {},
            completion_ids=d.get("completion_ids") or (),
        )


@dataclass(frozen=True)
class RewardResult:
    """The reward of one sample, or why there is none.

    Attributes:
        reward: the reward (status "ok"; may be any float the function returned: the reward service
            makes one outside the job's range, or not finite, an error with `bounded`), None otherwise.
        status: "ok", "timeout" (over the time budget) or "error" (raised, bad return value, the
            remote endpoint failed...).
        reason: "" when ok, else what happened, for people (at most MAX_REASON characters).
        components: named parts of the reward (a sum's terms, a function's dict), else empty.
    """

    reward: float | None
    status: Status = "ok"
    reason: str = ""
    components: Mapping[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def as_json(self) -> dict[str, Any]:
        return {
            "reward": self.reward,
            "status": self.status,
            "reason": self.reason,
            "components": dict(self.components),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RewardResult:
        return cls(reward=d["reward"], status=d["status"], reason=d["reason"], components=d["components"])


FAILED: tuple[Status, ...] = ("error", "timeout")
"""The statuses of a reward that failed: what a job's reward error fraction counts."""


def failed_fraction(by_status: Mapping[str, int]) -> float | None:
    """Of samples counted by reward status, the share whose reward failed (FAILED); None when
    none is counted. E.g. {"ok": 6, "error": 1, "timeout": 1} -> 0.25."""
    total = sum(by_status.values())
    return sum(by_status.get(s, 0) for s in FAILED) / total if total else None


def failed(status: Status, reason: str) -> RewardResult:
    if len(reason) > MAX_REASON:
        reason = reason[: MAX_REASON - 14] + " ...(truncated)"
    return RewardResult(reward=None, status=status, reason=reason)


def error_from(exc: BaseException, where: str = "") -> RewardResult:
    """Status error, reason "ExcType: message (at file.py:12 in fn)" from the innermost frame."""
    tb = traceback.extract_tb(exc.__traceback__)
    at = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""
    prefix = f"{where}: " if where else ""
    return failed("error", f"{prefix}{type(exc).__name__}: {exc}{at}")


def bounded(result: RewardResult, low: float, high: float) -> RewardResult:
    """`result` if its reward and every named component is a number in [low, high] (the job's
    `reward_limits.bounds`), else status error saying which value is out: a reward of 1e308 (or
    inf, or NaN) is a scorer's failure, not a number to train on (1e308 alone overflows the
    trainer's float32 rewards, and the advantages with them). A failed result passes unchanged."""
    if not result.ok:
        return result
    values = [("reward", result.reward)] + [(f"reward component {k!r}", v) for k, v in result.components.items()]
    for what, v in values:
        if v is None or not low <= v <= high:  # NaN compares false: out too
            return failed(
                "error", f"{what} {v!r} is outside the job's range [{low:g}, {high:g}] (reward_limits.bounds)"
            )
    return result


def coerce(value: Any) -> RewardResult:
    """A user function's return value as a result: a number is the reward; a dict of numbers is the
    reward's named components, the reward being their sum; a RewardResult is itself (a weighted
    sum with its terms, as the `verifiers` built-in returns). Anything else is status error."""
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, Mapping):
        if not value:
            return failed("error", "returned an empty dict; give at least one named component")
        if len(value) > MAX_COMPONENTS:
            return failed("error", f"returned a dict of {len(value)} named components; at most {MAX_COMPONENTS}")
        comps: dict[str, float] = {}
        for k, v in value.items():
            if not isinstance(k, str) or not _is_number(v):
                return failed(
                    "error", f"returned a dict with entry {k!r:.200}: {v!r:.200}; expected str keys and number values"
                )
            if len(k) > MAX_COMPONENT_NAME:
                return failed(
                    "error", f"returned a component name of {len(k)} characters; at most {MAX_COMPONENT_NAME}"
                )
            comps[k] = float(v)
        return RewardResult(reward=math.fsum(comps.values()), components=comps)
    if _is_number(value):
        return RewardResult(reward=float(value))
    return failed("error", f"returned {value!r} ({type(value).__name__}); expected a number or a dict of named numbers")


def _is_number(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return not isinstance(v, str | bytes)


def coerce_batch(values: Any, n: int) -> list[RewardResult]:
    """A batched function's return value: a list of n rewards (each as in `coerce`)."""
    if isinstance(values, str | bytes | Mapping) or not hasattr(values, "__len__"):
        return [failed("error", f"a batched reward returned {type(values).__name__}; expected a list of {n}")] * n
    values = list(values)
    if len(values) != n:
        return [failed("error", f"a batched reward returned {len(values)} values for {n} samples")] * n
    return [coerce(v) for v in values]


class KindScorer(Protocol):
    """How one reward kind scores (the seam between the registry and each kind's module).

    `score` returns one result per input, in order, and never raises for one bad sample: a failure
    is a result with status timeout or error.
    """

    async def score(self, items: Sequence[RewardInput]) -> list[RewardResult]: ...

    async def aclose(self) -> None: ...


class RewardLoadError(ValueError):
    """A reward cannot be set up: its plug-in does not import, has the wrong signature, its model
    or endpoint configuration is unusable. Raised when the scorer is built (service start-up)."""


class SyncRunner(Protocol):
    """Runs one call of a sync leaf under a time budget; never raises for the call's failures."""

    async def run(self, leaf: int, items: list[RewardInput], timeout_s: float) -> list[RewardResult]: ...

    def close(self) -> None: ...


class BuildContext(Protocol):
    """What a reward kind gets while its scorer is built (shared.rewards.registry.ScorerBuilder):
    the builder of nested rewards, the registration of a sync function leaf (its index for the
    runner), and the runner of sync leaves (set once every leaf is known)."""

    def build(self, spec: Any) -> KindScorer: ...

    @property
    def limits(self) -> RewardLimits: ...

    def register_sync(self, spec: Any, fn: Any) -> int: ...

    @property
    def runner(self) -> SyncRunner: ...
