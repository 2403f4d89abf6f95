"""The wire schema: every message that crosses a Redis stream, and its msgpack codec.

Each message carries `schema_version`, `job_id`, `msg_id` (the idempotency key), `group_id` and
`policy_version`. Token ids and logprobs travel as packed little-endian binary (int32 / float32),
never as lists of Python numbers. Decoding never unpickles: msgpack -> dict -> pydantic validation,
and any failure raises `DecodeError` with a reason that goes to the dead-letter stream.

What the wire admits (checked in `decode`, the stream boundary):

- integers are strict (no bool or str for an int) and bounded by the ledger column they land in:
  [0, 2**31) for PostgreSQL `integer` columns (versions, indices, counts), int64 for byte sizes;
- floats are finite and in range: logprobs <= LOGPROB_MAX, temperature in [0, MAX_TEMPERATURE];
- token ids are in [0, 2**31) (a consumer that knows the vocabulary checks the upper end itself);
- identifiers hold no control characters; free text (prompts, completions, answers, reasons) holds
  none but tab, newline and carriage return. Built in-process instead (the generator from engine
  output, the feeder from a dataset), a refused character in free text is replaced by U+FFFD, so
  what a model or a dataset emits never crashes its producer; token ids are unchanged;
- msgpack itself is bounded: no ext types, per-string, per-array and per-map limits, and at most
  `max_elements` values in all, so a small payload cannot expand into a large object graph.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar, overload

import msgpack
import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from shared.ids import eval_group_id

SCHEMA_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")

# PostgreSQL `integer` (int4): the ledger column of every version, index and count on the wire.
INT32_MAX = 2**31 - 1
# PostgreSQL `bigint`: byte sizes (policy_versions.num_bytes) and offsets.
INT64_MAX = 2**63 - 1
# A logprob is log p <= 0; float32 rounding in an engine's log-softmax can land a hair above.
LOGPROB_MAX = 1e-4
# Above the job spec's limit (10): the wire refuses nonsense (inf, 1e30), not a future spec's range.
MAX_TEMPERATURE = 100.0
# A generate call's wall time, in seconds (a sample's share of it is at most the whole): a week
# is beyond any call; the wire refuses nonsense (1e30), not a slow engine.
MAX_GEN_SECONDS = 7 * 24 * 3600.0
# Samples per prompt: the job spec allows 1024 (group_size, eval n); a larger n is an attack on the
# generator's memory, not a job.
MAX_SAMPLES_PER_PROMPT = 4096

# msgpack limits matched to the schema. The longest legitimate array is a manifest's chunk
# checksums (4 MiB chunks: 131072 of them is a 512 GiB model); maps are a message's fields, a
# dataset row's metadata or a reward's components. DEFAULT_MAX_ELEMENTS bounds every array and map
# element together: each costs a Python object (~50-60 bytes) however few bytes it took on the wire
# (an empty array is one byte), so 262144 of them bound the decoded graph to ~16 MiB.
MAX_ARRAY_LEN = 1 << 17
MAX_MAP_LEN = 1 << 16
DEFAULT_MAX_ELEMENTS = 1 << 18

# Why an entry was rejected, as a short fixed word: the dead-letter record and the per-reason
# metrics carry it (a metric label must not be free text); `reason` holds the details.
REJECT_CODES = (
    "not_bytes",  # the entry's payload is not a byte string
    "oversized",  # over the configured MAX_MESSAGE_BYTES, or a msgpack container / element budget
    "malformed",  # not msgpack at all, or truncated
    "not_a_map",  # msgpack, but not a map
    "schema_version",  # a schema version this build does not speak
    "unknown_kind",
    "wrong_kind",  # a valid message on a stream that carries another kind
    "invalid",  # fails validation (missing/extra field, out-of-range value, inconsistent arrays)
)

# Validation context key set by `decode`: the input came off the wire (refuse, never repair).
WIRE = "wire"

# C0 and C1 control characters and DEL; free text keeps \t \n \r.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_TEXT_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


class DecodeError(ValueError):
    """A stream entry that cannot be turned into a valid message; `reason` says why, `code` is
    one of REJECT_CODES."""

    def __init__(self, reason: str, code: str = "invalid"):
        super().__init__(reason)
        self.reason = reason
        self.code = code


def clean_text(value: str) -> str:
    """`value` with every control character but tab, newline and carriage return replaced by
    U+FFFD: what producers do with text they did not write (engine output, dataset rows, error
    messages) before it goes on the wire or into the ledger."""
    return _TEXT_CONTROL.sub("\ufffd", value)


def _no_control(value: str) -> str:
    m = _CONTROL.search(value)
    if m is not None:
        raise ValueError(f"control character {ord(m.group()):#04x} at position {m.start()}; identifiers are printable")
    return value


def _text(value: str, info: ValidationInfo) -> str:
    m = _TEXT_CONTROL.search(value)
    if m is None:
        return value
    if info.context and info.context.get(WIRE):
        raise ValueError(
            f"control character {ord(m.group()):#04x} at position {m.start()}; text may hold tab, newline and "
            "carriage return only (a producer replaces the others with U+FFFD: shared.schema.clean_text)"
        )
    return clean_text(value)


# An identifier (ids, names, codes): printable, no control characters at all.
Name = Annotated[str, AfterValidator(_no_control)]
# Free text: no control characters but \t \n \r (refused from the wire, replaced in-process).
Text = Annotated[str, AfterValidator(_text)]


def _int32(default: Any = ..., lo: int = 0, **kw: Any) -> Any:
    """A field stored in a PostgreSQL `integer` column: lo <= value < 2**31."""
    return Field(default, ge=lo, le=INT32_MAX, **kw)


def _int64(default: Any = ..., lo: int = 0, **kw: Any) -> Any:
    return Field(default, ge=lo, le=INT64_MAX, **kw)


def pack_i32(values: Any) -> bytes:
    return np.asarray(values, dtype=_I32).tobytes()


def pack_f32(values: Any) -> bytes:
    return np.asarray(values, dtype=_F32).tobytes()


def unpack_i32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype=_I32)


def unpack_f32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype=_F32)


def _whole_values(name: str, buf: bytes) -> None:
    if len(buf) % 4:
        raise ValueError(f"{name} holds {len(buf)} bytes, not a whole number of 4-byte values")


def _token_ids(name: str, buf: bytes) -> None:
    """int32 LE token ids: whole values, none negative (the upper end is the consumer's vocabulary)."""
    _whole_values(name, buf)
    if buf:
        ids = unpack_i32(buf)
        if int(ids.min()) < 0:
            i = int(np.argmin(ids))
            raise ValueError(f"{name}[{i}] is {int(ids[i])}: token ids are >= 0")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: ClassVar[str]

    schema_version: int = SCHEMA_VERSION
    job_id: Name = Field(min_length=1, max_length=128)
    msg_id: Name = Field(min_length=1, max_length=256)
    group_id: Name = Field("", max_length=256)
    policy_version: int = _int32()


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = _int32(0)  # 0: no top-k (as vLLM); else the k most likely tokens, then top_p among them
    max_tokens: int = _int32(16, lo=1)
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    # Stopping, applied by vLLM: the completion ends at the first stop string (excluded from the
    # text and the tokens unless include_stop_str_in_output) or stop token id; min_tokens first.
    stop: list[Annotated[Text, Field(min_length=1, max_length=1024)]] = Field(default_factory=list, max_length=64)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(default_factory=list, max_length=64)
    min_tokens: int = _int32(0)
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _token_budget(self) -> SamplingParams:
        # vLLM refuses the whole generate call for one such request: refused here, per message.
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        return self


# Row metadata (a dataset's other columns) travels as a msgpack map of JSON-like values. Opaque to
# the pipeline (rewards read it; the ledger does not store it), so only decode's size limits apply.
Metadata = dict[str, Any]
MetricName = Annotated[Name, Field(min_length=1, max_length=64)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


# trainer_svc (feeder) -> generator_svc
class PromptGroup(Message):
    """One prompt to be sampled `n` times. `policy_version` is the trainer's version when fed."""

    kind: ClassVar[str] = "prompt_group"
    purpose: Literal["train", "eval"] = "train"
    prompt_index: int = _int32()
    prompt: Text = Field(min_length=1)  # the rendered prompt text (chat template applied)
    # int32 LE: the prompt's token ids, rendered and tokenized once by the feeder. The generator
    # generates from exactly these ids and the trainer trains on them (no second tokenization).
    prompt_ids: bytes = b""
    answer: Text
    metadata: Metadata = Field(default_factory=dict)  # the dataset row's other columns, for the reward
    eval_set: Name = Field("", max_length=128)  # purpose "eval": which named evaluation set
    n: int = Field(ge=1, le=MAX_SAMPLES_PER_PROMPT)
    sampling: SamplingParams
    # Training groups: the trainer version it is trained at, at the latest (its feeder slot;
    # shared/staleness_bound.py). A generator holds at least that minus the bound before it
    # generates it, so its samples are fresh when trained. None: an evaluation group, or a
    # feeder from before admission by version (the generator then needs only `policy_version`).
    train_version: int | None = _int32(None)

    @model_validator(mode="after")
    def _ids(self) -> PromptGroup:
        _token_ids("prompt_ids", self.prompt_ids)
        return self

    def prompt_array(self) -> np.ndarray:
        return unpack_i32(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in `prompt_ids` (0 for a text prompt, which the engine tokenizes)."""
        return len(self.prompt_array())


class EvalItem(BaseModel):
    """One problem of an evaluation round (the fields of a PromptGroup that differ per problem)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    prompt_index: int = _int32()
    prompt: Text = Field(min_length=1)
    prompt_ids: bytes = b""  # int32 LE, as PromptGroup.prompt_ids
    answer: Text
    metadata: Metadata = Field(default_factory=dict)

    @model_validator(mode="after")
    def _ids(self) -> EvalItem:
        _token_ids("prompt_ids", self.prompt_ids)
        return self


# trainer_svc (feeder) -> generator_svc
class EvalRound(Message):
    """A whole evaluation round as one entry: one generator takes it and generates every problem
    in one call, so the round measures exactly one policy version (in async mode too). Its
    rollouts are groups `{round}/{prompt_index}` of `n` samples each. `policy_version`: the
    trainer's version when fed (the generator uses that or a newer one)."""

    kind: ClassVar[str] = "eval_round"
    eval_set: Name = Field(min_length=1, max_length=128)
    n: int = Field(ge=1, le=MAX_SAMPLES_PER_PROMPT)
    sampling: SamplingParams
    items: list[EvalItem] = Field(min_length=1)

    @model_validator(mode="after")
    def _distinct_problems(self) -> EvalRound:
        # Each problem is a group `{round}/{prompt_index}`: a repeated index would give two groups
        # one id, and every sample of one of them would be a duplicate msg_id.
        seen: set[int] = set()
        for it in self.items:
            if it.prompt_index in seen:
                raise ValueError(f"prompt_index {it.prompt_index} appears twice in the round")
            seen.add(it.prompt_index)
        return self

    def groups(self) -> list[PromptGroup]:
        """The round as prompt groups, one per problem (what the generator generates)."""
        return [
            PromptGroup(
                job_id=self.job_id,
                msg_id=eval_group_id(self.group_id, it.prompt_index),
                group_id=eval_group_id(self.group_id, it.prompt_index),
                policy_version=self.policy_version,
                purpose="eval",
                prompt_index=it.prompt_index,
                prompt=it.prompt,
                prompt_ids=it.prompt_ids,
                answer=it.answer,
                metadata=it.metadata,
                eval_set=self.eval_set,
                n=self.n,
                sampling=self.sampling,
            )
            for it in self.items
        ]


# generator_svc -> reward_svc
class Rollout(Message):
    """One completion. `policy_version` is the version that generated it (min if it changed mid-sample)."""

    kind: ClassVar[str] = "rollout"
    purpose: Literal["train", "eval"] = "train"
    policy_version_max: int = _int32()
    prompt_index: int = _int32()
    sample_index: int = _int32()
    group_size: int = Field(ge=1, le=MAX_SAMPLES_PER_PROMPT)
    generator_id: Name = Field(max_length=256)
    prompt_ids: bytes  # int32 LE, (P,)
    completion_ids: bytes  # int32 LE, (T,)
    logprobs: bytes  # float32 LE, (T,): behaviour logprob of each sampled token
    completion: Text
    finish_reason: Name | None = Field(None, max_length=64)  # vLLM's: "stop" (EOS, stop string or token), "length"
    answer: Text
    prompt: Text = ""  # the rendered prompt text (for rewards that read it: judges, reward models)
    metadata: Metadata = Field(default_factory=dict)
    eval_set: Name = Field("", max_length=128)
    # sampled at: the behaviour policy. The trainer scores each token under the same distribution
    # (logits / temperature, then top_k, then top_p: trainer_svc/logprobs.py `truncate`)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = _int32(0)  # 0: none
    # A multi-turn episode (shared/environments): one byte per completion token, 1 where the model
    # sampled it, 0 where the environment appended it (its logprob is 0.0 and carries no loss or
    # importance weight). Empty: every completion token is the model's (a single-turn sample).
    model_mask: bytes = b""
    turns: int = Field(1, ge=1, le=1 << 16)  # model turns in the episode
    stop_reason: Name | None = Field(None, max_length=2000)  # why the episode ended (shared/environments)
    # the episode's figures (shared.environments.episode.Episode.metrics), e.g. the tool-call success rate
    env_metrics: dict[MetricName, FiniteFloat] = Field(default_factory=dict, max_length=16)
    # Per-job accounting (the ledger's samples.adapter, samples.gen_seconds): the engine's LoRA
    # adapter that produced the sample, e.g. "job-<id>/v3#7" ("": full weights), and the sample's
    # share of its generate call's wall time, which GET /jobs/{id} `usage` sums per job.
    adapter: Name = Field("", max_length=200)
    gen_seconds: float = Field(0.0, ge=0.0, le=MAX_GEN_SECONDS, allow_inf_nan=False)

    @model_validator(mode="after")
    def _arrays_consistent(self) -> Rollout:
        # The trainer indexes logprobs by completion position and embeds the ids: a mismatch, a
        # negative id or a NaN would be a shape error or garbage deep inside a training step, so
        # it is rejected here, at the stream boundary.
        _token_ids("prompt_ids", self.prompt_ids)
        _token_ids("completion_ids", self.completion_ids)
        _whole_values("logprobs", self.logprobs)
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"{len(self.logprob_array())} logprobs for {self.num_completion_tokens} completion tokens; "
                "there must be one behaviour logprob per sampled token"
            )
        if self.logprobs:
            lp = unpack_f32(self.logprobs)
            bad = ~np.isfinite(lp) | (lp > LOGPROB_MAX)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"logprobs[{i}] is {float(lp[i])!r}: a behaviour logprob is finite and <= 0")
        if self.model_mask:
            if len(self.model_mask) != len(self.completion_ids) // 4:
                raise ValueError(
                    f"model_mask holds {len(self.model_mask)} bytes for {self.num_completion_tokens} "
                    "completion tokens; there must be one per token (1: the model's, 0: the environment's)"
                )
            if not set(self.model_mask) <= {0, 1}:
                raise ValueError("model_mask holds a byte other than 0 (environment token) and 1 (model token)")
            env = self.model_mask_array() == 0
            if env.any() and bool(np.any(self.logprob_array()[env] != 0.0)):
                raise ValueError(
                    "an environment token (model_mask 0) has a behaviour logprob other than 0.0: "
                    "the model did not sample it"
                )
        if self.sample_index >= self.group_size:
            raise ValueError(f"sample_index {self.sample_index} is outside a group of {self.group_size}")
        if self.policy_version > self.policy_version_max:
            raise ValueError(
                f"policy_version {self.policy_version} exceeds policy_version_max {self.policy_version_max}: "
                "the versions are the min and max that generated the sample"
            )
        return self

    def completion_array(self) -> np.ndarray:
        return unpack_i32(self.completion_ids)

    def prompt_array(self) -> np.ndarray:
        return unpack_i32(self.prompt_ids)

    def logprob_array(self) -> np.ndarray:
        return unpack_f32(self.logprobs)

    def model_mask_array(self) -> np.ndarray:
        """(T,) uint8: 1 for a token the model sampled, 0 for one the environment appended."""
        if not self.model_mask:
            return np.ones(self.num_completion_tokens, dtype=np.uint8)
        return np.frombuffer(self.model_mask, dtype=np.uint8)

    @property
    def num_model_tokens(self) -> int:
        """Completion tokens the model sampled (all of them in a single-turn sample)."""
        return int(self.model_mask_array().sum())

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_array())

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion_array())


# reward_svc -> trainer_svc
class Scored(Message):
    """A rollout with its reward. Same msg_id as the rollout: one sample, one key end to end."""

    kind: ClassVar[str] = "scored"
    rollout: Rollout
    reward: float = Field(allow_inf_nan=False)
    # a weighted sum's terms, by name
    details: dict[Name, Annotated[float, Field(allow_inf_nan=False)]] = Field(default_factory=dict)
    # "ok", or why the reward is not the reward function's answer ("timeout", "error": the job's
    # reward policy then gave it `reward`), with the reason.
    reward_status: Literal["ok", "timeout", "error"] = "ok"
    reward_reason: Text = Field("", max_length=2000)

    @model_validator(mode="after")
    def _same_sample(self) -> Scored:
        r = self.rollout
        if (self.job_id, self.msg_id, self.group_id) != (r.job_id, r.msg_id, r.group_id):
            raise ValueError(
                f"job_id/msg_id/group_id {self.job_id!r}/{self.msg_id!r}/{self.group_id!r} differ from the "
                f"rollout's {r.job_id!r}/{r.msg_id!r}/{r.group_id!r}: one sample, one key"
            )
        return self


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Name = Field(min_length=1, max_length=1024)
    shape: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] = Field(max_length=16)
    dtype: Name = Field(max_length=32)  # torch dtype name without the "torch." prefix, e.g. "float32"
    offset: int = _int64()
    nbytes: int = _int64()


class Manifest(BaseModel):
    """What a weight version is: where each tensor sits in one flat buffer, and checksums."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: int = _int32()
    tensors: list[TensorEntry]
    total_bytes: int = _int64()
    chunk_bytes: int = _int64(lo=1)
    chunk_checksums: list[Annotated[Name, Field(max_length=64)]]  # xxh3_64 hex per chunk
    checksum: Name = Field(max_length=64)  # xxh3_64 hex over the chunk checksums: one id for the whole version

    @model_validator(mode="after")
    def _layout(self) -> Manifest:
        # A generator allocates total_bytes and fetches chunk by chunk: the numbers must agree
        # before anything is allocated.
        for t in self.tensors:
            if t.offset + t.nbytes > self.total_bytes:
                raise ValueError(
                    f"tensor {t.name} ends at byte {t.offset + t.nbytes}, past total_bytes {self.total_bytes}"
                )
        want = -(-self.total_bytes // self.chunk_bytes)
        if len(self.chunk_checksums) != want:
            raise ValueError(
                f"{len(self.chunk_checksums)} chunk checksums for {self.total_bytes} bytes in chunks of "
                f"{self.chunk_bytes} ({want} chunks)"
            )
        return self


# The module names a LoRA adapter may target: a layer's own attribute name (q_proj, down_proj...).
LORA_MODULE = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"


class LoraAdapter(BaseModel):
    """What a LoRA version's tensors are: a PEFT adapter (names as PEFT saves them) over the job's
    own model, whose effective weight is W + (alpha / rank) * B @ A on each target module."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rank: int = Field(ge=1, le=512)
    alpha: float = Field(gt=0.0, le=1e6, allow_inf_nan=False)
    target_modules: list[Annotated[str, Field(pattern=LORA_MODULE)]] = Field(min_length=1, max_length=64)


# trainer_svc -> every generator_svc (plain XREAD)
class PolicyAnnouncement(Message):
    """A new weight version. `probe_ids`/`probe_logprobs` are a functional fingerprint: the
    trainer's logprobs of a fixed token sequence under these weights, which a generator reproduces
    after loading to prove the weights actually in its engine are these (whatever the engine's
    internal layout: vLLM fuses and repacks tensors, so byte checksums cannot see inside it)."""

    kind: ClassVar[str] = "policy"
    manifest: Manifest
    transport: Name = Field(max_length=64)  # transport name, e.g. "tcp"
    address: Name = Field(max_length=1024)  # transport-specific endpoint, e.g. "127.0.0.1:5555"
    trainer_run: Name = Field(
        "", max_length=128
    )  # id of the trainer process that published it; a new one means a restart
    probe_ids: bytes = b""  # int32 LE, (P,)
    probe_logprobs: bytes = b""  # float32 LE, (P-1,): log p(probe[t+1] | probe[:t+1])
    # The trainer's staleness bound k when it published this version: generators admit training
    # groups by it (PromptGroup.train_version - k). None: a trainer from before admission by version.
    max_staleness: int | None = _int32(None)
    # None: the manifest holds the whole model. Set: it holds only this LoRA adapter's tensors,
    # over the job's model_path, and the probe was taken with the adapter applied.
    lora: LoraAdapter | None = None

    @model_validator(mode="after")
    def _probe(self) -> PolicyAnnouncement:
        _token_ids("probe_ids", self.probe_ids)
        _whole_values("probe_logprobs", self.probe_logprobs)
        return self


# broker API -> all services
class Control(Message):
    kind: ClassVar[str] = "control"
    command: Literal["pause", "resume", "stop", "drain", "cancel", "set"]
    reason: Text = Field("", max_length=4000)
    # "set": live knobs (JobPatch fields)
    settings: dict[Annotated[Name, Field(max_length=64)], Annotated[float, Field(allow_inf_nan=False)]] = Field(
        default_factory=dict
    )


# agent episodes (generator_svc/agents.py, broker/api/routes/agents.py): generator <-> API over Redis lists


class AgentTask(Message):
    """An episode a generator offers to the job's agents (msg_id: the episode's id); the API hands
    it to the agent that asks for one. Sent to the agent as JSON, so it carries the problem, not ids."""

    kind: ClassVar[str] = "agent_task"
    generator_id: Name = Field(min_length=1, max_length=256)
    purpose: Literal["train", "eval"] = "train"
    eval_set: Name = Field("", max_length=128)
    prompt_index: int = _int32()
    prompt: Text  # the dataset row's prompt text (not rendered: the agent builds its own messages)
    answer: Text
    metadata: Metadata = Field(default_factory=dict)


class AgentCall(Message):
    """One request of an agent for one episode (msg_id: the call's id; the reply goes to the list
    named by it). `body` is the request's JSON as the agent sent it: the generator validates it."""

    kind: ClassVar[str] = "agent_call"
    policy_version: int = _int32(0)  # not the call's: the generator answers with the version it sampled at
    episode_id: Name = Field(min_length=1, max_length=256)
    op: Literal["open", "chat", "completion", "end"]
    body: Text = Field("", max_length=4 * 1024 * 1024)


class AgentReply(Message):
    """The answer to an AgentCall (msg_id: the call's id): an HTTP status and a JSON body."""

    kind: ClassVar[str] = "agent_reply"
    policy_version: int = _int32(0)  # the answer's body says it
    status: int = Field(ge=100, le=599)
    body: Text = Field(max_length=8 * 1024 * 1024)


# any consumer -> {job}:dead
DEAD_RAW_BYTES = 64 * 1024  # a dead letter keeps at most this much of the entry, for inspection


class DeadLetter(Message):
    kind: ClassVar[str] = "dead"
    stream: Name = Field(max_length=64)
    entry_id: Name = Field(max_length=64)
    reason: Text = Field(max_length=4000)
    code: Name = Field("", max_length=64)  # one of REJECT_CODES, or a consumer's own ("max_deliveries", ...)
    raw: bytes = Field(b"", max_length=DEAD_RAW_BYTES)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.kind: cls
    for cls in (
        PromptGroup,
        EvalRound,
        Rollout,
        Scored,
        PolicyAnnouncement,
        Control,
        DeadLetter,
        AgentTask,
        AgentCall,
        AgentReply,
    )
}


def encode(msg: Message) -> bytes:
    body = msg.model_dump(mode="python")
    body["kind"] = msg.kind
    return msgpack.packb(body, use_bin_type=True)


class _TooManyValues(Exception):
    pass


class _Budget:
    """Counts array and map elements as msgpack builds them (its list/object hooks run once per
    container, bottom-up) and stops the unpacking past `limit`: an 8 MiB payload of empty arrays
    is millions of Python objects, refused after the first `limit`."""

    def __init__(self, limit: int):
        self.left = limit

    def list_hook(self, items: list) -> list:
        self.left -= len(items) + 1
        if self.left < 0:
            raise _TooManyValues
        return items

    def object_hook(self, d: dict) -> dict:
        self.left -= 2 * len(d) + 1
        if self.left < 0:
            raise _TooManyValues
        return d


M = TypeVar("M", bound=Message)


@overload
def decode(raw: bytes, expected: type[M], *, max_bytes: int = ..., max_elements: int = ...) -> M: ...
@overload
def decode(
    raw: bytes, expected: tuple[type[Message], ...] | None = None, *, max_bytes: int = ..., max_elements: int = ...
) -> Message: ...


def decode(
    raw: Any,
    expected: type[Message] | tuple[type[Message], ...] | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> Message:
    """Decode and validate one message of the `expected` kind (or one of several). Raises
    DecodeError with a reason; never unpickles.

    Memory: at most `max_bytes` of payload, and `max_elements` array/map elements in all (each one
    Python object), so a decode holds O(max_bytes + 60 * max_elements) bytes whatever the input."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise DecodeError(f"payload is {type(raw).__name__}, expected bytes", "not_bytes")
    if len(raw) > max_bytes:
        raise DecodeError(f"message of {len(raw)} bytes exceeds the limit of {max_bytes} bytes", "oversized")
    budget = _Budget(max_elements)
    try:
        body = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
            list_hook=budget.list_hook,
            object_hook=budget.object_hook,
        )
    except _TooManyValues:
        raise DecodeError(
            f"message holds more than {max_elements} array/map elements (a msgpack expansion bomb?)", "oversized"
        ) from None
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        if isinstance(exc, ValueError) and "exceeds max_" in str(exc):  # a str/bin/array/map/ext limit
            raise DecodeError(f"msgpack limit: {exc}"[:500], "oversized") from None
        raise DecodeError(f"not valid msgpack: {type(exc).__name__}: {exc}"[:500], "malformed") from None
    if not isinstance(body, dict):
        raise DecodeError(f"message is a msgpack {type(body).__name__}, expected a map", "not_a_map")
    version = body.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:  # True == 1 in Python: bool is not a version
        raise DecodeError(
            f"schema_version {version!r} is not supported (this build speaks {SCHEMA_VERSION})", "schema_version"
        )
    kind = body.pop("kind", None)
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise DecodeError(f"unknown message kind {kind!r}; valid kinds: {sorted(MESSAGE_TYPES)}", "unknown_kind")
    kinds = expected if isinstance(expected, tuple) else (expected,) if expected is not None else None
    if kinds is not None and cls not in kinds:
        carried = "' or '".join(k.kind for k in kinds)
        raise DecodeError(f"message kind '{kind}' on a stream that carries '{carried}'", "wrong_kind")
    try:
        # strict: no bool for an int, no str for a number, no str for bytes (pydantic's lax mode
        # would coerce them); WIRE: free text with control characters is refused, not repaired.
        return cls.model_validate(body, strict=True, context={WIRE: True})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise DecodeError(
            f"invalid {kind}: {where}: {first.get('msg')} ({exc.error_count()} error(s))", "invalid"
        ) from None
