"""The wire schema: every message survives encode/decode, and decode rejects bad input with a reason."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.schema import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
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
    clean_text,
    decode,
    encode,
    pack_f32,
    pack_i32,
    unpack_f32,
    unpack_i32,
)

# Values chosen so that any lossy step (float64 -> float32 rounding, int truncation, sign loss,
# NaN canonicalisation) changes at least one byte.
I32 = [0, 1, -1, 7, 2**31 - 1, -(2**31), 151_645]
F32 = np.array(
    [0.0, -0.0, -1.5, 1e-45, -3.4028235e38, float("inf"), float("-inf"), float("nan"), -0.6931472],
    dtype=np.float32,
)
# What a rollout may carry: token ids >= 0, behaviour logprobs finite and <= 0 (same bit-sensitivity).
TOKENS = [0, 1, 7, 2**31 - 1, 151_645]
LOGPROBS = np.array([-0.0, -1.5, -1e-45, -3.4028235e38, -0.6931472], dtype=np.float32)


def common(**extra) -> dict:
    return {"job_id": "job-1", "msg_id": "m-1", "group_id": "g-1", "policy_version": 3, **extra}


def prompt_group() -> PromptGroup:
    return PromptGroup(
        **common(),
        purpose="eval",
        prompt_index=12,
        prompt="What is 2 + 2?",
        answer="4",
        n=8,
        sampling=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=32, seed=5),
    )


def rollout(**extra) -> Rollout:
    return Rollout(
        **common(**extra),
        policy_version_max=4,
        prompt_index=12,
        sample_index=3,
        group_size=8,
        generator_id="gen-0",
        prompt_ids=pack_i32([1, 2, 3]),
        completion_ids=pack_i32(TOKENS),
        logprobs=pack_f32(LOGPROBS),
        completion="The answer is 4.",
        finish_reason="stop",
        answer="4",
    )


def manifest() -> Manifest:
    return Manifest(
        version=4,
        tensors=[
            TensorEntry(name="embed.weight", shape=[16, 8], dtype="float32", offset=0, nbytes=512),
            TensorEntry(name="head.bias", shape=[16], dtype="bfloat16", offset=512, nbytes=32),
        ],
        total_bytes=544,
        chunk_bytes=256,
        chunk_checksums=["0123456789abcdef", "fedcba9876543210", "00000000000000ff"],
        checksum="aaaaaaaaaaaaaaaa",
    )


MESSAGES: list[Message] = [
    prompt_group(),
    rollout(),
    Scored(**common(), rollout=rollout(), reward=1.0, details={"format": 0.5, "correct": 1.0}),
    PolicyAnnouncement(**common(), manifest=manifest(), transport="tcp", address="127.0.0.1:5555"),
    Control(**common(), command="drain", reason="operator asked"),
    DeadLetter(**common(), stream="rollouts", entry_id="1-0", reason="bad", raw=b"\x00\xc1\xff"),
    EvalRound(
        **common(),
        eval_set="hard",
        n=4,
        sampling=SamplingParams(temperature=1.0, stop=["\n"], min_tokens=1),
        items=[
            EvalItem(
                prompt_index=0,
                prompt="12-5=",
                prompt_ids=pack_i32([1, 5, 6]),
                answer="7",
                metadata={"level": 2, "tags": ["sub"]},
            )
        ],
    ),
    AgentTask(
        **common(), generator_id="gen-1", purpose="eval", eval_set="held_out", prompt_index=2, prompt="q", answer="a"
    ),
    AgentCall(**common(), episode_id="e-1", op="end", body='{"reward": 1.0}'),
    AgentReply(**common(), status=409, body='{"error": {"message": "edited"}}'),
]


def valid_body(msg: Message | None = None) -> dict:
    """The msgpack map of a valid message, to be broken one way at a time."""
    return msgpack.unpackb(encode(msg or Control(**common(), command="stop")), raw=False)


def packb(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# -- round trips ---------------------------------------------------------------------------------


def test_every_message_kind_has_a_round_trip_case() -> None:
    assert {m.kind for m in MESSAGES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", MESSAGES, ids=[m.kind for m in MESSAGES])
def test_round_trip(msg: Message) -> None:
    raw = encode(msg)
    assert isinstance(raw, bytes)
    got = decode(raw, type(msg))
    assert type(got) is type(msg)
    assert got.schema_version == SCHEMA_VERSION
    # NaN in the packed logprobs is bytes on the wire, so model equality is exact here.
    assert got == msg
    assert encode(got) == raw
    # Without `expected` the kind on the wire picks the class.
    assert type(decode(raw)) is type(msg)


def test_rollout_accounting_fields_round_trip_and_default() -> None:
    # With them: carried exactly.
    r = rollout(adapter="job-1/v3#7", gen_seconds=0.125)
    got = decode(encode(r), Rollout)
    assert (got.adapter, got.gen_seconds) == ("job-1/v3#7", 0.125)
    # A message from a generator that predates them (neither key on the wire) still decodes.
    body = valid_body(rollout())
    del body["adapter"], body["gen_seconds"]
    old = decode(packb(body), Rollout)
    assert (old.adapter, old.gen_seconds) == ("", 0.0)
    assert old == rollout()


def test_round_trip_accepts_bytearray_and_memoryview() -> None:
    raw = encode(MESSAGES[0])
    assert decode(bytearray(raw)) == MESSAGES[0]
    assert decode(memoryview(raw)) == MESSAGES[0]


def test_encode_is_msgpack_map_with_kind_and_version() -> None:
    body = valid_body(rollout())
    assert body["kind"] == "rollout"
    assert body["schema_version"] == SCHEMA_VERSION
    # Arrays travel as msgpack bin, not as lists of numbers.
    assert isinstance(body["completion_ids"], bytes)
    assert isinstance(body["logprobs"], bytes)


def test_packed_arrays_are_little_endian_and_exact() -> None:
    assert pack_i32(I32) == struct.pack(f"<{len(I32)}i", *I32)
    assert pack_f32(F32) == struct.pack(f"<{len(F32)}f", *F32.tolist())
    assert unpack_i32(pack_i32(I32)).tolist() == I32
    got = unpack_f32(pack_f32(F32))
    assert got.dtype == np.dtype("<f4")
    assert got.tobytes() == F32.tobytes()  # -0.0 keeps its sign, NaN stays NaN
    np.testing.assert_array_equal(got, F32)


def test_rollout_arrays_survive_the_wire_bit_exact() -> None:
    lp = np.array([-0.1, -2.25, -1e-7, -1e-45, -0.0], dtype=np.float32)
    msg = rollout().model_copy(update={"logprobs": pack_f32(lp)})
    got = decode(encode(msg), Rollout)
    assert isinstance(got, Rollout)
    assert got.completion_array().dtype == np.dtype("<i4")
    assert got.completion_array().tolist() == TOKENS
    assert got.prompt_array().tolist() == [1, 2, 3]
    assert got.logprob_array().tobytes() == lp.tobytes()


def test_float64_input_is_rounded_to_float32_once() -> None:
    values = [0.1, 1 / 3, -2.718281828459045]
    assert unpack_f32(pack_f32(values)).tolist() == np.asarray(values, np.float32).tolist()


def test_nested_rollout_in_scored_is_validated() -> None:
    body = valid_body(MESSAGES[2])
    del body["rollout"]["completion_ids"]
    with pytest.raises(DecodeError) as err:
        decode(packb(body))
    assert "rollout.completion_ids" in err.value.reason


# -- rejections ------------------------------------------------------------------------------------


def reason_of(raw, expected=None, **kw) -> str:
    with pytest.raises(DecodeError) as err:
        decode(raw, expected, **kw)
    assert str(err.value) == err.value.reason
    return err.value.reason


def test_garbage_bytes() -> None:
    assert "not valid msgpack" in reason_of(b"\xc1\xc1\xc1 not msgpack")


def test_truncated_message() -> None:
    assert "not valid msgpack" in reason_of(encode(MESSAGES[0])[:-5])


def test_empty_payload() -> None:
    assert "not valid msgpack" in reason_of(b"")


def test_list_instead_of_map() -> None:
    reason = reason_of(packb([1, 2, 3]))
    assert "list" in reason and "expected a map" in reason


def test_scalar_instead_of_map() -> None:
    assert "expected a map" in reason_of(packb(42))


@pytest.mark.parametrize("version", [0, 2, SCHEMA_VERSION + 1, None, "1"])
def test_wrong_schema_version(version) -> None:
    body = valid_body()
    body["schema_version"] = version
    reason = reason_of(packb(body))
    assert "schema_version" in reason and repr(version) in reason


def test_missing_schema_version() -> None:
    body = valid_body()
    del body["schema_version"]
    assert "schema_version None" in reason_of(packb(body))


@pytest.mark.parametrize("kind", ["bogus", None, 3, b"control"])
def test_unknown_kind(kind) -> None:
    body = valid_body()
    body["kind"] = kind
    reason = reason_of(packb(body))
    assert "unknown message kind" in reason
    assert "control" in reason and "rollout" in reason  # lists the valid kinds


def test_missing_kind() -> None:
    body = valid_body()
    del body["kind"]
    assert "unknown message kind None" in reason_of(packb(body))


def test_kind_does_not_match_expected() -> None:
    reason = reason_of(encode(MESSAGES[4]), Rollout)
    assert "'control'" in reason and "'rollout'" in reason


def test_expected_kind_matches() -> None:
    assert decode(encode(MESSAGES[4]), Control) == MESSAGES[4]


@pytest.mark.parametrize("field", ["job_id", "msg_id", "policy_version", "command"])
def test_missing_required_field(field: str) -> None:
    body = valid_body()
    del body[field]
    reason = reason_of(packb(body), Control)
    assert reason.startswith("invalid control")
    assert field in reason and "required" in reason.lower()


def test_extra_field() -> None:
    body = valid_body()
    body["sneaky"] = 1
    reason = reason_of(packb(body), Control)
    assert "sneaky" in reason and "not permitted" in reason


def test_extra_field_in_nested_model() -> None:
    body = valid_body(MESSAGES[3])
    body["manifest"]["tensors"][1]["stride"] = [1]
    assert "manifest.tensors.1.stride" in reason_of(packb(body))


@pytest.mark.parametrize(
    ("field", "value"),
    [("policy_version", -1), ("job_id", ""), ("command", "explode"), ("policy_version", "three")],
)
def test_invalid_field_value(field: str, value) -> None:
    body = valid_body()
    body[field] = value
    assert field in reason_of(packb(body), Control)


def test_oversized_payload() -> None:
    raw = encode(prompt_group().model_copy(update={"prompt": "x" * 5000}))
    reason = reason_of(raw, max_bytes=1024)
    assert str(len(raw)) in reason and "1024" in reason
    # The default limit admits it; the limit is inclusive.
    assert decode(raw).kind == "prompt_group"
    assert decode(raw, max_bytes=len(raw)).kind == "prompt_group"
    assert "exceeds" in reason_of(raw, max_bytes=len(raw) - 1)


@pytest.mark.parametrize("payload", ["a string", 123, None, [b"d"], {"d": b""}])
def test_non_bytes_payload(payload) -> None:
    reason = reason_of(payload)
    assert type(payload).__name__ in reason and "expected bytes" in reason


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(DecodeError, ValueError)


# -- fuzzing ---------------------------------------------------------------------------------------


def check_decode_total(raw: bytes) -> None:
    """decode returns a Message or raises DecodeError, and what it returns re-encodes losslessly."""
    try:
        msg = decode(raw)
    except DecodeError as exc:
        assert isinstance(exc.reason, str) and exc.reason
        return
    assert isinstance(msg, Message)
    # Compare encodings, not models: a NaN reward is valid and NaN != NaN.
    assert encode(decode(encode(msg))) == encode(msg)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_decode_arbitrary_bytes_never_raises_anything_else(raw: bytes) -> None:
    check_decode_total(raw)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    msg=st.sampled_from(MESSAGES),
    changes=st.dictionaries(
        st.sampled_from(
            [
                "kind",
                "schema_version",
                "job_id",
                "policy_version",
                "command",
                "rollout",
                "manifest",
                "sampling",
                "details",
                "raw",
                "n",
                "extra",
                "prompt_ids",
                "reward",
            ]
        ),
        msgpack_values,
        max_size=3,
    ),
    drop=st.sets(st.sampled_from(["kind", "job_id", "msg_id", "rollout", "manifest"]), max_size=2),
)
def test_decode_mutated_messages_never_raises_anything_else(msg, changes, drop) -> None:
    # Mutating valid maps reaches the validation step, which random bytes rarely do.
    body = valid_body(msg)
    body.update(changes)
    for k in drop:
        body.pop(k, None)
    check_decode_total(packb(body))


# -- the boundary: strict types, ledger-sized integers, finite values, printable text ----------------


def rollout_body(**changes) -> bytes:
    return packb({**valid_body(rollout()), **changes})


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"policy_version": True}, "policy_version"),  # bool is not an int
        ({"policy_version": "1"}, "policy_version"),  # nor is a numeric string
        ({"policy_version": 1.0}, "policy_version"),
        ({"prompt_index": 2**31}, "prompt_index"),  # PostgreSQL integer
        ({"policy_version": 2**63, "policy_version_max": 2**63}, "policy_version"),
        ({"sample_index": -1}, "sample_index"),
        ({"group_size": 10_000}, "group_size"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 1e30}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"completion": "4\x002"}, "completion"),
        ({"completion": "\x1b[2Jgone"}, "completion"),
        ({"generator_id": "gen\n0"}, "generator_id"),
        ({"msg_id": "m\x00"}, "msg_id"),
        ({"completion_ids": b"\x00\x00\x00\x80", "logprobs": pack_f32([-1.0])}, "completion_ids"),  # -2**31
        ({"prompt_ids": "abcd"}, "prompt_ids"),  # str for bytes
        ({"env_metrics": {"ok": float("nan")}}, "env_metrics"),
        ({"env_metrics": {f"k{i}": 1.0 for i in range(17)}}, "env_metrics"),
        ({"env_metrics": {"x" * 65: 1.0}}, "env_metrics"),
        ({"env_metrics": {"ok": "yes"}}, "env_metrics"),
        ({"adapter": "a" * 201}, "adapter"),
        ({"adapter": "job-1/v3\n#7"}, "adapter"),
        ({"gen_seconds": -0.5}, "gen_seconds"),
        ({"gen_seconds": float("nan")}, "gen_seconds"),
        ({"gen_seconds": float("inf")}, "gen_seconds"),
        ({"gen_seconds": 1e30}, "gen_seconds"),
    ],
)
def test_rollout_values_are_checked_at_the_boundary(changes, where) -> None:
    assert where in reason_of(rollout_body(**changes), Rollout)


@pytest.mark.parametrize(
    ("name", "values", "ok"),
    [
        ("nan", [np.nan, -1.0], False),
        ("inf", [-1.0, np.inf], False),
        ("-inf", [-np.inf, -1.0], False),
        ("positive", [-1.0, 0.5], False),
        ("float32 rounding", [-1.0, 5e-5], True),
        ("zero", [0.0, -0.0], True),
    ],
)
def test_behaviour_logprobs_are_finite_and_not_positive(name, values, ok) -> None:
    raw = rollout_body(completion_ids=pack_i32([1, 2]), logprobs=pack_f32(values))
    if ok:
        assert decode(raw, Rollout).logprob_array().size == 2
    else:
        assert "logprobs" in reason_of(raw, Rollout)


def test_token_ids_are_not_negative() -> None:
    assert "completion_ids[1] is -3" in reason_of(
        rollout_body(completion_ids=pack_i32([1, -3]), logprobs=pack_f32([-1.0, -1.0])), Rollout
    )
    assert "prompt_ids[0]" in reason_of(rollout_body(prompt_ids=pack_i32([-1])), Rollout)


def test_policy_versions_are_ordered() -> None:
    reason = reason_of(rollout_body(policy_version=5, policy_version_max=4), Rollout)
    assert "policy_version 5 exceeds policy_version_max 4" in reason
    assert decode(rollout_body(policy_version=4, policy_version_max=4), Rollout).policy_version == 4


def test_schema_version_true_is_not_one() -> None:
    body = valid_body()
    body["schema_version"] = True
    with pytest.raises(DecodeError) as err:
        decode(packb(body))
    assert err.value.code == "schema_version" and "True" in err.value.reason


def test_integers_up_to_the_ledger_columns_are_accepted() -> None:
    got = decode(rollout_body(prompt_index=2**31 - 1, policy_version=2**31 - 1, policy_version_max=2**31 - 1), Rollout)
    assert got.prompt_index == got.policy_version == 2**31 - 1
    # byte sizes are int64 (PostgreSQL bigint)
    big = Manifest(version=1, tensors=[], total_bytes=2**40, chunk_bytes=2**40, chunk_checksums=["a"], checksum="b")
    assert decode(encode(PolicyAnnouncement(**common(), manifest=big, transport="tcp", address="h:1"))).manifest == big


def test_text_keeps_tab_newline_and_return() -> None:
    text = "line 1\n\tline 2\r\n"
    assert decode(rollout_body(completion=text), Rollout).completion == text


def test_control_characters_built_in_process_become_replacement_characters() -> None:
    # what an engine or a dataset emits must not crash its producer; the wire never carries it
    r = rollout().model_copy(update={})
    made = Rollout(**{**r.model_dump(), "completion": "a\x00b\x1bc\nd", "prompt": "\x7f"})
    assert made.completion == "a\ufffdb\ufffdc\nd" and made.prompt == "\ufffd"
    assert clean_text("ok\t\x01") == "ok\t\ufffd"
    assert decode(encode(made), Rollout).completion == made.completion
    with pytest.raises(ValueError, match="control character"):  # identifiers are refused everywhere
        Rollout(**{**r.model_dump(), "msg_id": "m\x00"})


def test_scored_values() -> None:
    body = valid_body(MESSAGES[2])
    for change, where in [
        ({"reward": float("nan")}, "reward"),
        ({"details": {"x": float("inf")}}, "details"),
        ({"msg_id": "another"}, "one sample, one key"),
        ({"reward": True}, "reward"),
    ]:
        assert where in reason_of(packb({**body, **change}), Scored)


def test_sampling_and_rounds_are_consistent() -> None:
    body = valid_body(prompt_group())
    assert "min_tokens" in reason_of(packb({**body, "sampling": {**body["sampling"], "min_tokens": 40}}))
    assert "n" in reason_of(packb({**body, "n": 2**31}))
    rnd = valid_body(MESSAGES[6])
    twice = {**rnd, "items": rnd["items"] * 2}
    assert "appears twice" in reason_of(packb(twice), EvalRound)


def test_manifest_layout_is_consistent() -> None:
    body = valid_body(MESSAGES[3])
    short = {**body, "manifest": {**body["manifest"], "chunk_checksums": ["a"]}}
    assert "chunk checksums" in reason_of(packb(short))
    past = {**body, "manifest": {**body["manifest"], "total_bytes": 100, "chunk_checksums": ["a"], "chunk_bytes": 256}}
    assert "past total_bytes" in reason_of(packb(past))


# -- msgpack bounds: a small payload cannot become a large object graph -------------------------------


def test_msgpack_ext_types_are_refused() -> None:
    body = valid_body()
    body["reason"] = msgpack.ExtType(5, b"abc")
    assert reason_of(packb(body))
    assert reason_of(packb({**valid_body(), "reason": msgpack.Timestamp(1, 0)}))


def test_msgpack_bombs_are_refused_cheaply() -> None:
    import time

    # 8 M empty arrays under one header: refused at the header
    n = 8 * 1024 * 1024 - 64
    flat = b"\x81" + packb("x") + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    with pytest.raises(DecodeError) as err:
        decode(flat)
    assert err.value.code == "oversized" and "max_array_len" in err.value.reason
    # the same number of arrays nested within the per-array limit: refused by the element budget
    inner = b"\xdd" + (4096).to_bytes(4, "big") + b"\x90" * 4096
    nested = b"\x81" + packb("x") + b"\xdd" + (2040).to_bytes(4, "big") + inner * 2040
    assert len(nested) < DEFAULT_MAX_MESSAGE_BYTES
    t0 = time.perf_counter()
    with pytest.raises(DecodeError) as err:
        decode(nested)
    assert err.value.code == "oversized" and "elements" in err.value.reason
    assert time.perf_counter() - t0 < 2.0  # stops after DEFAULT_MAX_ELEMENTS, not 8 M


def test_element_budget_admits_real_messages() -> None:
    # a 512 GiB model's manifest in 4 MiB chunks: the largest legitimate array
    n = 2**17
    m = Manifest(
        version=1,
        tensors=[],
        total_bytes=n * 4 * 2**20,
        chunk_bytes=4 * 2**20,
        chunk_checksums=[f"{i:016x}" for i in range(n)],
        checksum="c",
    )
    msg = PolicyAnnouncement(**common(), manifest=m, transport="tcp", address="h:1")
    assert decode(encode(msg)).manifest.total_bytes == m.total_bytes
    with pytest.raises(DecodeError) as err:
        decode(encode(msg), max_elements=1000)
    assert err.value.code == "oversized"
