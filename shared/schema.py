"""The wire schema: every message that crosses a Redis stream, and its msgpack codec.

Each message carries `schema_version`, `job_id`, `msg_id` (the idempotency key), `group_id` and
`policy_version`. Token ids and logprobs travel as packed little-endian binary (int32 / float32),
never as lists of Python numbers. Decoding never unpickles: msgpack -> dict -> pydantic validation,
and any failure raises `DecodeError` with a reason that goes to the dead-letter stream.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, TypeVar, overload

import msgpack
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCHEMA_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


# Why an entry was rejected, as a short fixed word: the dead-letter record and the per-reason
# metrics carry it (a metric label must not be free text); `reason` holds the details.
REJECT_CODES = (
    "not_bytes",  # the entry's payload is not a byte string
    "oversized",  # over the configured MAX_MESSAGE_BYTES
    "malformed",  # not msgpack at all, or truncated
    "not_a_map",  # msgpack, but not a map
    "schema_version",  # a schema version this build does not speak
    "unknown_kind",
    "wrong_kind",  # a valid message on a stream that carries another kind
    "invalid",  # fails validation (missing/extra field, out-of-range value, inconsistent arrays)
)


class DecodeError(ValueError):
    """A stream entry that cannot be turned into a valid message; `reason` says why, `code` is
    one of REJECT_CODES."""

    def __init__(self, reason: str, code: str = "invalid"):
        super().__init__(reason)
        self.reason = reason
        self.code = code


def pack_i32(values: Any) -> bytes:
    return np.asarray(values, dtype=_I32).tobytes()


def pack_f32(values: Any) -> bytes:
    return np.asarray(values, dtype=_F32).tobytes()


def unpack_i32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype=_I32)


def unpack_f32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype=_F32)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: ClassVar[str]

    schema_version: int = SCHEMA_VERSION
    job_id: str = Field(min_length=1, max_length=128)
    msg_id: str = Field(min_length=1, max_length=256)
    group_id: str = Field("", max_length=256)
    policy_version: int = Field(ge=0)


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(16, ge=1)
    seed: int | None = None
    # Stopping, applied by vLLM: the completion ends at the first stop string (excluded from the
    # text and the tokens unless include_stop_str_in_output) or stop token id; min_tokens first.
    stop: list[str] = Field(default_factory=list, max_length=64)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False


# Row metadata (a dataset's other columns) travels as a msgpack map of JSON-like values.
Metadata = dict[str, Any]


# trainer_svc (feeder) -> generator_svc
class PromptGroup(Message):
    """One prompt to be sampled `n` times. `policy_version` is the trainer's version when fed."""

    kind: ClassVar[str] = "prompt_group"
    purpose: Literal["train", "eval"] = "train"
    prompt_index: int = Field(ge=0)
    prompt: str = Field(min_length=1)  # the rendered prompt text (chat template applied)
    # int32 LE: the prompt's token ids, rendered and tokenized once by the feeder. The generator
    # generates from exactly these ids and the trainer trains on them (no second tokenization).
    prompt_ids: bytes = b""
    answer: str
    metadata: Metadata = Field(default_factory=dict)  # the dataset row's other columns, for the reward
    eval_set: str = Field("", max_length=128)  # purpose "eval": which named evaluation set
    n: int = Field(ge=1)
    sampling: SamplingParams

    @model_validator(mode="after")
    def _whole_ids(self) -> PromptGroup:
        if len(self.prompt_ids) % 4:
            raise ValueError(f"prompt_ids holds {len(self.prompt_ids)} bytes, not a whole number of 4-byte values")
        return self

    def prompt_array(self) -> np.ndarray:
        return unpack_i32(self.prompt_ids)


class EvalItem(BaseModel):
    """One problem of an evaluation round (the fields of a PromptGroup that differ per problem)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    prompt_index: int = Field(ge=0)
    prompt: str = Field(min_length=1)
    prompt_ids: bytes = b""  # int32 LE, as PromptGroup.prompt_ids
    answer: str
    metadata: Metadata = Field(default_factory=dict)

    @model_validator(mode="after")
    def _whole_ids(self) -> EvalItem:
        if len(self.prompt_ids) % 4:
            raise ValueError(f"prompt_ids holds {len(self.prompt_ids)} bytes, not a whole number of 4-byte values")
        return self


# trainer_svc (feeder) -> generator_svc
class EvalRound(Message):
    """A whole evaluation round as one entry: one generator takes it and generates every problem
    in one call, so the round measures exactly one policy version (in async mode too). Its
    rollouts are groups `{round}/{prompt_index}` of `n` samples each. `policy_version`: the
    trainer's version when fed (the generator uses that or a newer one)."""

    kind: ClassVar[str] = "eval_round"
    eval_set: str = Field(min_length=1, max_length=128)
    n: int = Field(ge=1)
    sampling: SamplingParams
    items: list[EvalItem] = Field(min_length=1)

    def groups(self) -> list[PromptGroup]:
        """The round as prompt groups, one per problem (what the generator generates)."""
        return [
            PromptGroup(job_id=self.job_id, msg_id=f"{self.group_id}/{it.prompt_index}",
                        group_id=f"{self.group_id}/{it.prompt_index}", policy_version=self.policy_version,
                        purpose="eval", prompt_index=it.prompt_index, prompt=it.prompt, prompt_ids=it.prompt_ids,
                        answer=it.answer, metadata=it.metadata, eval_set=self.eval_set, n=self.n,
                        sampling=self.sampling)
            for it in self.items
        ]


# generator_svc -> reward_svc
class Rollout(Message):
    """One completion. `policy_version` is the version that generated it (min if it changed mid-sample)."""

    kind: ClassVar[str] = "rollout"
    purpose: Literal["train", "eval"] = "train"
    policy_version_max: int = Field(ge=0)
    prompt_index: int = Field(ge=0)
    sample_index: int = Field(ge=0)
    group_size: int = Field(ge=1)
    generator_id: str
    prompt_ids: bytes  # int32 LE, (P,)
    completion_ids: bytes  # int32 LE, (T,)
    logprobs: bytes  # float32 LE, (T,): behaviour logprob of each sampled token
    completion: str
    finish_reason: str | None = None  # vLLM's: "stop" (EOS, stop string or token), "length"
    answer: str
    prompt: str = ""  # the rendered prompt text (for rewards that read it: judges, reward models)
    metadata: Metadata = Field(default_factory=dict)
    eval_set: str = Field("", max_length=128)
    temperature: float = Field(1.0, ge=0.0)  # sampled at; the trainer rescales its logits alike

    @model_validator(mode="after")
    def _arrays_consistent(self) -> Rollout:
        # The trainer indexes logprobs by completion position: a mismatch would be a shape error
        # deep inside a training step, so it is rejected here, at the stream boundary.
        for name in ("prompt_ids", "completion_ids", "logprobs"):
            if len(getattr(self, name)) % 4:
                raise ValueError(f"{name} holds {len(getattr(self, name))} bytes, not a whole number of 4-byte values")
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"{len(self.logprobs) // 4} logprobs for {len(self.completion_ids) // 4} completion tokens; "
                "there must be one behaviour logprob per sampled token"
            )
        if self.sample_index >= self.group_size:
            raise ValueError(f"sample_index {self.sample_index} is outside a group of {self.group_size}")
        return self

    def completion_array(self) -> np.ndarray:
        return unpack_i32(self.completion_ids)

    def prompt_array(self) -> np.ndarray:
        return unpack_i32(self.prompt_ids)

    def logprob_array(self) -> np.ndarray:
        return unpack_f32(self.logprobs)


# reward_svc -> trainer_svc
class Scored(Message):
    """A rollout with its reward. Same msg_id as the rollout: one sample, one key end to end."""

    kind: ClassVar[str] = "scored"
    rollout: Rollout
    reward: float
    details: dict[str, float] = Field(default_factory=dict)  # a weighted sum's terms, by name
    # "ok", or why the reward is not the reward function's answer ("timeout", "error": the job's
    # reward policy then gave it `reward`), with the reason.
    reward_status: Literal["ok", "timeout", "error"] = "ok"
    reward_reason: str = Field("", max_length=2000)


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    shape: list[int]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)


class Manifest(BaseModel):
    """What a weight version is: where each tensor sits in one flat buffer, and checksums."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: int = Field(ge=0)
    tensors: list[TensorEntry]
    total_bytes: int = Field(ge=0)
    chunk_bytes: int = Field(gt=0)
    chunk_checksums: list[str]  # xxh3_64 hex per chunk
    checksum: str  # xxh3_64 hex over the chunk checksums: one id for the whole version


# trainer_svc -> every generator_svc (plain XREAD)
class PolicyAnnouncement(Message):
    """A new weight version. `probe_ids`/`probe_logprobs` are a functional fingerprint: the
    trainer's logprobs of a fixed token sequence under these weights, which a generator reproduces
    after loading to prove the weights actually in its engine are these (whatever the engine's
    internal layout: vLLM fuses and repacks tensors, so byte checksums cannot see inside it)."""

    kind: ClassVar[str] = "policy"
    manifest: Manifest
    transport: str  # transport name, e.g. "tcp"
    address: str  # transport-specific endpoint, e.g. "127.0.0.1:5555"
    trainer_run: str = ""  # id of the trainer process that published it; a new one means a restart
    probe_ids: bytes = b""  # int32 LE, (P,)
    probe_logprobs: bytes = b""  # float32 LE, (P-1,): log p(probe[t+1] | probe[:t+1])


# broker API -> all services
class Control(Message):
    kind: ClassVar[str] = "control"
    command: Literal["pause", "resume", "stop", "drain", "cancel", "set"]
    reason: str = ""
    settings: dict[str, float] = Field(default_factory=dict)  # "set": live knobs (JobPatch fields)


# any consumer -> {job}:dead
class DeadLetter(Message):
    kind: ClassVar[str] = "dead"
    stream: str
    entry_id: str
    reason: str
    code: str = ""  # one of REJECT_CODES, or a consumer's own ("max_deliveries", "non_finite_reward", ...)
    raw: bytes = b""


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.kind: cls for cls in (PromptGroup, EvalRound, Rollout, Scored, PolicyAnnouncement, Control, DeadLetter)
}


def encode(msg: Message) -> bytes:
    body = msg.model_dump(mode="python")
    body["kind"] = msg.kind
    return msgpack.packb(body, use_bin_type=True)


M = TypeVar("M", bound=Message)


@overload
def decode(raw: bytes, expected: type[M], *, max_bytes: int = ...) -> M: ...
@overload
def decode(raw: bytes, expected: tuple[type[Message], ...] | None = None, *, max_bytes: int = ...) -> Message: ...


def decode(raw: Any, expected: type[Message] | tuple[type[Message], ...] | None = None, *,
           max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Decode and validate one message of the `expected` kind (or one of several). Raises
    DecodeError with a reason; never unpickles."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise DecodeError(f"payload is {type(raw).__name__}, expected bytes", "not_bytes")
    if len(raw) > max_bytes:
        raise DecodeError(f"message of {len(raw)} bytes exceeds the limit of {max_bytes} bytes", "oversized")
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=max_bytes)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise DecodeError(f"not valid msgpack: {type(exc).__name__}: {exc}", "malformed") from None
    if not isinstance(body, dict):
        raise DecodeError(f"message is a msgpack {type(body).__name__}, expected a map", "not_a_map")
    version = body.get("schema_version")
    if version != SCHEMA_VERSION:
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
        return cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise DecodeError(
            f"invalid {kind}: {where}: {first.get('msg')} ({exc.error_count()} error(s))", "invalid"
        ) from None
