"""shared.tasks: arithmetic generation, the GSM8K preset of shared.datasets, answer extraction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from shared.datasets import TASKS, DatasetSource, TaskSpec, load_source, load_task
from shared.tasks import Problem, extract_answer, gsm8k_final_answer, synthetic_arithmetic

# --- arithmetic -----------------------------------------------------------------------------


def test_arithmetic_is_deterministic_by_seed() -> None:
    assert synthetic_arithmetic(3, 50, 20) == synthetic_arithmetic(3, 50, 20)
    assert synthetic_arithmetic(3, 50, 20) != synthetic_arithmetic(4, 50, 20)


@pytest.mark.parametrize("ops", ["+", "+-", "+-*"])
def test_arithmetic_splits_are_disjoint_and_correct(ops: str) -> None:
    train, test = synthetic_arithmetic(0, 70, 30, max_operand=9, ops=ops)
    assert (len(train), len(test)) == (70, 30)
    assert [p.index for p in train] == list(range(70))
    assert [p.index for p in test] == list(range(30))
    prompts = [p.prompt for p in train + test]
    assert len(set(prompts)) == len(prompts), "a problem appears twice"
    for p in train + test:
        assert p.prompt.endswith("=")
        expr = p.prompt[:-1]
        assert any(op in expr for op in ops)
        assert p.answer == str(eval(expr))  # noqa: S307 - digits and one operator


def test_arithmetic_can_use_the_whole_pool() -> None:
    train, test = synthetic_arithmetic(0, 3, 1, max_operand=1, ops="+")
    assert sorted(p.prompt for p in train + test) == ["0+0=", "0+1=", "1+0=", "1+1="]


def test_arithmetic_negative_answers() -> None:
    train, _ = synthetic_arithmetic(0, 100, 0, max_operand=9, ops="-")
    assert any(p.answer.startswith("-") for p in train)


def test_arithmetic_defaults_fit_the_warm_start_split() -> None:
    train, test = synthetic_arithmetic(0, 300, 100)
    assert len({p.prompt for p in train} | {p.prompt for p in test}) == 400


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_train": 300, "n_test": 101}, "exceeds the 400 distinct problems"),
        ({"n_train": 1, "n_test": 1, "ops": "/"}, "ops must be"),
        ({"n_train": 1, "n_test": 1, "ops": "++"}, "ops must be"),
        ({"n_train": 1, "n_test": 1, "ops": ""}, "ops must be"),
        ({"n_train": -1, "n_test": 1}, "must be >= 0"),
        ({"n_train": 1, "n_test": 1, "max_operand": -1}, "max_operand"),
    ],
)
def test_arithmetic_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        synthetic_arithmetic(0, **kwargs)


# --- GSM8K ----------------------------------------------------------------------------------


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _gsm8k_rows(n: int) -> list[dict[str, str]]:
    return [{"question": f"Tom has {i} apples. How many?", "answer": f"He has {i}.\n#### {i}"} for i in range(n)]


def load_gsm8k_file(path: Path) -> list[Problem]:
    """Every row of a GSM8K-format file through the gsm8k preset, in file order."""
    return load_source(DatasetSource(path=str(path)), TaskSpec(name="gsm8k", path=str(path)), seed=0)


def test_gsm8k_parses_final_answer(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "g.jsonl",
        [
            {"question": " Q1? ", "answer": "3 * 24 = <<3*24=72>>72\n#### 72"},
            "",  # blank lines are skipped
            {"question": "Q2?", "answer": "#### 1 #### 1,234 "},
            {"question": "Q3?", "answer": "so\n#### -5"},
        ],
    )
    assert load_gsm8k_file(path) == [
        Problem(index=0, prompt="Q1?", answer="72", source=str(path)),
        Problem(index=1, prompt="Q2?", answer="1234", source=str(path)),
        Problem(index=2, prompt="Q3?", answer="-5", source=str(path)),
    ]


def test_gsm8k_final_answer() -> None:
    assert gsm8k_final_answer("so\n#### 1,234 ") == "1234"
    with pytest.raises(ValueError, match="'####'"):
        gsm8k_final_answer("72")


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ('{"question": "Q", "answer": "#### 1"', "not valid JSON"),
        ('["Q", "#### 1"]', "expected a JSON object"),
        ('{"answer": "#### 1"}', "'question'"),
        ('{"question": "Q", "answer": "72"}', "'####'"),
        ('{"question": "Q", "answer": "x ####  "}', "nothing after"),
    ],
)
def test_gsm8k_malformed_line_names_line_number(tmp_path: Path, bad: str, match: str) -> None:
    path = _write_jsonl(tmp_path / "g.jsonl", [*_gsm8k_rows(2), bad])
    with pytest.raises(ValueError, match=match) as e:
        load_gsm8k_file(path)
    assert f"{path} line 3:" in str(e.value)


def test_gsm8k_split_from_one_file(tmp_path: Path) -> None:
    rows = _gsm8k_rows(20)
    path = _write_jsonl(tmp_path / "g.jsonl", [*rows, rows[0]])  # a repeated question

    def gsm8k(seed: int, n_train: int) -> tuple[list[Problem], list[Problem]]:
        return load_task(TaskSpec(name="gsm8k", n_train=n_train, n_test=5, path=str(path)), seed)

    train, test = gsm8k(1, 15)
    assert (len(train), len(test)) == (15, 5)
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert [p.index for p in test] == list(range(5))
    assert (train, test) == gsm8k(1, 15)
    assert (train, test) != gsm8k(2, 15)
    with pytest.raises(ValueError, match="n_train=16"):
        gsm8k(1, 16)


def test_gsm8k_separate_test_file(tmp_path: Path) -> None:
    train_path = _write_jsonl(tmp_path / "train.jsonl", _gsm8k_rows(10))
    test_path = _write_jsonl(tmp_path / "test.jsonl", _gsm8k_rows(4))
    spec = TaskSpec(name="gsm8k", n_train=10, n_test=3, path=str(train_path), test_path=str(test_path))
    train, test = load_task(spec, seed=0)
    assert sorted(p.answer for p in train) == sorted(str(i) for i in range(10))
    assert [p.answer for p in test] == ["0", "1", "2"]


def test_load_task_errors(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="'arithmetic', 'gsm8k', 'dataset', 'reasoning_gym' or 'verifiers'"):
        TaskSpec(name="gsm9k")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="task.path is required"):
        TaskSpec(name="gsm8k")
    with pytest.raises(ValidationError, match="generated from the seed: remove task.path"):
        TaskSpec(name="arithmetic", path="x.jsonl")
    assert set(TASKS) == {"arithmetic", "gsm8k", "dataset", "reasoning_gym", "verifiers"}


def test_load_task_arithmetic_matches_generator() -> None:
    train, test = load_task(TaskSpec(name="arithmetic", n_train=10, n_test=4), seed=5)
    old_train, old_test = synthetic_arithmetic(5, 10, 4)
    assert [(p.index, p.prompt, p.answer) for p in train] == [(p.index, p.prompt, p.answer) for p in old_train]
    assert [(p.index, p.prompt, p.answer) for p in test] == [(p.index, p.prompt, p.answer) for p in old_test]
    assert all(p.source == "arithmetic" and p.metadata == {} and p.messages is None for p in train + test)


# --- extract_answer -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", "42"),
        ("= 42", "42"),
        ("-7", "-7"),
        ("= -7", "-7"),
        ("3-7", "7"),  # a minus between digits is an operator, not a sign
        ("17+25=42", "42"),
        ("The answer is 1,234.", "1234"),
        ("about 3.50 dollars", "3.5"),
        ("12.0", "12"),
        ("-0", "0"),
        ("first 1 then 2", "2"),
        ("007", "007"),
        ("x", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_shared_tasks_imports_without_heavy_deps() -> None:
    code = "import sys, shared.tasks; bad = {'torch', 'vllm', 'transformers'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)
