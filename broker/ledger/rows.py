"""The rows that cross the ledger's boundary, declared once: what callers write and what reads
return. They are plain dicts at run time (TypedDicts), keyed by column name; no ORM object escapes
the package.

Enumerated values are plain strings checked here in Python, not CHECK constraints (see
`models.py`); every write that takes one calls `check_one_of` before touching the database.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple, TypedDict

__all__ = [
    "ADMIN_TASK_KINDS",
    "ADMIN_TASK_STATES",
    "EVAL_SOURCES",
    "JOB_STATES",
    "REWARD_STATUSES",
    "SAMPLE_KINDS",
    "SAMPLE_STATUSES",
    "USED_STATUSES",
    "AdminTaskRow",
    "CheckpointRow",
    "EvalArgs",
    "EvalRow",
    "GenerationVersions",
    "GeneratorLoadRow",
    "GeneratorUsage",
    "JobChangeRow",
    "JobRow",
    "Offenders",
    "PolicyVersionRow",
    "SampleIn",
    "SampleRow",
    "ScoredItem",
    "StepInputIn",
    "StepInputRow",
    "TrainStepRow",
    "Usage",
    "UsageGroup",
    "UsageTotals",
    "UsedItem",
    "check_one_of",
]

# A job waits `queued` until a trainer of the fleet takes it (broker/runtime.py, JobRepository.claim_next).
JOB_STATES = ("queued", "running", "paused", "stopping", "stopped", "finished", "failed", "cancelled")
SAMPLE_KINDS = ("train", "eval")
SAMPLE_STATUSES = ("generated", "scored", "trained", "dropped", "evaluated", "lost")
# Terminal sample statuses: the trainer (or evaluator) used the sample, or settled it as lost (no
# stream held anything of its group any more: Redis lost it in a failover, trainer_svc/sink.py
# `settle_lost`); it is never used twice.
USED_STATUSES = ("trained", "dropped", "evaluated", "lost")
# The statuses a sample can still leave.
UNUSED_STATUSES = ("generated", "scored")
REWARD_STATUSES = ("ok", "timeout", "error")
EVAL_SOURCES = ("pipeline", "checkpoint")
ADMIN_TASK_KINDS = ("evaluate", "export")
ADMIN_TASK_STATES = ("queued", "running", "succeeded", "failed")


def check_one_of(value: str, allowed: Sequence[str], what: str) -> None:
    """Refuse a value outside an enumeration (`what` names it in the message).

    Raises:
        ValueError: `value` is not in `allowed`; the message lists the valid values.
    """
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(allowed)}")


# -- jobs ----------------------------------------------------------------------------------------


class JobRow(TypedDict):
    """A `jobs` row."""

    id: str
    name: str
    spec: dict[str, Any]
    state: str  # one of JOB_STATES
    step: int  # last completed trainer step; 0 before the first
    error: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None  # when a trainer first started the job
    priority: int  # the queue's order: higher first, then created_at (first in, first out)


class JobChangeRow(TypedDict):
    """A `job_changes` row: `actor` did `changes` to the job."""

    id: int
    job_id: str
    actor: str
    changes: dict[str, Any]
    created_at: datetime


# -- samples -------------------------------------------------------------------------------------


class _SampleRequired(TypedDict):
    msg_id: str
    job_id: str
    group_id: str
    sample_index: int
    prompt_index: int
    generator_id: str
    gen_version_min: int
    num_prompt_tokens: int
    num_completion_tokens: int
    completion: str


class SampleIn(_SampleRequired, total=False):
    """A sample as `record_generated` takes it: the required keys above, any of these optional
    ones (absent or None: the default in the comment). The keys are checked at run time too."""

    gen_version_max: int | None  # gen_version_min
    kind: str | None  # "train"; one of SAMPLE_KINDS
    finish_reason: str | None
    turns: int | None  # a multi-turn episode's model turns
    num_env_tokens: int | None  # ... its completion tokens the environment appended
    stop_reason: str | None  # ... why it ended
    adapter: str | None  # the engine's LoRA adapter that produced it (None: full weights)
    gen_seconds: float | None  # its share of its generate call's wall time
    reward: float | None
    reward_status: str | None
    reward_details: dict[str, Any] | None
    eval_set: str | None
    status: str | None  # "generated"; one of SAMPLE_STATUSES
    drop_reason: str | None
    trainer_version: int | None
    staleness: int | None
    created_at: datetime | None  # now
    scored_at: datetime | None
    used_at: datetime | None


class SampleRow(_SampleRequired):
    """A `samples` row: one completion, from generation to its use (or drop) by the trainer."""

    id: int
    gen_version_max: int
    kind: str  # one of SAMPLE_KINDS
    finish_reason: str | None
    turns: int | None  # multi-turn episodes only (null: single-turn)
    num_env_tokens: int | None
    stop_reason: str | None
    adapter: str | None  # the engine's LoRA adapter that produced it (null: full weights)
    gen_seconds: float | None  # its share of its generate call's wall time (null: before 0010)
    reward: float | None
    reward_status: str | None  # one of REWARD_STATUSES once scored
    reward_details: dict[str, Any] | None
    eval_set: str | None
    status: str  # one of SAMPLE_STATUSES
    drop_reason: str | None
    trainer_version: int | None  # the trainer's policy version at use
    staleness: int | None  # trainer_version - gen_version_min
    created_at: datetime
    scored_at: datetime | None
    used_at: datetime | None


# (msg_id, reward) or (msg_id, reward, reward_status, reward_details): reward_status one of
# REWARD_STATUSES (default "ok"), reward_details a JSON-safe dict or None.
ScoredItem = tuple[str, float] | tuple[str, float, str] | tuple[str, float, str, dict[str, Any] | None]


class _UsedRequired(TypedDict):
    msg_id: str
    status: str  # one of USED_STATUSES


class UsedItem(_UsedRequired, total=False):
    """A sample's use as `record_used` takes it (keys checked at run time too)."""

    trainer_version: int | None
    staleness: int | None  # None: trainer_version - gen_version_min, computed in SQL
    drop_reason: str | None
    reward: float | None  # None: the stored reward is kept


# -- policy versions, generator loads, steps, checkpoints, evals --------------------------------


class PolicyVersionRow(TypedDict):
    """A published policy version."""

    job_id: str
    version: int
    checksum: str
    num_bytes: int
    created_at: datetime


class GeneratorLoadRow(TypedDict):
    """A generator's load of a policy version."""

    job_id: str
    version: int
    generator_id: str
    fingerprint: str | None
    loaded_at: datetime


class TrainStepRow(TypedDict):
    """A train step's metrics."""

    job_id: str
    step: int
    policy_version: int  # the version the step produced
    metrics: dict[str, Any]
    created_at: datetime


class StepInputIn(TypedDict):
    """What one train step stepped on (`record_step_input`; trainer_svc/replay.py writes and reads it)."""

    job_id: str
    step: int
    policy_version: int  # the version the step produced
    lr: float
    checksum: str  # the weights' after the step
    restored_from: int | None  # a guard roll-back's checkpoint step the step started from (0: initial)
    identity: dict[str, Any]  # software and hardware (trainer_svc/replay.py software_identity)
    meta: dict[str, Any]  # the encoding of `data`
    data: bytes  # the batch and RNG state, encoded


class StepInputRow(StepInputIn):
    created_at: datetime


class CheckpointRow(TypedDict):
    """A committed trainer checkpoint."""

    job_id: str
    step: int
    policy_version: int
    path: str
    created_at: datetime


class EvalRow(TypedDict):
    """An evaluation of the policy at a step on one evaluation set."""

    job_id: str
    step: int
    source: str  # one of EVAL_SOURCES
    name: str  # the evaluation set
    policy_version_min: int
    policy_version_max: int
    reward_mean: float
    n: int
    metrics: dict[str, Any] | None  # pass@k and the like
    wall_s: float | None  # seconds from the job's start
    created_at: datetime


class _EvalArgsRequired(TypedDict):
    job_id: str
    step: int
    vmin: int
    vmax: int
    reward_mean: float
    n: int


class EvalArgs(_EvalArgsRequired, total=False):
    """The keyword arguments of `record_eval`, as `finish_admin_task(eval_row=...)` takes them."""

    source: str  # "checkpoint" there
    name: str
    metrics: dict[str, Any] | None
    wall_s: float | None


# -- admin tasks ---------------------------------------------------------------------------------


class AdminTaskRow(TypedDict):
    """A long admin task on a job: what was asked, by whom, and how it ended."""

    id: str
    job_id: str
    kind: str  # one of ADMIN_TASK_KINDS
    params: dict[str, Any]
    state: str  # one of ADMIN_TASK_STATES
    actor: str
    result: dict[str, Any] | None
    error: str | None
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


# -- audit (broker.verify) -------------------------------------------------------------------------


class Offenders(NamedTuple):
    """The rows an audit query found breaking an invariant."""

    total: int  # samples, or groups of them, as the query says
    examples: tuple[str, ...]  # the first few keys (msg_ids, group ids, ...) to look at


class GenerationVersions(NamedTuple):
    """Trained samples of one generator at one generation version range."""

    generator_id: str
    gen_version_min: int
    gen_version_max: int
    samples: int


class UsageGroup(NamedTuple):
    """A job's samples of one kind from one generator, summed (`Ledger.usage` folds these)."""

    kind: str  # one of SAMPLE_KINDS
    generator_id: str
    samples: int
    seconds: float  # sum of gen_seconds (a null, before 0010, counts 0)
    prompt_tokens: int
    completion_tokens: int


class UsageTotals(TypedDict):
    """What a job's samples cost the generators: the figures a shared fleet is billed by."""

    generator_seconds: float  # the samples' shares of their generate calls' wall time
    samples: int
    prompt_tokens: int
    completion_tokens: int


class GeneratorUsage(TypedDict):
    """One generator's part of a job's usage."""

    seconds: float
    samples: int
    completion_tokens: int


class Usage(UsageTotals):
    """`Ledger.usage`: a job's totals over every sample it generated (training and evaluation,
    whatever became of them), split by generator and by kind."""

    by_generator: dict[str, GeneratorUsage]
    by_kind: dict[str, UsageTotals]  # every one of SAMPLE_KINDS, zeros where none
    adapters: int  # distinct LoRA adapters that produced its samples (0: full-weight engines)


class SampleFilters(TypedDict, total=False):
    """The filters of `Ledger.samples` and `Ledger.count_samples`: a status or kind, and inclusive
    bounds on trainer version, staleness and reward (a bound excludes rows where that column is
    still null: not yet used, or not yet scored)."""

    status: str | None
    kind: str | None
    min_trainer_version: int | None
    max_trainer_version: int | None
    min_staleness: int | None
    max_staleness: int | None
    min_reward: float | None
    max_reward: float | None
