"""reasoning-gym datasets by name (shared/gym.py): the rows a task builds, the seeds its splits come
from, the dataset's own score_answer as the reward, and the errors a spec gets (reasoning-gym 0.1.25,
pinned in the `gym` extra: the questions below are what its generators draw for these seeds)."""

from __future__ import annotations

import json
import sys

import pytest
from pydantic import ValidationError

from shared.datasets import DatasetError, TaskSpec, load_task
from shared.gym import COLUMN, GymError, gym_rows, held_out_seed, score_completion
from shared.jobspec import JobSpec, format_validation_error
from shared.rewards import build_scorer
from shared.rewards.base import RewardInput

pytest.importorskip("reasoning_gym")

ONE_WORD = {"min_words": 1, "max_words": 1}
ONE_DIGIT_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def task(**extra: object) -> TaskSpec:
    return TaskSpec.model_validate({"name": "reasoning_gym", "dataset": "letter_counting", **extra})


def spec_errors(spec: dict) -> list[dict]:
    with pytest.raises(ValidationError) as exc:
        JobSpec.model_validate(spec)
    return format_validation_error(exc.value)


def test_a_task_by_name_builds_prompts_answers_and_the_entry_for_the_reward():
    train, test = load_task(task(config=ONE_WORD, size=4, n_test=2), seed=0)
    # the letter in each word counted by hand: phrase has one a, hundred one h, constitution one c,
    # free one f; held out: the has one e, Verne two
    assert [(p.prompt, p.answer) for p in train] == [
        ('How many times does the letter "a" appear in the text: "phrase"?', "1"),
        ('How many times does the letter "h" appear in the text: "hundred"?', "1"),
        ('How many times does the letter "c" appear in the text: "constitution"?', "1"),
        ('How many times does the letter "f" appear in the text: "free"?', "1"),
    ]
    assert [(p.prompt, p.answer) for p in test] == [
        ('How many times does the letter "e" appear in the text: "the"?', "1"),
        ('How many times does the letter "e" appear in the text: "Verne"?', "2"),
    ]
    p = train[3]
    info = p.metadata[COLUMN]
    assert info["dataset"] == "letter_counting" and info["config"] == ONE_WORD
    assert info["entry"]["question"] == p.prompt and info["entry"]["answer"] == "1"
    assert p.metadata["metadata"]["target_letter"] == "f" and p.metadata["metadata"]["span"] == ["free"]
    json.dumps(dict(p.metadata), allow_nan=False)  # JSON all the way down: it crosses the wire as msgpack
    assert load_task(task(config=ONE_WORD, size=4, n_test=2), seed=0) == (train, test)  # the same for a seed
    assert load_task(task(config=ONE_WORD, size=4, n_test=2), seed=1)[0] != train


def test_held_out_entries_come_from_the_seeds_after_the_training_ones():
    import reasoning_gym

    assert held_out_seed(7, 100) == 107
    train, test = gym_rows("letter_counting", ONE_WORD, seed=0, size=4, n_test=2)
    # entry i of a dataset is drawn from Random(seed + i): held-out entry 0 is the training
    # generator's entry 4, one past the last training entry
    beyond = reasoning_gym.create_dataset("letter_counting", **ONE_WORD, seed=0, size=6)
    assert [r["question"] for r in train] == [beyond[i]["question"] for i in range(4)]
    assert test[0]["question"] == beyond[4]["question"]


def test_a_small_pool_holds_out_only_new_prompts_or_says_it_is_too_small():
    # one-digit a+b / a-b: at most 2 * 10 * 10 = 200 questions, so 300 training draws repeat many
    # and the held-out draws often hit training prompts: those are skipped
    train, test = load_task(
        TaskSpec.model_validate(
            {"name": "reasoning_gym", "dataset": "chain_sum", "config": ONE_DIGIT_SUMS, "size": 300, "n_test": 20}
        ),
        seed=0,
    )
    seen = {p.prompt for p in train}
    assert len(seen) < 200 and len(test) == 20
    assert not seen & {p.prompt for p in test} and len({p.prompt for p in test}) == 20
    with pytest.raises(GymError, match="pool is too small"):
        gym_rows("chain_sum", ONE_DIGIT_SUMS, seed=0, size=2000, n_test=100)


def test_the_reward_is_the_datasets_own_score_answer():
    train, _ = load_task(task(config=ONE_WORD, size=4, n_test=2), seed=0)
    free = train[3].metadata  # "free": one f
    assert score_completion("1", free) == 1.0
    assert score_completion("<answer> 1 </answer>", free) == 1.0  # reasoning-gym's answer tags
    assert score_completion("I think 2 then <answer>1</answer>", free) == 1.0  # the last tag counts
    assert score_completion("2", free) == 0.0
    # letter_counting keeps reasoning-gym's default score_answer: the oracle inside a longer answer
    # earns len(oracle) / len(answer) = 1/4 for "1 or"
    assert score_completion("1 or", free) == pytest.approx(0.25)
    sums, _ = gym_rows("chain_sum", ONE_DIGIT_SUMS, seed=0, size=2, n_test=1)
    assert sums[0]["question"].endswith("0 - 4 =") and sums[0]["answer"] == "-4"
    meta = {k: v for k, v in sums[0].items() if k not in ("question", "answer")}
    assert score_completion("-4", meta) == 1.0 and score_completion("4", meta) == 0.0


def test_the_built_in_reward_scores_through_the_reward_scorer_and_is_the_tasks_default():
    spec = JobSpec.model_validate(
        {"model_path": "/m", "task": {"name": "reasoning_gym", "dataset": "letter_counting", "config": ONE_WORD}}
    )
    assert spec.reward == "reasoning_gym"
    kept = JobSpec.model_validate(
        {"model_path": "/m", "reward": "exact_match", "task": {"name": "reasoning_gym", "dataset": "letter_counting"}}
    )
    assert kept.reward == "exact_match"
    train, _ = load_task(task(config=ONE_WORD, size=4, n_test=2), seed=0)
    p = train[1]  # "hundred": one h
    with build_scorer(spec.reward) as scorer:
        got = scorer.score_sync(
            [RewardInput(prompt=p.prompt, completion=c, answer=p.answer, metadata=p.metadata) for c in ("1", "3")]
            + [RewardInput(prompt="1+1=", completion="2", answer="2", metadata={"level": 1})]
        )
    assert [r.reward for r in got[:2]] == [1.0, 0.0] and all(r.ok for r in got[:2])
    assert got[2].status == "error" and "metadata['reasoning_gym']" in got[2].reason


def test_a_generator_without_reference_answers_needs_answer_field_null():
    with pytest.raises(DatasetError, match="set answer_field to null"):
        load_task(TaskSpec.model_validate({"name": "reasoning_gym", "dataset": "graph_color", "size": 2}), seed=0)
    train, _ = load_task(
        TaskSpec.model_validate(
            {"name": "reasoning_gym", "dataset": "graph_color", "size": 2, "n_test": 1, "answer_field": None}
        ),
        seed=0,
    )
    assert train[0].answer == "" and train[0].metadata[COLUMN]["entry"]["answer"] is None


def test_a_dataset_whose_scoring_does_not_survive_json_is_refused():
    # arc_agi's metadata holds tuples: after JSON they are lists, and its score_answer then gives
    # its own answer 0.05 instead of 1.0
    with pytest.raises(GymError, match="through JSON"):
        gym_rows("arc_agi", {}, seed=0, size=1, n_test=1)


@pytest.mark.parametrize(
    ("task_section", "field", "says"),
    [
        ({"dataset": "letter_countin"}, "task", "no dataset 'letter_countin'; e.g. letter_counting"),
        ({"dataset": "letter_counting", "config": {"min_word": 1}}, "task", "no config key 'min_word'; its keys are"),
        ({"dataset": "letter_counting", "config": {"min_words": 0}}, "task", "min_words must be positive"),
        ({"dataset": "letter_counting", "config": {"seed": 3}}, "task", "job's seed and task.size decide them"),
        ({"dataset": "letter_counting", "n_train": 10}, "task", "task.size sets the training problems"),
        ({"dataset": "letter_counting", "path": "x.jsonl"}, "task", "remove task.path"),
        ({}, "task", "task.dataset is required"),
        ({"dataset": "letter_counting", "config": {"x-y": 1}}, "task.config", "not a Python identifier"),
    ],
)
def test_a_spec_the_library_refuses_is_a_422_saying_what_to_fix(task_section, field, says):
    errors = spec_errors({"model_path": "/m", "task": {"name": "reasoning_gym", **task_section}})
    assert any(e["field"] == field and says in e["message"] for e in errors), errors


def test_gym_fields_on_another_task_are_refused():
    errors = spec_errors({"model_path": "/m", "task": {"name": "arithmetic", "dataset": "letter_counting"}})
    assert "apply to task.name='reasoning_gym' only" in errors[0]["message"]


def test_without_the_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what `import reasoning_gym` meets when absent
    # a config no earlier test validated (a valid one is remembered per process)
    task_section = {"name": "reasoning_gym", "dataset": "letter_counting", "config": {"min_words": 2, "max_words": 7}}
    errors = spec_errors({"model_path": "/m", "task": task_section})
    assert "pip install 'asyncrl[gym]'" in errors[0]["message"], errors
    with pytest.raises(GymError, match=r"pip install 'asyncrl\[gym\]'"):
        score_completion("1", {COLUMN: {"dataset": "letter_counting", "config": {"max_words": 3}, "entry": {}}})
