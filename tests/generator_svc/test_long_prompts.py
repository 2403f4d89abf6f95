"""Prompts that do not fit the engine's context: dead-lettered with the reason before the generate
call, the rest of the batch kept. The token count is the model's own tokenizer; the integration
case checks against the real vLLM engine that the boundary and the count are vLLM's."""

from __future__ import annotations

import os
import uuid

import pytest

from broker.redis_server import resolve_redis_url
from broker.streams import GROUP_GENERATORS, PROMPTS, Consumer, JobStreams, connect
from generator_svc.service import prompt_token_counter, reject_too_long, too_long_reason
from shared.schema import EvalItem, EvalRound, PromptGroup, SamplingParams, decode, pack_i32
from trainer_svc.feeder import dead_members

JOB = "job-long"
MAX_LEN = 32


def group(i: int, prompt: str) -> PromptGroup:
    return PromptGroup(
        job_id=JOB,
        msg_id=f"{JOB}/g{i}",
        group_id=f"{JOB}/g{i}",
        policy_version=0,
        prompt_index=i,
        prompt=prompt,
        answer="2",
        n=2,
        sampling=SamplingParams(max_tokens=8),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from asyncrl.tiny_model import build_tiny_model

    return str(
        build_tiny_model(tmp_path_factory.mktemp("tiny"), layers=1, hidden=64, heads=2, intermediate=128)
    )  # vLLM CPU: head_dim >= 32


def test_boundary() -> None:
    assert too_long_reason(MAX_LEN - 1, MAX_LEN) is None  # room for one completion token
    reason = too_long_reason(MAX_LEN, MAX_LEN)
    assert reason and f"{MAX_LEN} tokens" in reason and "GEN_MAX_MODEL_LEN" in reason


def test_over_long_groups_are_dead_lettered_and_the_rest_kept(model_dir: str) -> None:
    count = prompt_token_counter(model_dir)
    assert count(["1+1=", "x" * 40]) == [5, 41]  # one token per character, plus <s>
    url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    js = JobStreams(connect(url), JOB, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    counted: list[tuple[str, str]] = []
    js.on_dead_letter = lambda stream, code: counted.append((stream, code))
    try:
        js.ensure_group(PROMPTS, GROUP_GENERATORS)
        js.publish_many(
            PROMPTS, [group(0, "1+1="), group(1, "x" * (MAX_LEN - 1)), group(2, "x" * 200), group(3, "2+2=")]
        )
        got = js.consume(Consumer(PROMPTS, GROUP_GENERATORS, "gen-0", PromptGroup), block_ms=100)
        kept = reject_too_long(got, count, MAX_LEN, js)
        assert [gs[0].group_id for _, gs in kept] == [f"{JOB}/g0", f"{JOB}/g3"]
        dead = {d.msg_id.split("/", 1)[1]: d for d in js.dead_letters()}
        assert {d.code for d in dead.values()} == {"prompt_too_long"}
        reasons = sorted(d.reason for d in dead.values())
        assert f"group {JOB}/g1: prompt of 32 tokens does not fit the engine's context of 32 tokens" in reasons[0]
        assert f"group {JOB}/g2: prompt of 201 tokens" in reasons[1]
        assert counted == [(PROMPTS, "prompt_too_long")] * 2
        assert js.pending_count(PROMPTS, GROUP_GENERATORS) == 2  # the dead ones are acked
        # each dead letter names its group, so the trainer frees the group's feeder slot
        members = sorted((m.group_id, m.purpose) for d in dead.values() for m in dead_members(d))
        assert members == [(f"{JOB}/g1", "train"), (f"{JOB}/g2", "train")]
    finally:
        js.delete_all()


@pytest.mark.integration
@pytest.mark.slow
def test_boundary_and_count_match_vllm(model_dir: str) -> None:
    from generator_svc.engine import Engine

    count = prompt_token_counter(model_dir)
    fits, too_long = "x" * (MAX_LEN - 2), "x" * (MAX_LEN - 1)  # 31 and 32 tokens with <s>
    assert count([fits, too_long]) == [MAX_LEN - 1, MAX_LEN]
    engine = Engine(model_dir, max_model_len=MAX_LEN)
    try:
        (samples,) = engine.generate([fits], [SamplingParams(max_tokens=8)], [2])
        assert len(samples[0].prompt_ids) == MAX_LEN - 1 and len(samples[0].completion_ids) >= 1
        # Unfiltered, one over-long prompt fails the whole call (vLLM's own validation error, at
        # the count and the boundary reject_too_long uses).
        with pytest.raises(Exception, match=rf"prompt \(length {MAX_LEN}\).*maximum model length of {MAX_LEN}"):
            engine.generate([fits, too_long], [SamplingParams(max_tokens=8)] * 2, [2, 2])
        # The engine still serves after refusing a batch.
        (again,) = engine.generate([fits], [SamplingParams(max_tokens=4)], [1])
        assert again[0].completion_ids
    finally:
        engine.close()


def test_an_over_long_problem_leaves_the_rest_of_its_evaluation_round(model_dir: str) -> None:
    count = prompt_token_counter(model_dir)
    url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    js = JobStreams(connect(url), JOB, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    try:
        js.ensure_group(PROMPTS, GROUP_GENERATORS)
        items = [
            EvalItem(prompt_index=0, prompt="1+1=", prompt_ids=pack_i32(range(5)), answer="2"),
            EvalItem(prompt_index=1, prompt="long", prompt_ids=pack_i32(range(MAX_LEN + 3)), answer="2"),
        ]
        js.publish(
            PROMPTS,
            EvalRound(
                job_id=JOB,
                msg_id=f"{JOB}/e0",
                group_id=f"{JOB}/e0",
                policy_version=0,
                eval_set="held_out",
                n=1,
                sampling=SamplingParams(temperature=0.0),
                items=items,
            ),
        )
        got = js.consume(Consumer(PROMPTS, GROUP_GENERATORS, "gen-0", (PromptGroup, EvalRound)), block_ms=100)
        (kept,) = reject_too_long(got, count, MAX_LEN, js)
        assert [g.group_id for g in kept[1]] == [f"{JOB}/e0/0"]  # lengths from the carried ids
        (dead,) = js.dead_letters()
        assert dead.code == "prompt_too_long" and f"{JOB}/e0/1: prompt of {MAX_LEN + 3} tokens" in dead.reason
        assert decode(dead.raw, PromptGroup).group_id == f"{JOB}/e0/1"  # the trainer settles just that problem
        assert js.pending_count(PROMPTS, GROUP_GENERATORS) == 1  # the round's entry waits for the rest
    finally:
        js.delete_all()
