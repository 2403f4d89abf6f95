"""Hypothesis fuzzing of the two untrusted inputs: stream entries (shared.schema.decode) and job
specs (shared.jobspec). Bounded (a few hundred examples each, no deadline) so it runs in seconds.

Decoder: mutated *valid* messages of every kind (nested fields replaced, deleted, added; bytes
flipped, truncated, extended; wrong kinds expected; tight size limits) give a Message or a
DecodeError whose code is one of REJECT_CODES, never another exception. tests/shared/test_schema.py
adds random bytes and flat map mutations.

Job spec: random JSON and mutated example specs give a JobSpec or a pydantic ValidationError, and
the API's 422 formatting (format_validation_error) turns every such error into [{field, message}]
strings. (The HTTP API itself is fuzzed by schemathesis in tests/broker/test_schemathesis.py.)
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shared.jobspec import JobPatch, JobSpec, format_validation_error
from shared.schema import (
    LOGPROB_MAX,
    MESSAGE_TYPES,
    REJECT_CODES,
    AgentCall,
    AgentReply,
    AgentTask,
    Control,
    DeadLetter,
    DecodeError,
    EvalItem,
    EvalRound,
    Manifest,
    Message,
    PolicyAnnouncement,
    PromptGroup,
    Rollout,
    SamplingParams,
    Scored,
    TensorEntry,
    decode,
    encode,
    pack_f32,
    pack_i32,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROOT = Path(__file__).resolve().parents[2]


def _common(**kw: Any) -> dict[str, Any]:
    return {"job_id": "j", "msg_id": "m", "group_id": "g", "policy_version": 2, **kw}


def _rollout() -> Rollout:
    return Rollout(
        **_common(),
        policy_version_max=2,
        prompt_index=1,
        sample_index=0,
        group_size=2,
        generator_id="gen",
        prompt_ids=pack_i32([1, 2, 3]),
        completion_ids=pack_i32([4, 5]),
        logprobs=pack_f32([-0.5, -1.0]),
        completion="45",
        answer="45",
    )


VALID: list[Message] = [
    PromptGroup(**_common(), prompt_index=0, prompt="1+1?", answer="2", n=4, sampling=SamplingParams(seed=3)),
    EvalRound(
        **_common(),
        eval_set="held_out",
        n=2,
        sampling=SamplingParams(temperature=0.0, stop=["\n"]),
        items=[EvalItem(prompt_index=3, prompt="1+2=", prompt_ids=pack_i32([1, 2]), answer="3", metadata={"level": 1})],
    ),
    _rollout(),
    Scored(**_common(), rollout=_rollout(), reward=1.0, details={"format": 1.0}),
    PolicyAnnouncement(
        **_common(),
        manifest=Manifest(
            version=2,
            tensors=[TensorEntry(name="w", shape=[2, 2], dtype="float32", offset=0, nbytes=16)],
            total_bytes=16,
            chunk_bytes=16,
            chunk_checksums=["00"],
            checksum="11",
        ),
        transport="tcp",
        address="127.0.0.1:1",
        probe_ids=pack_i32([1, 2]),
        probe_logprobs=pack_f32([-0.1]),
    ),
    Control(**_common(), command="set", settings={"lr": 1e-5}),
    DeadLetter(**_common(), stream="rollouts", entry_id="1-0", reason="bad", code="malformed", raw=b"\x00"),
    AgentTask(**_common(), generator_id="gen", prompt_index=1, prompt="1+1?", answer="2", metadata={"k": 1}),
    AgentCall(**_common(), episode_id="e", op="chat", body='{"messages": []}'),
    AgentReply(**_common(), status=200, body="{}"),
]
assert {m.kind for m in VALID} == set(MESSAGE_TYPES)

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into nested maps and lists of a decoded message body."""
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _apply(body: dict, path: tuple, op: str, value: Any) -> None:
    parent: Any = body
    for p in path[:-1]:
        parent = parent[p]
    key = path[-1]
    if op == "set":
        parent[key] = value
    elif op == "delete":
        del parent[key]
    elif op == "add" and isinstance(parent, dict):
        parent[f"{key}_extra"] = value
    elif op == "wrap":
        parent[key] = [parent[key]]


def check(raw: Any, expected: type[Message] | None = None, max_bytes: int | None = None) -> None:
    kw = {} if max_bytes is None else {"max_bytes": max_bytes}
    try:
        msg = decode(raw, expected, **kw)
    except DecodeError as exc:
        assert exc.code in REJECT_CODES, exc.code
        assert isinstance(exc.reason, str) and exc.reason and len(exc.reason) < 10_000
        return
    assert isinstance(msg, Message)
    assert expected is None or type(msg) is expected
    encode(msg)  # what decodes also re-encodes


@FUZZ
@given(
    msg=st.sampled_from(VALID),
    edits=st.lists(
        st.tuples(st.integers(min_value=0), st.sampled_from(["set", "delete", "add", "wrap"]), msgpack_values),
        min_size=1,
        max_size=4,
    ),
)
def test_nested_mutations_of_valid_messages(msg: Message, edits: list) -> None:
    body = msgpack.unpackb(encode(msg), raw=False)
    for pick, op, value in edits:
        paths = _paths(body)
        if not paths:
            break
        _apply(body, paths[pick % len(paths)], op, value)
    check(msgpack.packb(body, use_bin_type=True))


@FUZZ
@given(
    msg=st.sampled_from(VALID),
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)), max_size=6),
    cut=st.integers(min_value=0, max_value=64),
    tail=st.binary(max_size=16),
    expected=st.sampled_from([None, *MESSAGE_TYPES.values()]),
)
def test_byte_level_corruption_of_valid_messages(msg: Message, flips: list, cut: int, tail: bytes, expected) -> None:
    raw = bytearray(encode(msg))
    for pos, mask in flips:
        raw[pos % len(raw)] ^= mask
    if cut:
        raw = raw[: max(0, len(raw) - cut)]
    check(bytes(raw) + tail, expected)
    check(memoryview(bytes(raw)), expected)


@FUZZ
@given(msg=st.sampled_from(VALID), limit=st.integers(min_value=0, max_value=2048), version=msgpack_values)
def test_size_limits_and_schema_versions(msg: Message, limit: int, version: Any) -> None:
    raw = encode(msg)
    check(raw, max_bytes=limit)
    if len(raw) > limit:
        try:
            decode(raw, max_bytes=limit)
        except DecodeError as exc:
            assert exc.code == "oversized"
    body = msgpack.unpackb(raw, raw=False)
    body["schema_version"] = version
    check(msgpack.packb(body, use_bin_type=True))


@FUZZ
@given(
    prompt=st.binary(max_size=40),
    completion=st.binary(max_size=40),
    logprobs=st.binary(max_size=40),
    sample_index=st.integers(min_value=-2, max_value=10),
    group_size=st.integers(min_value=-1, max_value=10),
)
def test_rollout_arrays_must_be_consistent(prompt, completion, logprobs, sample_index, group_size) -> None:
    body = msgpack.unpackb(encode(_rollout()), raw=False)
    body.update(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=logprobs,
        sample_index=sample_index,
        group_size=group_size,
    )
    raw = msgpack.packb(body, use_bin_type=True)
    consistent = (
        len(prompt) % 4 == 0
        and len(completion) % 4 == 0
        and len(logprobs) == len(completion)
        and 0 <= sample_index < group_size
    )
    if consistent:  # whole values: token ids >= 0, logprobs finite and <= 0 (LOGPROB_MAX)
        lp = np.frombuffer(logprobs, "<f4")
        consistent = bool(
            (np.frombuffer(prompt, "<i4") >= 0).all() and (np.frombuffer(completion, "<i4") >= 0).all()
        ) and bool((np.isfinite(lp) & (lp <= LOGPROB_MAX)).all())
    try:
        r = decode(raw, Rollout)
    except DecodeError as exc:
        assert not consistent and exc.code == "invalid"
        return
    assert consistent
    assert len(r.logprob_array()) == len(r.completion_array())


# -- job specs -----------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
SPEC_KEYS = sorted(JobSpec.model_fields)
EXAMPLES = [json.loads(p.read_text()) for p in sorted((ROOT / "deploy" / "jobs").glob("*.json"))]


def check_spec(data: Any) -> None:
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        out = format_validation_error(exc)
        assert out and all(isinstance(e["field"], str) and isinstance(e["message"], str) and e["message"] for e in out)
        json.dumps(out)  # it goes into a JSON 422 body
        return
    # A valid spec survives its own round trip (it is stored as JSON in the ledger).
    assert JobSpec.model_validate(json.loads(spec.model_dump_json())) == spec
    assert spec.max_groups_in_flight >= spec.prompts_per_step


@FUZZ
@given(json_values)
def test_random_json_is_a_spec_or_a_readable_error(data: Any) -> None:
    check_spec(data)


@FUZZ
@given(
    base=st.sampled_from(EXAMPLES),
    edits=st.dictionaries(st.sampled_from([*SPEC_KEYS, "unknown_knob"]), json_values, min_size=1, max_size=4),
    nested=st.dictionaries(
        st.sampled_from(["lr", "rho", "loss", "advantage", "temperature", "max_tokens", "name", "k_min", "bogus"]),
        json_values,
        max_size=3,
    ),
)
def test_mutated_example_specs(base: dict, edits: dict, nested: dict) -> None:
    data = copy.deepcopy(base)
    data.update(edits)
    for section in ("algorithm", "sampling", "task", "adaptive_staleness"):
        if isinstance(data.get(section), dict):
            data[section].update(nested)
    check_spec(data)


@FUZZ
@given(st.text(max_size=200) | st.binary(max_size=200))
def test_raw_request_bodies(body: str | bytes) -> None:
    for model in (JobSpec, JobPatch):
        try:
            model.model_validate_json(body)
        except ValidationError as exc:
            assert all(e["message"] for e in format_validation_error(exc))


@FUZZ
@given(st.dictionaries(st.sampled_from([*JobPatch.model_fields, "x"]), json_values | st.floats(), max_size=5))
def test_patches(data: dict) -> None:
    try:
        patch = JobPatch.model_validate(data)
    except ValidationError as exc:
        assert all(e["message"] for e in format_validation_error(exc))
        return
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in patch.changes().values())


def test_format_validation_error_on_anything() -> None:
    for exc in (ValueError("plain"), RuntimeError(), Exception("x" * 10_000)):
        out = format_validation_error(exc)
        assert isinstance(out, list) and all(isinstance(e["message"], str) for e in out)
