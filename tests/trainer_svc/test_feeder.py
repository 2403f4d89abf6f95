"""The feeder's in-flight cap follows the staleness bound; the assembler never counts a sample twice."""

import pytest

from asyncrl.tiny_model import build_tokenizer
from broker.streams import PROMPTS, JobStreams
from shared.ids import eval_round
from shared.jobspec import JobSpec, SamplingSpec
from shared.prompts import renderer
from shared.schema import (
    EvalItem,
    EvalRound,
    PromptGroup,
    Rollout,
    SamplingParams,
    Scored,
    pack_f32,
    pack_i32,
)
from shared.tasks import Problem
from trainer_svc.feeder import Feeder, GroupAssembler, group_seed

RENDER = renderer(build_tokenizer())  # the tiny model's character tokenizer: plain text, <s> first


def _problems(n):
    return [Problem(i, f"{i}+1=", str(i + 1)) for i in range(n)]


@pytest.mark.parametrize("mode,k,cap", [("sync", 3, 4), ("async", 0, 4), ("async", 1, 8), ("async", 3, 16)])
def test_in_flight_cap_is_k_plus_one_batches(streams, mode, k, cap):
    spec = JobSpec(model_path="m", mode=mode, max_staleness=k, prompts_per_step=4, group_size=2)
    feeder = Feeder(streams, spec, _problems(10), RENDER)
    assert feeder.top_up(0, spec.staleness_bound) == cap
    assert feeder.top_up(0, spec.staleness_bound) == 0  # full: nothing more until groups are consumed
    for gid in list(feeder.in_flight)[:3]:
        feeder.done(gid)
    assert feeder.top_up(1, spec.staleness_bound) == 3
    if mode == "async" and k >= 1:  # a tighter bound (adaptive staleness) shrinks the cap
        assert feeder.top_up(1, bound=k - 1) == 0
    _, msgs = streams.read_broadcast(PROMPTS, "0", PromptGroup)
    assert len(msgs) == cap + 3
    assert len({m.group_id for m in msgs}) == cap + 3
    # ids are the ledger's idempotency keys: unique across every job sharing a database
    assert all(m.msg_id == m.group_id and m.msg_id.startswith("job1/") for m in msgs)
    assert [m.policy_version for m in msgs[-3:]] == [1, 1, 1]
    assert all(m.n == 2 and m.purpose == "train" for m in msgs)


def test_data_order_is_seeded_and_covers_every_problem_each_epoch(streams):
    spec = JobSpec(model_path="m", max_staleness=0, prompts_per_step=5, seed=7)
    a = Feeder(streams, spec, _problems(10), RENDER)
    b = Feeder(streams, spec, _problems(10), RENDER)
    seq_a = [a._next_problem().index for _ in range(20)]
    seq_b = [b._next_problem().index for _ in range(20)]
    assert seq_a == seq_b
    assert sorted(seq_a[:10]) == list(range(10)) and sorted(seq_a[10:]) == list(range(10))


def test_training_groups_are_seeded_by_the_job_seed_and_feed_order_alone(streams):
    spec = JobSpec.model_validate(
        {"model_path": "m", "max_staleness": 0, "prompts_per_step": 3, "seed": 7, "sampling": {"seeded": True}}
    )
    Feeder(streams, spec, _problems(10), RENDER).top_up(0, spec.staleness_bound)
    # another job (its own id, so its own group ids), the same seed: the same sampling seeds
    other = JobStreams(streams.r, "job2", prefix=streams.prefix)
    Feeder(other, spec, _problems(10), RENDER).top_up(0, spec.staleness_bound)
    _, first = streams.read_broadcast(PROMPTS, "0", PromptGroup)
    _, second = other.read_broadcast(PROMPTS, "0", PromptGroup)
    seeds = [m.sampling.seed for m in first]
    assert seeds == [group_seed(7, i) for i in range(3)] == [m.sampling.seed for m in second]
    assert len(set(seeds)) == 3 and all(0 <= s < 2**31 for s in seeds)
    assert group_seed(8, 0) != group_seed(7, 0)
    other.delete_all()
    unseeded = JobStreams(streams.r, "job3", prefix=streams.prefix)  # the default: the engine's generator
    Feeder(unseeded, spec.model_copy(update={"sampling": SamplingSpec()}), _problems(10), RENDER).top_up(0, 0)
    _, third = unseeded.read_broadcast(PROMPTS, "0", PromptGroup)
    assert [m.sampling.seed for m in third] == [None] * 3
    unseeded.delete_all()


def test_eval_round_is_greedy_single_samples_outside_the_cap(streams):
    spec = JobSpec(model_path="m", prompts_per_step=2, max_staleness=0)
    feeder = Feeder(streams, spec, _problems(5), RENDER)
    items = [EvalItem(prompt_index=p.index, prompt=p.prompt, answer=p.answer) for p in _problems(3)]
    rnd = feeder.feed_eval(4, 2, "held_out", items, 1, SamplingParams(temperature=0.0))
    _, (msg,) = streams.read_broadcast(PROMPTS, "0", EvalRound)  # the whole round is one entry
    groups = msg.groups()
    assert [m.group_id for m in groups] == [f"{rnd}/0", f"{rnd}/1", f"{rnd}/2"]
    assert {eval_round(m.group_id) for m in groups} == {rnd}
    assert all(
        m.purpose == "eval" and m.n == 1 and m.sampling.temperature == 0.0 and m.eval_set == "held_out" for m in groups
    )
    assert feeder.in_flight == set() and feeder.open_evals == {rnd: [2, "held_out"]}


def test_training_groups_carry_the_rendered_prompt_ids_metadata_and_stop_rules(streams):
    spec = JobSpec(
        model_path="m",
        prompts_per_step=1,
        max_staleness=0,
        group_size=2,
        sampling={"stop": ["\n"], "min_tokens": 1, "max_tokens": 6},
    )
    problems = [Problem(0, "12+3=", "15", metadata={"difficulty": 2, "tags": ["add"]})]
    Feeder(streams, spec, problems, RENDER).top_up(0, spec.staleness_bound)
    _, (msg,) = streams.read_broadcast(PROMPTS, "0", PromptGroup)
    tok = build_tokenizer()
    assert msg.prompt_array().tolist() == tok("12+3=")["input_ids"]  # what vLLM makes of the text, <s> first
    assert msg.metadata == {"difficulty": 2, "tags": ["add"]}
    assert (msg.sampling.stop, msg.sampling.min_tokens, msg.sampling.max_tokens) == (["\n"], 1, 6)


def _scored(group, i, size=2):
    r = Rollout(
        job_id="job1",
        msg_id=f"{group}/{i}",
        group_id=group,
        policy_version=3,
        policy_version_max=3,
        prompt_index=0,
        sample_index=i,
        group_size=size,
        generator_id="g",
        prompt_ids=pack_i32([1]),
        completion_ids=pack_i32([5]),
        logprobs=pack_f32([-0.1]),
        completion="2",
        answer="2",
    )
    return Scored(job_id="job1", msg_id=r.msg_id, group_id=group, policy_version=3, rollout=r, reward=1.0)


def test_assembler_completes_groups_and_ignores_duplicates():
    asm = GroupAssembler()
    assert asm.add("1-0", _scored("g0", 0)) is None
    assert asm.add("2-0", _scored("g0", 0)) is None  # redelivered duplicate: not a second sample
    g = asm.add("3-0", _scored("g0", 1))
    assert g is not None and g.complete and len(g.samples) == 2
    assert g.entries == ["1-0", "2-0", "3-0"]  # every copy is acked with the group
    assert g.gen_version_min == 3 and g.purpose == "train"
    assert asm.add("4-0", _scored("g0", 1)) is None  # a late duplicate of a finished group
    assert asm.strays == ["4-0"] and "g0" not in asm.open


@pytest.mark.hostile
def test_a_training_problem_the_tokenizer_refuses_fails_the_feeder_before_any_feed(streams, caplog):
    """Rendered at construction (before step 0), not when the feeder reaches the row: the error names
    the row; with task.bad_rows drop the row is left out, counted, and the rest feeds."""
    from shared.datasets import DatasetError

    bad = [*_problems(5), Problem(5, "\ud800=", "1", origin="d.jsonl line 6"), *_problems(9)[6:]]
    spec = JobSpec(model_path="m", prompts_per_step=2, group_size=2)
    with pytest.raises(DatasetError, match=r"^d.jsonl line 6: the tokenizer cannot encode it"):
        Feeder(streams, spec, bad, RENDER)
    assert streams.read_broadcast(PROMPTS, "0", PromptGroup)[1] == []  # nothing was fed
    drop = JobSpec.model_validate(
        {"model_path": "m", "prompts_per_step": 2, "group_size": 2, "task": {"bad_rows": "drop"}}
    )
    with caplog.at_level("WARNING", logger="shared.prompts"):
        feeder = Feeder(streams, drop, bad, RENDER)
    assert sorted(p.index for p in feeder.train) == [0, 1, 2, 3, 4, 6, 7, 8]
    assert "training: 1 problems dropped (task.bad_rows=drop), 8 kept; first: d.jsonl line 6" in caplog.text
    fed = [feeder._next_problem().index for _ in range(16)]
    assert 5 not in fed and sorted(fed[:8]) == [0, 1, 2, 3, 4, 6, 7, 8]
