"""shared.datasets: every file format, the field mapping, mixing, splits, caps, bad files, and the
arithmetic / gsm8k presets giving exactly what the loaders before them gave."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from shared.datasets import (
    FORMATS,
    PRESETS,
    TASKS,
    DatasetError,
    DatasetSource,
    TaskSpec,
    load_source,
    load_task,
)
from shared.tasks import Problem

# --- helpers -----------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def qa_rows(n: int, *, q: str = "q", a: str = "a") -> list[dict[str, Any]]:
    """Non-default column names plus metadata columns (an id, a difficulty, nested tests)."""
    return [
        {
            q: f"What is {i} squared?",
            a: i * i,
            "id": f"row-{i}",
            "difficulty": i % 3,
            "tests": [{"input": str(i), "output": str(i * i)}],
        }
        for i in range(n)
    ]


def spec(**kw: Any) -> TaskSpec:
    return TaskSpec(**kw)


QA = {"prompt_field": "q", "answer_field": "a"}


# --- formats -----------------------------------------------------------------------------------


def _write(fmt: str, path: Path, rows: list[dict[str, Any]]) -> Path:
    if fmt == "jsonl":
        return write_jsonl(path.with_suffix(".jsonl"), rows)
    if fmt == "json":
        out = path.with_suffix(".json")
        out.write_text(json.dumps(rows, indent=1))
        return out
    if fmt == "json_lines_in_json":  # Hugging Face's .json convention
        return write_jsonl(path.with_suffix(".json"), rows)
    import pyarrow as pa

    if fmt == "parquet":
        import pyarrow.parquet as pq

        out = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(rows), out)
        return out
    if fmt == "csv":
        import pyarrow.csv as pc

        out = path.with_suffix(".csv")
        flat = [{k: v for k, v in r.items() if k != "tests"} for r in rows]  # CSV has no nesting
        pc.write_csv(pa.Table.from_pylist(flat), out)
        return out
    import datasets

    out = path.with_suffix("")
    ds = datasets.Dataset.from_list(rows)
    if fmt == "save_to_disk":
        ds.save_to_disk(str(out))
    else:  # a DatasetDict folder
        datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(out))
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "json", "json_lines_in_json", "parquet", "csv", "save_to_disk", "dict"])
def test_every_format_maps_fields_and_passes_metadata(tmp_path: Path, fmt: str) -> None:
    path = _write(fmt, tmp_path / "data", qa_rows(6))
    source = DatasetSource(path=str(path), split="train" if fmt == "dict" else None)
    problems = load_source(source, spec(datasets=[source], **QA), seed=0)
    assert [p.index for p in problems] == list(range(6))
    assert [p.prompt for p in problems] == [f"What is {i} squared?" for i in range(6)]
    assert [p.answer for p in problems] == [str(i * i) for i in range(6)]  # numbers become text
    assert problems[4].metadata["id"] == "row-4" and problems[4].metadata["difficulty"] == 1
    if fmt != "csv":
        assert problems[4].metadata["tests"] == [{"input": "4", "output": "16"}]
    assert set(problems[4].metadata) == {"id", "difficulty"} | ({"tests"} if fmt != "csv" else set())
    assert all(p.messages is None and p.source == source.label for p in problems)
    json.dumps([dict(p.metadata) for p in problems])  # JSON-safe


def test_dataset_dict_split_is_chosen_and_checked(tmp_path: Path) -> None:
    path = _write("dict", tmp_path / "dd", qa_rows(6))
    test = load_source(DatasetSource(path=str(path), split="test"), spec(path=str(path), **QA), 0)
    assert len(test) == 2
    with pytest.raises(DatasetError, match="holds the splits train, test; choose one with split"):
        load_source(DatasetSource(path=str(path)), spec(path=str(path), **QA), 0)
    with pytest.raises(DatasetError, match="has no split 'dev'; its splits are: train, test"):
        load_source(DatasetSource(path=str(path), split="dev"), spec(path=str(path), **QA), 0)
    # A train/test pair from one DatasetDict folder.
    train, held = load_task(
        spec(datasets=[{"path": str(path), "split": "train"}], test=[{"path": str(path), "split": "test"}], **QA), 0
    )
    assert (len(train), len(held)) == (6, 2)


def test_metadata_is_plain_python(tmp_path: Path) -> None:
    import datetime
    import decimal

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "prompt": ["p0", "p1"],
            "answer": [1.5, 2.0],
            "when": [datetime.datetime(2024, 1, 2, 3, 4, 5), None],
            "price": pa.array([decimal.Decimal("1.25"), decimal.Decimal("2.50")], pa.decimal128(5, 2)),
            "score": [float("nan"), 0.5],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    a, b = load_source(DatasetSource(path=str(tmp_path / "t.parquet")), spec(path=str(tmp_path / "t.parquet")), 0)
    assert (a.answer, b.answer) == ("1.5", "2")
    assert a.metadata == {"when": "2024-01-02T03:04:05", "price": "1.25", "score": None}
    assert b.metadata == {"when": None, "price": "2.50", "score": 0.5}
    # numpy scalars and arrays in rows (an in-memory source) become plain Python too.
    from shared.datasets import _plain

    assert _plain({"n": np.int64(3), "x": np.float32(0.5), "v": np.arange(2), "t": (1, 2)}, "m") == {
        "n": 3,
        "x": 0.5,
        "v": [0, 1],
        "t": [1, 2],
    }
    assert type(_plain(np.int64(3), "m")) is int


# --- mapping -----------------------------------------------------------------------------------


def test_messages_field(tmp_path: Path) -> None:
    rows = [
        {"conv": [{"role": "user", "content": "hi"}], "answer": "1", "id": 0},
        {"conv": [{"role": "system", "content": "own"}, {"role": "user", "content": "2+2?"}], "answer": 4, "id": 1},
    ]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    a, b = load_source(DatasetSource(path=str(path)), spec(path=str(path), messages_field="conv"), 0)
    assert a.messages == ({"role": "user", "content": "hi"},) and a.prompt == "hi"
    assert b.prompt == "2+2?" and b.answer == "4" and b.metadata == {"id": 1}
    # system_prompt goes first, unless the row has its own system turn.
    a, b = load_source(
        DatasetSource(path=str(path)), spec(path=str(path), messages_field="conv", system_prompt="Be brief."), 0
    )
    assert a.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"})
    assert b.messages is not None and b.messages[0] == {"role": "system", "content": "own"} and len(b.messages) == 2


@pytest.mark.parametrize(
    ("conv", "match"),
    [
        ("hello", "must be a non-empty list"),
        ([{"role": "user"}], r"item 0: expected \{\"role\": str, \"content\": str\}"),
        ([{"role": "robot", "content": "x"}], "role 'robot' is not one of system, user, assistant"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "must end with a non-empty user turn",
        ),
    ],
)
def test_bad_messages_name_row_and_field(tmp_path: Path, conv: Any, match: str) -> None:
    good = {"conv": [{"role": "user", "content": "ok"}], "answer": "1"}
    path = write_jsonl(tmp_path / "m.jsonl", [good, {"conv": conv, "answer": "1"}])
    with pytest.raises(DatasetError, match=match) as e:
        load_source(DatasetSource(path=str(path)), spec(path=str(path), messages_field="conv"), 0)
    assert f"{path} line 2: field 'conv' (messages)" in str(e.value)


def test_system_prompt_and_template(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", qa_rows(3))
    task = spec(
        path=str(path),
        answer_field="a",
        prompt_template="Q{id!r}: {q}\nLevel {difficulty:02d}\nA:",
        system_prompt="You are a calculator.",
    )
    p = load_source(DatasetSource(path=str(path)), task, 0)[2]
    assert p.prompt == "Q'row-2': What is 2 squared?\nLevel 02\nA:"
    assert p.messages == ({"role": "system", "content": "You are a calculator."}, {"role": "user", "content": p.prompt})
    assert set(p.metadata) == {"tests"}  # the template's and the answer's columns are not repeated
    # Without a system prompt a plain-text task has no messages.
    assert (
        load_source(DatasetSource(path=str(path)), spec(path=str(path), answer_field="a", prompt_template="{q}"), 0)[
            0
        ].messages
        is None
    )


def test_template_missing_column_names_row(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "x", "answer": 1}, {"answer": 2}])
    with pytest.raises(
        DatasetError,
        match=r"line 2: field 'q' \(used by prompt_template\) is missing or null; the row's columns are: answer",
    ):
        load_task(spec(path=str(path), prompt_template="Q: {q}", n_test=1), 0)


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("Q: {question", "does not parse"),
        ("Q: }", "does not parse"),
        ("Q: {}", "positional field"),
        ("Q: {0}", "positional field"),
        ("Q: {q.__class__}", "attribute access"),
        ("Q: {q!z}", "conversion"),
        ("no fields", "names no column"),
    ],
)
def test_template_is_checked_at_spec_time(template: str, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        TaskSpec(path="d.jsonl", prompt_template=template)
    with pytest.raises(ValidationError, match=match):
        DatasetSource(path="d.jsonl", prompt_template=template)
    TaskSpec(path="d.jsonl", prompt_template="{q} {{literal}} {meta[level]}")


def test_answers(tmp_path: Path) -> None:
    rows = [{"prompt": "a", "answer": 42}, {"prompt": "b", "answer": 3.0}, {"prompt": "c", "answer": " x \n"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    got = load_source(DatasetSource(path=str(path)), spec(path=str(path)), 0)
    assert [p.answer for p in got] == ["42", "3", "x"]
    # answer_field: null means no reference answer; the column then stays in metadata.
    got = load_source(DatasetSource(path=str(path)), spec(path=str(path), answer_field=None), 0)
    assert [p.answer for p in got] == ["", "", ""] and got[0].metadata == {"answer": 42}


def test_per_dataset_field_overrides(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "answer": i} for i in range(4)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"problem": f"b{i}", "solution": i} for i in range(4)])
    task = spec(
        datasets=[
            {"path": str(a), "name": "A"},
            {"path": str(b), "name": "B", "prompt_field": "problem", "answer_field": "solution"},
        ],
        test=[{"path": str(b), "prompt_template": "Solve {problem}", "answer_field": "solution"}],
    )
    train, test = load_task(task, seed=0)
    assert sorted(p.prompt for p in train) == [*(f"a{i}" for i in range(4)), *(f"b{i}" for i in range(4))]
    assert {p.source for p in train} == {"A", "B"}
    assert test[0].prompt == "Solve b0" and test[0].answer == "0" and test[0].source == str(b)


# --- bad rows and files -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ('{"q": "x", "a": 1', r"line 3: not valid JSON"),
        ('{"a": 1, "id": 7}', r"line 3: field 'q' \(prompt\) is missing or null; the row's columns are: a, id"),
        ('{"q": ["x"], "a": 1}', r"line 3: field 'q' \(prompt\) must be a string, got list"),
        ('{"q": "  ", "a": 1}', r"line 3: field 'q' \(prompt\) is empty"),
        ('{"q": "x", "a": [1]}', r"line 3: field 'a' \(answer\) must be a string or a number, got list"),
        (
            '{"q": "x"}',
            r"line 3: field 'a' \(answer\) is missing or null; the row's columns are: q \(set answer_field to null",
        ),
        ('{"q": "x", "a": ""}', r"line 3: field 'a' \(answer\) is empty"),
        ('"just a string"', r"line 3: expected a JSON object, got str"),
    ],
)
def test_malformed_jsonl_names_file_line_and_field(tmp_path: Path, bad: str, match: str) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", [{"q": "ok", "a": 1}, "", bad])  # line 2 is blank
    with pytest.raises(DatasetError, match=match) as e:
        load_task(spec(path=str(path), n_test=1, **QA), 0)
    assert str(e.value).startswith(f"{path} line 3: ")


def test_mixed_type_column_reads(tmp_path: Path) -> None:
    """pyarrow rejects a column whose JSON type changes between rows; such files still load."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": "two"}])
    assert [p.answer for p in load_source(DatasetSource(path=str(path)), spec(path=str(path)), 0)] == ["1", "two"]


def test_malformed_rows_in_other_formats(tmp_path: Path) -> None:
    rows = [{"q": "ok", "a": 1}, {"q": None, "a": 2}]
    for fmt in ("json", "parquet", "csv"):
        path = _write(fmt, tmp_path / f"bad_{fmt}", rows)
        # (CSV has no null string: the empty cell reads as "".)
        with pytest.raises(DatasetError, match=rf"^{path} row 2: field 'q' \(prompt\) is (missing or null|empty)"):
            load_source(DatasetSource(path=str(path)), spec(path=str(path), **QA), 0)
    (tmp_path / "ragged.csv").write_text("q,a\nx,1\ny,2,3\n")
    with pytest.raises(DatasetError, match=r"ragged.csv: CSV parse error: Expected 2 columns, got 3: y,2,3"):
        load_source(DatasetSource(path=str(tmp_path / "ragged.csv")), spec(path="x.csv", **QA), 0)
    (tmp_path / "arr.json").write_text('[{"q": "x", "a": 1}, 5]')
    with pytest.raises(DatasetError, match=r"arr.json row 2: expected a JSON object, got int"):
        load_source(DatasetSource(path=str(tmp_path / "arr.json")), spec(path="x", **QA), 0)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="broken.parquet: not a readable Parquet file"):
        load_source(DatasetSource(path=str(tmp_path / "broken.parquet")), spec(path="x"), 0)


def test_binary_metadata_is_refused(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["p"], "answer": ["a"], "blob": [b"\x00\x01"]}), tmp_path / "b.parquet")
    with pytest.raises(DatasetError, match=r"b.parquet row 1: field 'blob' holds binary data"):
        load_source(DatasetSource(path=str(tmp_path / "b.parquet")), spec(path="x"), 0)


def test_fifo_is_rejected_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)

    def unblock() -> None:  # should the loader open the FIFO, give it a writer so the test ends
        with contextlib.suppress(OSError):  # ENXIO: nobody is reading, as it should be
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    guard = threading.Timer(2.0, unblock)
    guard.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(DatasetError, match=r"data.jsonl is a FIFO; give a regular file or a save_to_disk folder"):
            load_task(spec(path=str(fifo)), 0)
    finally:
        guard.cancel()
    assert time.monotonic() - t0 < 2.0


def test_paths_that_are_not_data(tmp_path: Path) -> None:
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(DatasetError, match="is a directory but not a `datasets` save_to_disk folder"):
        load_task(spec(path=str(tmp_path / "plain_dir")), 0)
    (tmp_path / "data.txt").write_text("x\n")
    with pytest.raises(DatasetError, match="set format to one of: " + ", ".join(FORMATS)):
        load_task(spec(path=str(tmp_path / "data.txt")), 0)
    # An explicit format reads any suffix.
    write_jsonl(tmp_path / "data.txt", [{"prompt": "p", "answer": 1}])
    assert (
        load_source(DatasetSource(path=str(tmp_path / "data.txt"), format="jsonl"), spec(path="x"), 0)[0].answer == "1"
    )
    with pytest.raises(DatasetError, match="split applies to save_to_disk folders"):
        load_source(DatasetSource(path=str(tmp_path / "data.txt"), format="jsonl", split="train"), spec(path="x"), 0)
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DatasetError, match="empty.jsonl has no rows"):
        load_task(spec(path=str(empty)), 0)


def test_relative_paths_resolve_against_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_jsonl(tmp_path / "rel.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(3)])
    monkeypatch.chdir(tmp_path)
    train, test = load_task(spec(path="rel.jsonl", n_test=1), 0)
    assert (len(train), len(test)) == (2, 1)
    with pytest.raises(
        DatasetError,
        match=rf"missing.jsonl does not exist \(relative paths resolve against the current directory: "
        rf"{tmp_path}/missing.jsonl\)",
    ):
        load_task(spec(path="missing.jsonl"), 0)


def test_size_and_row_caps(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(5)])
    size = path.stat().st_size
    with pytest.raises(DatasetError, match=rf"d.jsonl is 0.00 GiB \({size} bytes\), over task.max_bytes=10"):
        load_task(spec(path=str(path), max_bytes=10), 0)
    with pytest.raises(DatasetError, match="d.jsonl has more rows than task.max_rows=4"):  # counted as read
        load_task(spec(path=str(path), max_rows=4), 0)
    parquet = _write("parquet", tmp_path / "p", qa_rows(5))
    with pytest.raises(DatasetError, match="has 5 rows, over task.max_rows=4"):
        load_task(spec(path=str(parquet), max_rows=4, **QA), 0)
    folder = _write("save_to_disk", tmp_path / "saved", qa_rows(5))
    with pytest.raises(DatasetError, match="saved is .* over task.max_bytes=100"):
        load_task(spec(path=str(folder), max_bytes=100, **QA), 0)
    assert len(load_task(spec(path=str(path), max_rows=5, n_test=1), 0)[0]) == 4


# --- split, test sets, mixing -----------------------------------------------------------------


def test_n_train_defaults_to_every_row(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", qa_rows(500))
    train, test = load_task(spec(path=str(path), **QA), 0)
    assert (len(train), len(test)) == (400, 100)  # default n_test=100 split off, the rest trains
    assert [p.index for p in train] == list(range(400))


def test_seeded_split_is_disjoint_and_deterministic(tmp_path: Path) -> None:
    rows = qa_rows(50)
    path = write_jsonl(tmp_path / "d.jsonl", rows + rows[:10])  # repeated prompts
    for kw in ({"n_test": 10}, {"test_fraction": 0.2}):
        train, test = load_task(spec(path=str(path), **QA, **kw), seed=3)
        assert (len(train), len(test)) == (40, 10)
        assert not {p.prompt for p in train} & {p.prompt for p in test}
        assert len({p.prompt for p in train}) == 40  # a repeat never stays on both sides
        assert (train, test) == load_task(spec(path=str(path), **QA, **kw), seed=3)
        assert test != load_task(spec(path=str(path), **QA, **kw), seed=4)[1]
    with pytest.raises(DatasetError, match=r"n_test=100 \(the default n_test\) but .* has 50 usable problems"):
        load_task(spec(path=str(path), **QA), 0)


def test_split_over_several_datasets(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "answer": i} for i in range(30)])
    b = write_jsonl(
        tmp_path / "b.jsonl", [{"prompt": f"b{i}", "answer": i} for i in range(30)] + [{"prompt": "a0", "answer": 0}]
    )
    train, test = load_task(spec(datasets=[{"path": str(a)}, {"path": str(b)}], n_test=12), seed=1)
    assert len(test) == 12 and len(train) == 48  # 'a0' in b repeats a's row: counted once
    assert not {p.prompt for p in train} & {p.prompt for p in test}


def test_separate_test_file_defaults_to_all_its_rows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    train_path = write_jsonl(tmp_path / "train.jsonl", qa_rows(20))
    test_path = write_jsonl(tmp_path / "test.jsonl", qa_rows(1500, q="question", a="answer"))
    small = write_jsonl(tmp_path / "small.jsonl", qa_rows(7, q="question", a="answer"))
    test_src = {"prompt_field": "question", "answer_field": "answer"}
    train, test = load_task(spec(path=str(train_path), test=[{"path": str(small), **test_src}], **QA), 0)
    assert (len(train), len(test)) == (20, 7)
    assert [p.prompt for p in test] == [f"What is {i} squared?" for i in range(7)]  # file order
    with caplog.at_level(logging.WARNING, logger="shared.datasets"):
        _, test = load_task(spec(path=str(train_path), test=[{"path": str(test_path), **test_src}], **QA), 0)
    assert len(test) == 1000 and "evaluating the first 1000" in caplog.text
    _, test = load_task(spec(path=str(train_path), test=[{"path": str(test_path), **test_src}], n_test=1500, **QA), 0)
    assert len(test) == 1500
    with pytest.raises(DatasetError, match=r"n_test=8 but the test data \(.*small.jsonl\) has 7 usable problems"):
        load_task(spec(path=str(train_path), test=[{"path": str(small), **test_src}], n_test=8, **QA), 0)


def _sources(tmp_path: Path, sizes: dict[str, int]) -> list[dict[str, Any]]:
    out = []
    for name, n in sizes.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": f"{name}-{i}", "answer": i} for i in range(n)])
        out.append({"path": str(path), "name": name})
    return out


def test_no_weights_means_every_row(tmp_path: Path) -> None:
    sources = _sources(tmp_path, {"big": 90, "small": 10})
    train, _ = load_task(spec(datasets=sources, test=[sources[1]]), 0)
    assert collections.Counter(p.source for p in train) == {"big": 90, "small": 10}
    train, _ = load_task(spec(datasets=sources, test=[sources[1]], n_train=50), 0)
    assert collections.Counter(p.source for p in train) == {"big": 45, "small": 5}  # in proportion to size
    with pytest.raises(
        DatasetError, match="n_train=101 but the training data .* has 100 usable problems; .* give the datasets weights"
    ):
        load_task(spec(datasets=sources, test=[sources[1]], n_train=101), 0)


def test_mixing_weights(tmp_path: Path) -> None:
    sources = _sources(tmp_path, {"a": 500, "b": 300, "c": 40})
    weighted = [{**s, "weight": w} for s, w in zip(sources, (5.0, 3.0, 2.0), strict=True)]
    task = spec(datasets=weighted, test=[sources[2]], n_train=3000)
    train, _ = load_task(task, seed=11)
    counts = collections.Counter(p.source for p in train)
    assert counts == {"a": 1500, "b": 900, "c": 600}  # c (40 rows) is repeated to reach its share
    assert len({p.prompt for p in train if p.source == "c"}) == 40
    assert len({p.prompt for p in train if p.source == "a"}) == 500
    # Evenly interleaved: any stretch of the list, and the trainer's shuffled draws, keep the mix.
    for start in range(0, 3000, 250):
        window = collections.Counter(p.source for p in train[start : start + 100])
        assert abs(window["a"] - 50) <= 2 and abs(window["b"] - 30) <= 2 and abs(window["c"] - 20) <= 2
    import random

    draws = collections.Counter(p.source for p in random.Random(0).choices(train, k=20_000))
    assert abs(draws["a"] / 20_000 - 0.5) < 0.02 and abs(draws["c"] / 20_000 - 0.2) < 0.02
    # Deterministic for a seed, different across seeds; default n_train: the total row count.
    assert train == load_task(task, seed=11)[0]
    assert train != load_task(task, seed=12)[0]
    assert [p.index for p in train] == list(range(3000))
    assert len(load_task(spec(datasets=weighted, test=[sources[2]]), 0)[0]) == 840


def test_weights_all_or_none() -> None:
    with pytest.raises(ValidationError, match="give every dataset in task.datasets a weight, or none"):
        TaskSpec(datasets=[{"path": "a.jsonl", "weight": 1.0}, {"path": "b.jsonl"}])
    with pytest.raises(ValidationError, match="weight applies to training datasets"):
        TaskSpec(path="a.jsonl", test=[{"path": "b.jsonl", "weight": 1.0}])


# --- the spec ----------------------------------------------------------------------------------


def test_every_field_is_documented_and_constrained() -> None:
    for model in (TaskSpec, DatasetSource):
        undocumented = [n for n, f in model.model_fields.items() if not f.description]
        assert not undocumented, f"{model.__name__}: {undocumented}"
    assert set(TASKS) == set(PRESETS) == {"arithmetic", "gsm8k", "dataset", "reasoning_gym", "verifiers"}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"name": "arithmetic", "datasets": [{"path": "a.jsonl"}]}, "remove task.datasets"),
        ({"name": "arithmetic", "test_fraction": 0.1}, "remove task.test_fraction"),
        ({"name": "dataset"}, "task.path or task.datasets is required"),
        ({"path": "a", "datasets": [{"path": "b"}]}, "give task.path or task.datasets, not both"),
        ({"path": "a", "test_path": "b", "test": [{"path": "c"}]}, "give task.test_path or task.test"),
        ({"path": "a", "n_test": 5, "test_fraction": 0.1}, "give task.n_test or task.test_fraction"),
        ({"path": "a", "test_path": "b", "test_fraction": 0.1}, "use task.n_test to cut them"),
        ({"path": "a", "messages_field": "m", "prompt_template": "{x}"}, "remove prompt_template"),
        ({"path": "a", "messages_field": "m", "prompt_field": "x"}, "remove prompt_field"),
        (
            {"path": "a", "prompt_field": "q", "prompt_template": "{q}"},
            "give task.prompt_field or task.prompt_template",
        ),
        ({"path": "a", "format": "xml"}, "'verl' or 'trl'"),
        ({"path": "a", "format": "parquet"}, "a file format, which goes on a dataset"),
        ({"path": "a", "format": "verl", "messages_field": "m"}, "remove messages_field"),
        ({"format": "trl"}, "reads your own files"),
        ({"datasets": [{"path": "a", "format": "xml"}]}, "'jsonl', 'json', 'parquet', 'csv' or 'save_to_disk'"),
    ],
)
def test_spec_errors_say_what_to_fix(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        TaskSpec.model_validate(data)


def test_existing_specs_keep_their_meaning() -> None:
    assert TaskSpec().name == "arithmetic" and TaskSpec(n_train=64, n_test=8).name == "arithmetic"
    g = TaskSpec.model_validate(
        {"name": "gsm8k", "path": "/d/train.jsonl", "test_path": "/d/test.jsonl", "n_train": 7473, "n_test": 500}
    )
    assert [s.path for s in g.train_sources()] == ["/d/train.jsonl"]
    assert [s.path for s in g.test_sources()] == ["/d/test.jsonl"]
    assert TaskSpec(path="x.parquet").name == "dataset"  # files without a name: your own dataset
    again = TaskSpec.model_validate_json(g.model_dump_json())
    assert again == g


# --- presets: what the loaders before them gave -------------------------------------------------

# Captured from shared.tasks.load_task before it became a preset of this loader (the same rows,
# seeds and sizes): question numbers of train and test, and for arithmetic a sha256 of
# [[index, prompt, answer], ...] over train + test with the first prompts.
OLD = {
    "split0": [
        [7, 5, 10, 13, 14, 37, 22, 39, 23, 17, 8, 35, 3, 33, 9, 4, 36, 6, 28, 18, 11, 30, 19, 25, 31],
        [0, 27, 12, 21, 29, 15, 38, 34, 1, 20],
        ["26159", "18685", "37370"],
    ],
    "sep0": [
        [
            36,
            11,
            33,
            0,
            37,
            20,
            14,
            7,
            18,
            21,
            12,
            6,
            5,
            1,
            23,
            15,
            10,
            39,
            35,
            28,
            27,
            3,
            17,
            8,
            34,
            3,
            7,
            29,
            9,
            4,
            38,
            13,
            22,
            30,
            19,
            25,
            31,
            32,
            16,
            2,
            26,
            24,
        ],
        list(range(12)),
    ],
    "split7": [
        [39, 0, 28, 14, 38, 18, 22, 31, 27, 24, 17, 32, 7, 26, 37, 13, 2, 1, 33, 16, 29, 36, 23, 6, 34],
        [5, 35, 12, 19, 15, 10, 30, 21, 8, 11],
        ["145743", "0", "104636"],
    ],
    "sep7": [
        [
            14,
            5,
            22,
            7,
            3,
            16,
            10,
            15,
            11,
            35,
            37,
            24,
            8,
            0,
            19,
            36,
            12,
            21,
            39,
            33,
            18,
            30,
            27,
            17,
            26,
            7,
            29,
            28,
            31,
            2,
            1,
            13,
            32,
            38,
            23,
            6,
            34,
            4,
            3,
            25,
            9,
            20,
        ],
        list(range(12)),
    ],
    "arith0": [
        "de9f8faf6682850a8cea83797f1629c2c0d82cbbde962d987dff0239c07c24d5",
        ["9+17=", "19+8=", "10+15="],
        ["6+1=", "11+4=", "11+8="],
    ],
    "arith3": [
        "1e424ccc701f4caf87b20dcf41f86536f7c3bb2f7931d9a8f0dc3a13bac444d8",
        ["6+1=", "15+3=", "13+18="],
        ["3+8=", "9+7=", "2+9="],
    ],
    "arith11": [
        "d2db0a3eeb04e573892690dab8bc5074b236bdd2daafe7bf459beb6eb30582e7",
        ["11+11=", "14+6=", "19+19="],
        ["16+2=", "15+14=", "4+15="],
    ],
}


def _gsm8k_rows(n: int) -> list[dict[str, str]]:
    return [
        {
            "question": f" Q{i}: Tom has {i * 37} apples. How many? ",
            "answer": f"He has {i * 37}.\n#### {i * 37 * 101:,}",
        }
        for i in range(n)
    ]


def _numbers(problems: list[Problem]) -> list[int]:
    return [int(p.prompt.split(":")[0][1:]) for p in problems]


@pytest.mark.parametrize("seed", [0, 7])
def test_gsm8k_preset_gives_the_old_output(tmp_path: Path, seed: int) -> None:
    rows = _gsm8k_rows(40)
    train_path = write_jsonl(tmp_path / "train.jsonl", rows + [rows[3], rows[7]])
    test_path = write_jsonl(tmp_path / "test.jsonl", _gsm8k_rows(12))
    train, test = load_task(TaskSpec(name="gsm8k", n_train=25, n_test=10, path=str(train_path)), seed)
    assert [_numbers(train), _numbers(test), [p.answer for p in train[:3]]] == OLD[f"split{seed}"]
    assert train[0].prompt == train[0].prompt.strip() and train[0].metadata == {}
    train, test = load_task(
        TaskSpec(name="gsm8k", n_train=42, n_test=12, path=str(train_path), test_path=str(test_path)), seed
    )
    assert [_numbers(train), _numbers(test)] == OLD[f"sep{seed}"]


@pytest.mark.parametrize(("seed", "n_train", "n_test"), [(0, 300, 100), (3, 50, 20), (11, 10, 4)])
def test_arithmetic_preset_gives_the_old_output(seed: int, n_train: int, n_test: int) -> None:
    train, test = load_task(TaskSpec(n_train=n_train, n_test=n_test), seed)
    digest = hashlib.sha256(json.dumps([[p.index, p.prompt, p.answer] for p in train + test]).encode()).hexdigest()
    assert [digest, [p.prompt for p in train[:3]], [p.prompt for p in test[:3]]] == OLD[f"arith{seed}"]
    assert all(p.source == "arithmetic" and p.metadata == {} and p.messages is None for p in train + test)


def test_arithmetic_defaults_and_mapping() -> None:
    train, test = load_task(TaskSpec(), seed=0)
    assert (len(train), len(test)) == (300, 100)
    # Generated rows take the same mapping as a file's: a template and a system prompt apply.
    train, _ = load_task(TaskSpec(prompt_template="Compute {prompt}", system_prompt="Digits only."), seed=0)
    assert train[0].prompt == "Compute 9+17="
    assert train[0].messages == (
        {"role": "system", "content": "Digits only."},
        {"role": "user", "content": "Compute 9+17="},
    )
    with pytest.raises(ValueError, match="exceeds the 400 distinct problems"):
        load_task(TaskSpec(n_train=350), seed=0)


def test_problems_stay_hashable() -> None:
    p = Problem(0, "p", "a", metadata={"k": [1]}, messages=({"role": "user", "content": "p"},))
    assert hash(p) == hash(Problem(0, "p", "a"))


def test_light_import() -> None:
    code = (
        "import sys, shared.jobspec, shared.datasets, shared.tasks; "
        "bad = {'datasets', 'pandas', 'pyarrow', 'torch'} & set(sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- bad rows and bounds (issue 31): rejected at load naming the row, or dropped and counted ---------

GOOD = [json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) for i in range(8)]


def _bad_lines(kind: str) -> bytes:
    """A JSON Lines row of one bad kind (line 4 of the file `_with_bad_row` writes)."""
    return {
        "lone_surrogate": b'{"prompt": "\\ud800=", "answer": 1}',
        "lone_surrogate_answer": b'{"prompt": "x", "answer": "\\udfff"}',
        "surrogate_in_metadata": b'{"prompt": "x", "answer": 1, "note": {"k": ["\\ud83d"]}}',
        "not_utf8": b'{"prompt": "\xff\xfe", "answer": 1}',
        "deep_nesting": b'{"prompt": "x", "answer": 1, "m": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # past recursion
        "nesting_over_32": b'{"prompt": "x", "answer": 1, "m": ' + b"[" * 40 + b"]" * 40 + b"}",
        "huge_line": b'{"prompt": "' + b"x" * (1 << 16) + b'", "answer": 1}',
        "wide_row": json.dumps({"prompt": "x", "answer": 1, **{f"c{i}": i for i in range(50)}}).encode(),
        "huge_integer": b'{"prompt": "x", "answer": ' + b"9" * 5000 + b"}",
    }[kind]


BAD_KINDS = {
    "lone_surrogate": r"field 'prompt': a lone surrogate \(\\ud800 at character 1\) is not valid Unicode text",
    "lone_surrogate_answer": r"field 'answer' \(answer\): a lone surrogate \(\\udfff",
    "surrogate_in_metadata": r"field 'note': a lone surrogate \(\\ud83d",
    "not_utf8": r"not UTF-8 \(invalid start byte at byte 13 of the line\)",
    "deep_nesting": r"JSON nested too deeply to parse \(a row may nest 32 levels\)",
    "nesting_over_32": r"field 'm' is nested deeper than 32 levels",
    "huge_line": r"longer than task.max_row_bytes=32768 \(skipped unread\)",
    "wide_row": r"has 52 fields, over task.max_columns=20",
    "huge_integer": r"not readable as JSON \(Exceeds the limit \(4300 digits\)",
}
LIMITS = {"max_row_bytes": 32768, "max_columns": 20}


def _with_bad_row(path: Path, bad: bytes) -> Path:
    path.write_bytes(b"\n".join([*(g.encode() for g in GOOD[:3]), bad, *(g.encode() for g in GOOD[3:])]) + b"\n")
    return path


@pytest.mark.hostile
@pytest.mark.parametrize("kind", sorted(BAD_KINDS))
def test_a_bad_row_fails_the_load_naming_it_or_is_dropped_and_counted(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = _with_bad_row(tmp_path / "d.jsonl", _bad_lines(kind))
    with pytest.raises(DatasetError, match=rf"^{path} line 4: {BAD_KINDS[kind]}") as e:
        load_task(spec(path=str(path), n_test=1, **LIMITS), 0)
    assert "task.bad_rows=drop" in str(e.value)  # says how to go on without it
    with caplog.at_level(logging.WARNING, logger="shared.datasets"):
        train, test = load_task(spec(path=str(path), n_test=1, bad_rows="drop", **LIMITS), 0)
    assert len(train) + len(test) == len(GOOD)
    assert f"{path}: 1 bad rows dropped (task.bad_rows=drop), {len(GOOD)} kept; first: {path} line 4:" in caplog.text
    assert all(p.origin.startswith(f"{path} line ") for p in train + test)  # every problem knows its row


@pytest.mark.hostile
def test_a_json_array_streams_and_names_its_bad_rows(tmp_path: Path) -> None:
    rows = [g.encode() for g in GOOD]
    arr = tmp_path / "a.json"
    # a lone surrogate, bytes that are not UTF-8 and a non-object: bad rows; the rest reads
    arr.write_bytes(b"[\n" + b",\n".join([*rows, b'{"prompt": "\\ud800"}', b'{"prompt": "\xff"}', b"5"]) + b"\n]\n")
    with pytest.raises(DatasetError, match=r"a.json row 9: field 'prompt': a lone surrogate"):
        load_task(spec(path=str(arr), n_test=1), 0)
    assert len(load_source(DatasetSource(path=str(arr)), spec(path=str(arr), bad_rows="drop"), 0)) == len(GOOD)
    arr.write_bytes(b"[" + b",".join(rows) + b', {"prompt": "' + b"x" * 9000 + b'"}]')  # read whole: a bad row
    with pytest.raises(DatasetError, match=r"a.json row 9: longer than task.max_row_bytes=4096 characters"):
        load_source(DatasetSource(path=str(arr)), spec(path=str(arr), max_row_bytes=4096), 0)
    for content, match in [
        (b"[" + b",".join(rows) + b"," + b"[" * 100_000 + b"]" * 100_000 + b"]", r"row 9: JSON nested too deeply"),
        (b"[" + b",".join(rows) + b', {"prompt": "' + b"x" * (3 << 20) + b"]", r"row 9: longer than task.max_row"),
        (b"[" + b",".join(rows) + b"] trailing", r"data after the array's closing"),
        (b"[" + b",".join(rows) + b" {}]", r"row 8: expected ',' or ']' after it"),
        (b"[" + b",".join(rows), r"row 8: the array never ends"),
    ]:
        arr.write_bytes(content)
        with pytest.raises(DatasetError, match=match):  # the array cannot be followed past these: any bad_rows
            load_source(DatasetSource(path=str(arr)), spec(path=str(arr), bad_rows="drop", max_row_bytes=4096), 0)


@pytest.mark.hostile
def test_wide_long_and_not_utf8_csv(tmp_path: Path) -> None:
    wide = tmp_path / "wide.csv"
    wide.write_text(",".join(["prompt", "answer", *(f"c{i}" for i in range(30))]) + "\n" + "1+1=,2" + ",0" * 30 + "\n")
    with pytest.raises(DatasetError, match=r"wide.csv has 32 columns, over task.max_columns=20; drop the columns"):
        load_task(spec(path=str(wide), max_columns=20), 0)
    long = tmp_path / "long.csv"
    long.write_text("prompt,answer\n" + "".join(f"{i}+1=,{i + 1}\n" for i in range(5)) + "x" * 5000 + ",1\n")
    with pytest.raises(DatasetError, match=r"long.csv line 7 is longer than task.max_row_bytes=4096"):
        load_task(spec(path=str(long), max_row_bytes=4096, bad_rows="drop"), 0)
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"prompt,answer\n" + b"".join(f"{i}+1=,{i + 1}\n".encode() for i in range(5)) + b"caf\xe9,1\n")
    with pytest.raises(
        DatasetError, match=r"latin.csv row 6: field 'prompt': the byte 0xe9 at character 4 is not UTF-8"
    ):
        load_task(spec(path=str(latin), n_test=1), 0)
    assert len(load_source(DatasetSource(path=str(latin)), spec(path=str(latin), bad_rows="drop"), 0)) == 5


@pytest.mark.hostile
def test_parquet_and_saved_folders_are_bounded_before_their_rows_are_read(tmp_path: Path) -> None:
    wide = [{"prompt": "p", "answer": 1, **{f"c{i}": i for i in range(30)}} for _ in range(3)]
    for fmt in ("parquet", "save_to_disk"):
        path = _write(fmt, tmp_path / f"wide_{fmt}", wide)
        with pytest.raises(DatasetError, match=r"has 32 columns, over task.max_columns=20"):
            load_source(DatasetSource(path=str(path)), spec(path=str(path), max_columns=20), 0)


@pytest.mark.hostile
def test_prompt_templates_cannot_build_huge_prompts(tmp_path: Path) -> None:
    for template, match in [
        ("{q:>99999}", "widths and precisions are at most 1000"),
        ("{q:{w}}", "a format spec may not hold a field"),
    ]:
        with pytest.raises(ValidationError, match=match):
            spec(path="d.jsonl", prompt_template=template)
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "x" * 300, "a": 1}, {"q": "y", "a": 2}, {"q": "z", "a": 3}])
    repeat = spec(path=str(path), prompt_template="{q}" * 20, answer_field="a", max_row_bytes=4096, n_test=1)
    with pytest.raises(DatasetError, match=r"d.jsonl line 1: prompt_template would build a prompt of over"):
        load_task(repeat, 0)
    assert len(load_task(repeat.model_copy(update={"bad_rows": "drop"}), 0)[0]) == 1


def test_every_row_dropped_is_an_error_naming_one(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "\\ud800", "answer": 1}'] * 3)
    with pytest.raises(DatasetError, match=r"d.jsonl: every row is bad \(3 dropped\), e.g. .*d.jsonl line 1: "):
        load_task(spec(path=str(path), bad_rows="drop"), 0)
