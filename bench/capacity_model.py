"""The capacity model: how much load one job puts on Redis, the ledger and the weight links, and
how many generator replicas one Redis shard and one PostgreSQL serve. Pure functions over small
records; the measured unit costs come from `bench/capacity.py` (results/capacity.json), the GPU
figures are assumptions the caller passes in (docs/scaling.md says which).

Per sample the pipeline moves one `Rollout` (generator -> reward) and one `Scored` holding that
rollout again (reward -> trainer) through Redis, plus 1/group_size of a `PromptGroup`; the ledger
sees one row inserted (generator), one no-op insert (the reward service's idempotent copy), one
update to `scored` and one to `trained`/`dropped` (ARCHITECTURE.md, "the life of one sample").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# msgpack Rollout framing: field names, ids, versions, short strings (measured with shared.schema.encode).
ROLLOUT_OVERHEAD_BYTES = 400
# A Scored adds its own header and the reward fields around the rollout it carries.
SCORED_EXTRA_BYTES = 145
# A PromptGroup's framing and sampling parameters.
PROMPT_GROUP_OVERHEAD_BYTES = 300


def _positive(**values: float) -> None:
    for name, v in values.items():
        if not v > 0 or math.isinf(v):
            raise ValueError(f"{name} must be a positive finite number, got {v!r}")


@dataclass(frozen=True)
class Workload:
    """One job's shape.

    prompt_tokens / completion_tokens: mean tokens per sample; text_bytes_per_token: bytes of
    rendered text per token (the rollout carries the prompt and completion text beside the ids;
    about 4 for English BPE); group_size: samples per prompt; samples_per_step: samples per
    trainer step.
    """

    prompt_tokens: int = 256
    completion_tokens: int = 1024
    group_size: int = 8
    samples_per_step: int = 1024
    text_bytes_per_token: float = 4.0

    def __post_init__(self) -> None:
        _positive(
            completion_tokens=self.completion_tokens, group_size=self.group_size, samples_per_step=self.samples_per_step
        )
        if self.prompt_tokens < 0 or self.text_bytes_per_token < 0:
            raise ValueError("prompt_tokens and text_bytes_per_token must be >= 0")


@dataclass(frozen=True)
class ModelSize:
    """A policy: `params` parameters of `bytes_per_param` each on the wire (2: bf16)."""

    name: str
    params: float
    bytes_per_param: float = 2.0

    def __post_init__(self) -> None:
        _positive(params=self.params, bytes_per_param=self.bytes_per_param)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param


@dataclass(frozen=True)
class UnitCosts:
    """Measured costs (bench/capacity.py).

    redis_cpu_s_per_sample_base / _per_byte: Redis main-thread CPU seconds per sample through all
    three streams, as a + b * rollout_bytes (a fit over the measured completion lengths);
    ledger_s_per_sample (+ ledger_s_per_completion_token x completion tokens): PostgreSQL seconds
    per sample for its four writes (server CPU over the server's cores: the row holds the
    completion text); link_bytes_per_s: one weight link's bytes/s;
    redis_idle_cpu_per_consumer: Redis CPU seconds per second that one consumer waiting on an
    empty stream costs (its reads every wake-poll interval, broker.streams.wakeups._WAKE_POLL_S).
    """

    redis_cpu_s_per_sample_base: float
    redis_cpu_s_per_sample_per_byte: float
    ledger_s_per_sample: float
    link_bytes_per_s: float
    redis_idle_cpu_per_consumer: float = 0.0
    ledger_s_per_completion_token: float = 0.0

    def __post_init__(self) -> None:
        _positive(ledger_s_per_sample=self.ledger_s_per_sample, link_bytes_per_s=self.link_bytes_per_s)
        if (
            self.redis_cpu_s_per_sample_base < 0
            or self.redis_cpu_s_per_sample_per_byte < 0
            or self.redis_idle_cpu_per_consumer < 0
            or self.ledger_s_per_completion_token < 0
        ):
            raise ValueError("Redis costs must be >= 0")
        if self.redis_cpu_s_per_sample_base + self.redis_cpu_s_per_sample_per_byte <= 0:
            raise ValueError("Redis costs cannot both be 0")

    def ledger_s(self, w: Workload) -> float:
        return self.ledger_s_per_sample + self.ledger_s_per_completion_token * w.completion_tokens

    def redis_cpu_s_per_sample(self, w: Workload) -> float:
        return self.redis_cpu_s_per_sample_base + self.redis_cpu_s_per_sample_per_byte * rollout_bytes(w)


def rollout_bytes(w: Workload) -> float:
    """Encoded size of one Rollout: int32 prompt ids and text, int32 completion ids, float32
    logprobs and text. E.g. 256 prompt + 1024 completion tokens at 4 text bytes/token:
    400 + 256 * 8 + 1024 * 12 = 14,736 bytes."""
    return (
        ROLLOUT_OVERHEAD_BYTES
        + w.prompt_tokens * (4 + w.text_bytes_per_token)
        + w.completion_tokens * (8 + w.text_bytes_per_token)
    )


def redis_bytes_per_sample(w: Workload) -> float:
    """Bytes written to Redis per sample: the rollout, the scored copy, a share of the prompt group.
    Each is read back once, so the bytes crossing the shard's network are twice this."""
    prompt_group = PROMPT_GROUP_OVERHEAD_BYTES + w.prompt_tokens * (4 + w.text_bytes_per_token)
    return 2 * rollout_bytes(w) + SCORED_EXTRA_BYTES + prompt_group / w.group_size


@dataclass(frozen=True)
class Generator:
    """One generator replica: decode throughput in output tokens/s summed over its batch, and the
    GPUs it takes (an assumption for GPUs, or measured on CPU here)."""

    tokens_per_s: float
    gpus: int = 1

    def __post_init__(self) -> None:
        _positive(tokens_per_s=self.tokens_per_s, gpus=self.gpus)

    def samples_per_s(self, w: Workload) -> float:
        return self.tokens_per_s / w.completion_tokens


@dataclass(frozen=True)
class Trainer:
    """The training side: `ranks` GPUs of `peak_flops` each at `mfu`; `flops_per_token_factor` x
    params FLOPs per trained token (6: forward + backward; 8 with the extra forward for the
    current policy's logprobs)."""

    ranks: int = 64
    peak_flops: float = 989e12  # H100 SXM bf16 dense, from NVIDIA's datasheet
    mfu: float = 0.35
    flops_per_token_factor: float = 8.0

    def __post_init__(self) -> None:
        _positive(
            ranks=self.ranks,
            peak_flops=self.peak_flops,
            mfu=self.mfu,
            flops_per_token_factor=self.flops_per_token_factor,
        )
        if self.mfu > 1:
            raise ValueError(f"mfu is a fraction of peak, got {self.mfu}")

    def step_s(self, m: ModelSize, w: Workload) -> float:
        """Seconds of one step: factor * params * tokens / (ranks * peak * mfu)."""
        tokens = w.samples_per_step * (w.prompt_tokens + w.completion_tokens)
        return self.flops_per_token_factor * m.params * tokens / (self.ranks * self.peak_flops * self.mfu)


@dataclass(frozen=True)
class Load:
    """What a sample rate puts on the shared services."""

    samples_per_s: float
    redis_msgs_per_s: float  # XADDs per second (rollout + scored + share of prompt groups)
    redis_bytes_per_s: float  # written; as much again is read
    redis_utilisation: float  # Redis main-thread CPU busy fraction
    ledger_rows_per_s: float  # row writes per second (4 per sample)
    ledger_utilisation: float


def load(samples_per_s: float, w: Workload, c: UnitCosts, *, idle_consumers: int = 0) -> Load:
    """The load of `samples_per_s` samples/s on one Redis shard and one PostgreSQL, with
    `idle_consumers` consumers waiting on empty streams meanwhile (a generator polls only while it
    has nothing to generate)."""
    if samples_per_s < 0 or idle_consumers < 0:
        raise ValueError(f"samples_per_s and idle_consumers must be >= 0, got {samples_per_s}, {idle_consumers}")
    return Load(
        samples_per_s=samples_per_s,
        redis_msgs_per_s=samples_per_s * (2 + 1 / w.group_size),
        redis_bytes_per_s=samples_per_s * redis_bytes_per_sample(w),
        redis_utilisation=samples_per_s * c.redis_cpu_s_per_sample(w) + idle_consumers * c.redis_idle_cpu_per_consumer,
        ledger_rows_per_s=4 * samples_per_s,
        ledger_utilisation=samples_per_s * c.ledger_s(w),
    )


def max_generators_per_redis(
    w: Workload, c: UnitCosts, g: Generator, *, target: float = 0.7, nic_bytes_per_s: float | None = None
) -> int:
    """Generator replicas one Redis shard serves with its main thread at most `target` busy (and,
    given `nic_bytes_per_s`, its network in + out at most `target` of that)."""
    _positive(target=target)
    rate = target / c.redis_cpu_s_per_sample(w)
    if nic_bytes_per_s is not None:
        rate = min(rate, target * nic_bytes_per_s / (2 * redis_bytes_per_sample(w)))
    return math.floor(rate / g.samples_per_s(w) + 1e-9)


def max_generators_per_ledger(w: Workload, c: UnitCosts, g: Generator, *, target: float = 0.7) -> int:
    """Generator replicas one PostgreSQL (as measured) serves at most `target` busy."""
    _positive(target=target)
    return math.floor(target / c.ledger_s(w) / g.samples_per_s(w) + 1e-9)


def generators_to_feed_trainer(m: ModelSize, w: Workload, g: Generator, t: Trainer) -> int:
    """Generator replicas whose samples/s match the trainer's consumption (async steady state)."""
    need = w.samples_per_step / t.step_s(m, w)
    return math.ceil(need / g.samples_per_s(w))


def broadcast_s(
    m: ModelSize, receivers: int, link_bytes_per_s: float, *, fanout: int | None = None, chunk_bytes: float = 64 * 2**20
) -> float:
    """Seconds until `receivers` generators hold new weights of `m`.

    fanout None: a star, the trainer's one link sends every copy: receivers * W / link.
    fanout f: a relay tree, each node forwards to f children while it receives, chunk by chunk
    (pipelined): the root's link carries f copies, and each further level adds one chunk's
    delay: f * W / link + (depth - 1) * f * chunk / link, depth = levels below the root.
    """
    _positive(link_bytes_per_s=link_bytes_per_s, chunk_bytes=chunk_bytes)
    if receivers < 1:
        raise ValueError(f"receivers must be >= 1, got {receivers}")
    w = m.weight_bytes
    if fanout is None:
        return receivers * w / link_bytes_per_s
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1, got {fanout}")
    depth, reached, level = 0, 0, 1
    while reached < receivers:
        level *= fanout
        reached += level
        depth += 1
    f = min(fanout, receivers)
    return f * w / link_bytes_per_s + (depth - 1) * f * min(chunk_bytes, w) / link_bytes_per_s
