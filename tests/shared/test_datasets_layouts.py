"""verl's and TRL's data layouts read with no mapping (task.format), and dotted paths into nested
columns wherever a field is named, with errors that name the path, the part missing and the row.
The fixtures are laid out as verl's preprocessing (examples/data_preprocess/gsm8k.py) and TRL's
GRPO datasets lay them out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shared.datasets import DatasetError, TaskSpec, load_source, load_task

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def verl_row(i: int, answer: Any = None) -> dict[str, Any]:
    """One row as verl's gsm8k preprocessing writes it."""
    q = f"{i}+1="
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1) if answer is None else answer},
        "extra_info": {"split": "train", "index": i, "answer": f"#### {i + 1}", "question": q},
    }


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_verl_parquet_reads_with_no_mapping_and_the_whole_row_reaches_the_reward(tmp_path):
    data = write_parquet(tmp_path / "train.parquet", [verl_row(i) for i in range(6)])
    spec = TaskSpec.model_validate({"format": "verl", "path": str(data), "n_test": 2})
    train, test = load_task(spec, 0)
    assert len(train) == 4 and len(test) == 2
    (p,) = [p for p in train + test if p.metadata["extra_info"]["index"] == 3]
    assert p.prompt == f"3+1= {INSTRUCTION}"
    assert p.messages == ({"role": "user", "content": f"3+1= {INSTRUCTION}"},)
    assert p.answer == "4"  # reward_model.ground_truth
    assert p.metadata == verl_row(3)  # every column, the prompt included, as verl's reward sees the row


def test_trl_conversational_and_standard_layouts(tmp_path):
    conv = write_jsonl(
        tmp_path / "conv.jsonl",
        [{"prompt": [{"role": "user", "content": f"{i}+2="}], "solution": str(i + 2), "level": i} for i in range(4)],
    )
    std = write_jsonl(tmp_path / "std.jsonl", [{"prompt": f"{i}*2=", "answer": i * 2} for i in range(4)])
    none = write_jsonl(tmp_path / "none.jsonl", [{"prompt": "say hi"}])
    spec = TaskSpec.model_validate({"format": "trl", "path": str(conv)})
    rows = load_source(spec.train_sources()[0], spec, 0)
    assert [(p.prompt, p.answer, p.messages) for p in rows[:2]] == [
        ("0+2=", "2", ({"role": "user", "content": "0+2="},)),
        ("1+2=", "3", ({"role": "user", "content": "1+2="},)),
    ]
    assert rows[1].metadata == {"prompt": [{"role": "user", "content": "1+2="}], "solution": "3", "level": 1}
    spec = TaskSpec.model_validate({"format": "trl", "path": str(std)})
    (_, p, *_) = load_source(spec.train_sources()[0], spec, 0)
    assert (p.prompt, p.answer, p.messages, p.metadata) == ("1*2=", "2", None, {"prompt": "1*2=", "answer": 2})
    spec = TaskSpec.model_validate({"format": "trl", "path": str(none)})
    assert load_source(spec.train_sources()[0], spec, 0)[0].answer == ""  # no answer column: none needed


def test_dotted_paths_name_nested_fields(tmp_path):
    data = write_parquet(tmp_path / "d.parquet", [verl_row(i) for i in range(3)])
    spec = TaskSpec.model_validate(
        {"path": str(data), "prompt_field": "extra_info.question", "answer_field": "reward_model.ground_truth"}
    )
    p = load_source(spec.train_sources()[0], spec, 0)[2]
    assert (p.prompt, p.answer) == ("2+1=", "3")
    assert set(p.metadata) == set(verl_row(0))  # a dotted path uses no whole column: they all stay
    lists = write_jsonl(tmp_path / "l.jsonl", [{"q": "a", "answers": ["x", "y"]}])
    spec = TaskSpec.model_validate({"path": str(lists), "prompt_field": "q", "answer_field": "answers.1"})
    assert load_source(spec.train_sources()[0], spec, 0)[0].answer == "y"
    dotted = write_jsonl(tmp_path / "c.jsonl", [{"q.text": "a", "answer": "b"}])  # a column named with a dot
    spec = TaskSpec.model_validate({"path": str(dotted), "prompt_field": "q.text"})
    assert load_source(spec.train_sources()[0], spec, 0)[0].prompt == "a"


@pytest.mark.parametrize(
    "row,field,message",
    [
        (
            {**verl_row(1), "reward_model": {"style": "rule"}},
            "reward_model.ground_truth",
            "line 2: field 'reward_model.ground_truth' (answer) is missing or null: 'reward_model' has no "
            "'ground_truth'; its keys are: style",
        ),
        (
            {k: v for k, v in verl_row(1).items() if k != "reward_model"},
            "reward_model.ground_truth",
            "line 2: field 'reward_model.ground_truth' (answer) is missing or null: the row has no 'reward_model'",
        ),
        (
            {**verl_row(1), "reward_model": "5"},
            "reward_model.ground_truth",
            "line 2: field 'reward_model.ground_truth' (answer) is missing or null: 'reward_model' has no "
            "'ground_truth'; it is a str, not an object",
        ),
        (
            {**verl_row(1)},
            "extra_info.answer.0",
            "line 1: field 'extra_info.answer.0' (answer) is missing or null: "
            "'extra_info.answer' has no '0'; it is a str, not an object",
        ),
    ],
)
def test_a_missing_part_of_a_path_names_the_path_the_part_and_the_row(tmp_path, row, field, message):
    data = write_jsonl(tmp_path / "d.jsonl", [verl_row(0), row])
    spec = TaskSpec.model_validate({"path": str(data), "messages_field": "prompt", "answer_field": field})
    with pytest.raises(DatasetError) as e:
        load_source(spec.train_sources()[0], spec, 0)
    assert f"d.jsonl {message}" in str(e.value), str(e.value)


def test_verl_layout_rows_missing_the_answer_fail_naming_the_row(tmp_path):
    data = write_parquet(tmp_path / "t.parquet", [verl_row(0), {**verl_row(1), "reward_model": {"style": "rule"}}])
    spec = TaskSpec.model_validate({"format": "verl", "path": str(data)})
    with pytest.raises(DatasetError, match=r"t.parquet row 2: field 'reward_model.ground_truth' \(answer\)"):
        load_source(spec.train_sources()[0], spec, 0)
