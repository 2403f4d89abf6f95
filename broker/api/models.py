"""What the job API answers: one pydantic model per response body, so the OpenAPI documents each.

The models are projections of ledger rows: a route returns the row (a dict) and its
`response_model` keeps the fields below, in this order. Timestamps are ISO 8601 UTC; admin tasks
spell UTC `+00:00`, every other timestamp `Z`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, PlainSerializer, WithJsonSchema

from shared.jobspec import JobPatch

# A metric as the trainer or an evaluation records it: a number, null where it was not finite.
# Other scalars pass through unchanged (smart union: an int stays an int, a bool a bool).
MetricValue = float | int | bool | str | None
Metrics = dict[str, MetricValue]
# `datetime.isoformat()`: "+00:00" rather than pydantic's "Z".
IsoTimestamp = Annotated[
    datetime,
    PlainSerializer(lambda t: t.isoformat(), return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]
StoredSpec = Annotated[
    dict[str, Any],
    Field(description="The job spec as stored: the POST /jobs body (JobSpec) with every default filled in."),
]


class JobSummary(BaseModel):
    """A job in the list."""

    id: str
    name: str
    state: str = Field(..., description="queued, running, paused, stopping, stopped, finished, failed or cancelled.")
    priority: int = Field(0, description="The queue's order: higher first, then first in, first out.")
    step: int = Field(..., description="Last completed trainer step; 0 before the first.")
    created_at: datetime
    updated_at: datetime


class SubmittedJob(BaseModel):
    id: str
    state: Literal["queued"]
    position: int = Field(..., description="Its place in the queue when submitted (1: next to run).")
    spec: StoredSpec


class QueuedJob(BaseModel):
    """A job waiting in the fleet's queue."""

    id: str
    name: str
    position: int = Field(..., description="1: the next job a trainer takes.")
    priority: int
    submitted_at: datetime
    waiting_for: str = Field(
        ..., description="What it waits for: the running job to end, the jobs ahead of it, or a trainer (none is up)."
    )


class RunningJob(BaseModel):
    """A job a trainer of the fleet runs."""

    id: str
    name: str
    state: str = Field(..., description="running, paused or stopping.")
    step: int
    steps: int
    priority: int
    share: float = Field(
        1.0, description="Its weight in generator and reward time against the other running jobs (spec `share`)."
    )
    served_by: dict[str, list[str]] = Field(
        default_factory=dict,
        description="By role (trainer, generator, reward): the ids of the fleet's services serving it now.",
    )
    started_at: datetime | None
    reward_error_fraction: float | None = Field(
        None, description="Of its scored samples, the share whose reward failed (timeout or error); null: none yet."
    )
    drop_skew_warnings: list[str] = Field(
        default_factory=list,
        description="Where dropping samples biases the length or reward it trains on (GET /jobs/{id} `drop_skew`).",
    )


class Distribution(BaseModel):
    """Values in five numbers (over a job: counts add up, means are exact, a quantile is the
    count-weighted mean of its steps' quantiles)."""

    n: int = Field(..., description="How many values.")
    mean: float
    p10: float
    p50: float
    p90: float


class DropSide(BaseModel):
    """Samples of one side (trained, dropped, or dropped for one reason) over the job."""

    count: int = Field(..., description="Samples.")
    length: Distribution | None = Field(..., description="Their completion length in tokens; null: none.")
    reward: Distribution | None = Field(
        ..., description="Their reward, over those that have one (a failed reward has none); null: none."
    )


class DropShift(BaseModel):
    """Where the dropped samples sit against the trained, relative to the trained scale (the larger of
    the trained mean's magnitude and its p10..p90 spread), at most 10 either way."""

    mean: float = Field(..., description="(dropped mean - trained mean) / scale; > 0: the dropped are larger.")
    quantile: float = Field(..., description="The mean of the p10, p50 and p90 differences / scale.")


class DropSkew(BaseModel):
    """What dropping skews (shared/drop_skew.py): the samples kept out of the gradient against those
    trained on their reward, by completion length and reward, over the job's steps."""

    trained: DropSide
    dropped: DropSide = Field(..., description="Every drop reason together.")
    by_reason: dict[str, DropSide] = Field(
        ...,
        description="stale, rolled_back, dynamic_sampling, overlong (masked), reward_failure, other (dead-lettered, "
        "the step raised on it); reasons that dropped none are absent.",
    )
    shift: dict[str, DropShift | None] = Field(
        ..., description="`length` and `reward`; null where a side has no values."
    )
    warnings: list[str] = Field(
        ...,
        description="Where dropping biases length or reward past the spec's drop_skew.max_shift (with at least "
        "drop_skew.min_dropped dropped samples).",
    )


class RewardErrors(BaseModel):
    """How a job's rewards went: its scored samples by reward status, and the share that failed."""

    by_status: dict[str, int] = Field(
        ..., description="Scored samples by reward status: ok, timeout, error (statuses with none are absent)."
    )
    fraction: float | None = Field(
        ..., description="(timeout + error) / scored: the reward error fraction; null before a sample is scored."
    )


class QueueView(BaseModel):
    """The fleet's queue (GET /queue)."""

    running: list[RunningJob]
    queued: list[QueuedJob]
    trainers: int = Field(..., description="Trainers of the fleet that are up.")


class ServiceLoad(BaseModel):
    """What one service did for one job (in this process, since it took the job)."""

    share: float = Field(..., description="The job's share (spec `share`) as the service weighs it.")
    seconds: float = Field(..., description="Busy seconds it spent on the job.")
    tokens: int = Field(..., description="Tokens it generated or scored for the job.")


class FleetService(BaseModel):
    """One live service of the fleet, as its beacon says."""

    role: str = Field(..., description="trainer, generator or reward.")
    id: str
    host: str
    pid: int
    job: str | None = Field(..., description="The job it serves (the first of `jobs`); null: idle.")
    jobs: list[str] = Field(default_factory=list, description="Every job it serves now (a generator serves several).")
    load: dict[str, ServiceLoad] = Field(default_factory=dict, description="By job id: its share and the work done.")
    state: str = Field(..., description="starting, idle or serving.")
    since: float = Field(..., description="Unix seconds since it is in this state.")
    jobs_served: int
    ts: float = Field(..., description="Unix seconds of its last beat.")


class FleetView(BaseModel):
    """The fleet's live services (GET /fleet)."""

    services: list[FleetService]


class EvalRecord(BaseModel):
    """A held-out evaluation of the policy at one step."""

    job_id: str
    step: int
    source: str = Field(..., description="`pipeline` (the trainer's round) or `checkpoint` (the admin worker).")
    name: str = Field(..., description="The evaluation set.")
    policy_version_min: int
    policy_version_max: int
    reward_mean: float
    n: int
    metrics: Metrics | None = Field(..., description="pass@k, mean@n and the like; null for a greedy round.")
    wall_s: float | None = Field(..., description="Seconds from the job's start to the round's end.")
    created_at: datetime


class GeneratorState(BaseModel):
    """One generator as the ledger and its heartbeat know it; a key is absent until known."""

    versions_loaded: list[int] = Field(..., description="Policy versions it loaded, in order.")
    last_loaded_at: datetime | None = Field(None, description="When it loaded its last version (absent: none yet).")
    heartbeat: dict[str, Any] | None = Field(
        None,
        description="Its last heartbeat (version, loaded_at, fingerprint, `ts` in Unix seconds); absent: none.",
    )


class UsageTotals(BaseModel):
    """What a set of a job's samples cost the generators."""

    generator_seconds: float = Field(
        ...,
        description="Sum over the samples of each one's share of its generate call's wall time (the generator "
        "splits a call's time among the samples it made); samples from before the ledger recorded it count 0.",
    )
    samples: int = Field(..., description="Samples generated, whatever became of them (trained, dropped, lost...).")
    prompt_tokens: int = Field(..., description="Their prompt tokens (a group's prompt counts once per sample).")
    completion_tokens: int


class GeneratorUsage(BaseModel):
    """One generator's part of a job's usage."""

    seconds: float = Field(..., description="Generator-seconds it spent on the job's samples.")
    samples: int
    completion_tokens: int


class JobUsage(UsageTotals):
    """What the job cost the fleet's generators, from the ledger's samples: the figures a shared fleet
    is billed by (ledger `usage`). Training and evaluation samples alike; `by_kind` splits them."""

    by_generator: dict[str, GeneratorUsage] = Field(..., description="By generator id.")
    by_kind: dict[str, UsageTotals] = Field(..., description="`train` and `eval` (zeros where none).")
    adapters: int = Field(
        ..., description="Distinct LoRA adapters (versions) that produced its samples; 0: full-weight engines only."
    )


class JobStatus(BaseModel):
    """A job, its progress, its generators and what it cost them."""

    id: str
    name: str
    state: str
    step: int
    error: str | None = Field(..., description="Why the job failed.")
    created_at: datetime
    started_at: datetime | None = Field(
        ..., description="When a trainer first started it: eval `wall_s` counts from here."
    )
    spec: StoredSpec
    last_metrics: Metrics | None = Field(..., description="The last train step's metrics; null before the first.")
    evals: list[EvalRecord]
    samples: dict[str, int] = Field(..., description="Samples by status (statuses with none are absent).")
    staleness: dict[int, int] = Field(..., description="Trained samples by staleness.")
    reward_errors: RewardErrors = Field(..., description="Its scored samples by reward status; the error fraction.")
    drop_skew: DropSkew = Field(..., description="Dropped against trained samples, by length and reward.")
    generators: dict[str, GeneratorState] = Field(..., description="By generator id.")
    usage: JobUsage = Field(..., description="Generator-seconds and tokens: what the job is billed by.")


class JobReport(BaseModel):
    """What a job did (broker.job_summary): the summary `asyncrl run` and `asyncrl demo` print."""

    job_id: str
    state: str | None
    error: str | None
    steps: int = Field(..., description="Train steps recorded.")
    per_step: list[dict[str, int | float | None]] = Field(
        ..., description="Per step: `step`, reward/mean, off_policy/mean|max|dropped (null: missing or not finite)."
    )
    reward_per_step: list[float | None]
    held_out: list[list[int | float]] = Field(..., description="[step, reward] of the first evaluation set.")
    eval_sets: dict[str, list[dict[str, Any]]] = Field(
        ..., description="Per evaluation set: each round's step, reward, wall_s and metrics (pass@k, ...)."
    )
    staleness_histogram: dict[int, int] = Field(..., description="Trained samples by staleness.")
    sample_status: dict[str, int] = Field(..., description="Samples by status.")
    generators: int = Field(..., description="Generators that loaded a policy version of the job.")
    swap_latency_s_median: float | None = Field(
        ...,
        description="Seconds from a version's publication until every generator serves it (versions after the first).",
    )
    swap_latency_s_max: float | None
    samples_per_s: float = Field(..., description="Steady state: every step but the first (it waits for the engines).")
    tokens_per_s: float
    mean_step_s: float
    guard_trips: list[str] = Field(..., description="The collapse guard's trips, one line each.")


class StateChange(BaseModel):
    """A control command was published; the job is now in `state`."""

    id: str
    state: str


class PatchedJob(BaseModel):
    id: str
    changed: JobPatch = Field(..., description="The knobs that changed (only those given).")
    spec: StoredSpec


class SampleRecord(BaseModel):
    msg_id: str
    group_id: str
    sample_index: int
    kind: str = Field(..., description="train or eval.")
    prompt_index: int
    generator_id: str
    adapter: str | None = Field(None, description="The engine's LoRA adapter that produced it; null: full weights.")
    gen_seconds: float | None = Field(
        None, description="Its share of its generate call's wall time; null: recorded before the ledger kept it."
    )
    gen_version_min: int
    gen_version_max: int
    trainer_version: int | None = Field(..., description="The trainer's version when it used the sample.")
    staleness: int | None = Field(..., description="trainer_version - gen_version_min.")
    reward: float | None
    status: str
    completion: str
    num_completion_tokens: int
    created_at: datetime


class SamplePage(BaseModel):
    total: int = Field(..., description="Every sample that matches, on any page.")
    limit: int
    offset: int
    items: list[SampleRecord]


class CheckpointRecord(BaseModel):
    """A committed HF-format checkpoint."""

    job_id: str
    step: int
    policy_version: int
    path: str
    created_at: datetime


class ChangeRecord(BaseModel):
    """An audit record: who changed what, when."""

    id: int
    job_id: str
    actor: str = Field(..., description="`rw token <sha256 prefix>`, `anonymous`, or the service that did it.")
    changes: dict[str, Any] = Field(..., description='The command and its settings, e.g. {"command": "pause"}.')
    created_at: datetime


class Finding(BaseModel):
    check: str
    level: Literal["violation", "info"]
    count: int
    message: str
    examples: list[str]


class VerifyReport(BaseModel):
    """The ledger's invariants for one job (broker.verify)."""

    ok: bool = Field(..., description="No check has violations.")
    job_id: str
    job_state: str
    counts: dict[str, int] = Field(..., description="Samples by status.")
    in_flight: int
    steps: int
    checks: dict[str, int] = Field(..., description="Check name -> violating rows (0: it holds).")
    violations: list[Finding]
    info: list[Finding]


class AdminTask(BaseModel):
    """An admin task (Celery): queued, running, succeeded (with its result) or failed (with the error)."""

    id: str
    job_id: str
    kind: str = Field(..., description="evaluate or export.")
    params: dict[str, Any]
    state: str
    actor: str
    result: dict[str, Any] | None
    error: str | None
    attempts: int = Field(..., description="Deliveries that started it (above 1 after a worker died).")
    created_at: IsoTimestamp
    started_at: IsoTimestamp | None
    finished_at: IsoTimestamp | None


class EvalPoint(BaseModel):
    step: int
    reward_mean: float | None
    n: int
    policy_version_min: int
    policy_version_max: int
    source: str
    name: str
    wall_s: float | None
    metrics: Metrics | None


class GuardTrip(BaseModel):
    step: int | None
    kind: str | None
    action: str | None
    text: str = Field(..., description="One line: where, why, and what it did.")


class StatusData(BaseModel):
    """The status page's series of one job."""

    job_id: str
    steps: list[dict[str, float | int | None]] = Field(
        ..., description="One row per train step: step, policy_version and the plotted metrics (null where absent)."
    )
    evals: list[EvalPoint]
    guard_trips: list[GuardTrip]


# --- agent episodes (broker/api/routes/agents.py) ------------------------------------------------


class AgentEpisodeView(BaseModel):
    """An episode taken to play, or none (`episode_id` null) when no generator offered one in `wait_s`."""

    episode_id: str | None = Field(None, description="Null: none was offered in wait_s; ask again.")
    base_url: str | None = Field(None, description="The `openai` client's base_url for this episode.")
    model: str | None = Field(None, description="The model name to send (the job's id).")
    purpose: Literal["train", "eval"] | None = None
    eval_set: str | None = Field(None, description="An evaluation episode's set ('' for training).")
    prompt_index: int | None = None
    prompt: str | None = Field(None, description="The dataset row's prompt text (not rendered).")
    answer: str | None = Field(None, description="The dataset row's answer.")
    metadata: dict[str, Any] | None = Field(None, description="The dataset row's other columns.")
    policy_version: int | None = Field(None, description="The policy version the episode will be sampled at.")


class AgentChoice(BaseModel):
    index: int
    finish_reason: str = Field(..., description="stop, length or tool_calls.")
    message: dict[str, Any] | None = Field(None, description="Chat: the assistant message (content, tool_calls).")
    text: str | None = Field(None, description="Completions: the text.")
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] = Field(..., description="The sampled token ids, as the trainer will train on them.")


class AgentCompletion(BaseModel):
    """OpenAI's chat.completion / text_completion object, plus what the episode recorded."""

    id: str
    object: str
    created: int
    model: str
    choices: list[AgentChoice]
    usage: dict[str, int]
    prompt_token_ids: list[int] = Field(..., description="The ids the model was given: the episode so far.")
    policy_version: int
    episode_id: str
    generator_ms: float = Field(..., description="The call's time in the generator (receipt to answer).")


class AgentModel(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "asyncrl"


class AgentModels(BaseModel):
    object: Literal["list"] = "list"
    data: list[AgentModel]


class AgentEpisodeEnd(BaseModel):
    episode_id: str
    turns: int = Field(..., description="Model turns recorded.")
    tokens: int = Field(..., description="Prompt and completion tokens recorded.")
    stop_reason: str | None = Field(None, description="done, or the limit (max_turns, max_tokens) it reached.")


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(..., description="invalid_request_error, conflict, episode_limit, timeout, ...")
    code: int


class OpenAIErrorBody(BaseModel):
    """An error of the OpenAI-compatible routes: in OpenAI's shape (what its clients raise from)
    when the episode answers; a string where the API's edge refuses the request before it gets
    there (a 400 for a control character in the URL, a 413), as on every route."""

    error: OpenAIErrorDetail | str
