"""Datasets: the job spec's task section and the one loader that turns it into problems.

A task is a preset of one loader (``PRESETS``, chosen by ``task.name``):

- ``dataset``: the user's own local files (JSONL, JSON, Parquet, CSV, or a folder written by
  ``datasets``' ``save_to_disk``), one or several, mixed by weight;
- ``gsm8k``: the same, with GSM8K's columns (``question``; ``answer`` ending ``#### <number>``,
  whose final number becomes the reference answer);
- ``arithmetic``: synthetic ``"a+b="`` rows generated from the seed (``shared.tasks``), fed
  through the same field mapping, split and mixing;
- ``reasoning_gym`` and ``verifiers``: another library's tasks by name (``shared.gym``,
  ``shared.vfenv``), their rows fed through the same mapping.

Every row goes through one mapping (``prompt_field`` or ``prompt_template``, or a
``messages_field``; ``answer_field``; the other columns become ``Problem.metadata``; a field may be
a dotted path into nested columns, ``reward_model.ground_truth``), or reads another framework's
layout with no mapping (``task.format``: ``verl``, ``trl``; the whole row becomes the metadata),
then one split (a separate test set, or a seeded disjoint split of the training rows) and one mixture.

Readers, each streaming with bounded memory (``max_columns`` checked before the rows are read,
``max_rows`` as they are read, ``max_row_bytes`` per line or element, nesting at most ``MAX_DEPTH``):
the standard library's ``json`` line by line for JSON Lines (a bad line is one bad row, named by
its line) and element by element for JSON arrays; pyarrow for CSV (block by block) and Parquet
(batch by batch, after its footer's counts); ``datasets``' ``load_from_disk`` for saved folders
(memory-mapped, batch by batch). Only problems are kept. pyarrow and ``datasets`` are imported
inside the readers: this module imports with pydantic alone, so the API validates specs without
them.

Every row is checked at load, before the job trains: what cannot make a problem (a missing
field, text that is not UTF-8 or holds a lone surrogate, too deep, too long, too wide) is a bad
row, which fails the load naming the file and the row, or is dropped and counted
(``task.bad_rows``).
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import datetime
import decimal
import json
import logging
import math
import os
import random
import re
import stat
import string
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal

from pydantic import Field, field_validator, model_validator

from shared.spectypes import PrintableStr, SpecModel
from shared.tasks import Problem, gsm8k_final_answer, synthetic_arithmetic

__all__ = [
    "FORMATS",
    "LAYOUTS",
    "PRESETS",
    "TASKS",
    "DatasetError",
    "DatasetSource",
    "TaskSpec",
    "load_source",
    "load_task",
]

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_MAX_BYTES = 2 * GiB
# Memory grows with the rows kept (about 0.6 KiB each as problems, plus their text): 1M rows stay
# under 1 GiB (docs/reliability.md, the dataset probes).
DEFAULT_MAX_ROWS = 1_000_000
DEFAULT_MAX_COLUMNS = 1000
DEFAULT_MAX_ROW_BYTES = 4 * MiB
MAX_DEPTH = 32
"""Deepest nesting of a row's values (lists and objects in its columns)."""
MAX_FORMAT_WIDTH = 1000
"""Largest width or precision in a prompt_template's format spec ({x:>10})."""
_SURROGATE = re.compile("[\ud800-\udfff]")
BadRows = Literal["reject", "drop"]
# Held-out size when it is split off the training rows and neither n_test nor test_fraction is set.
DEFAULT_SPLIT_N_TEST = 100
# A separate test set is used whole up to this many rows: every evaluation round generates one
# greedy completion per held-out problem, so a 50k-row test file would make each round a job.
DEFAULT_MAX_TEST = 1000
# The arithmetic pool is generated (400 problems with the default operands), not read.
ARITHMETIC_N_TRAIN = 300
ARITHMETIC_N_TEST = 100
# reasoning-gym's own default dataset size.
GYM_SIZE = 500

Format = Literal["jsonl", "json", "parquet", "csv", "save_to_disk"]
Layout = Literal["verl", "trl"]
LAYOUTS: tuple[str, ...] = ("verl", "trl")
# TRL's reward functions read the reference answer from a dataset column by name; these are the
# names its GRPO documentation and the datasets it uses hold it under, in the order looked for.
TRL_ANSWER_COLUMNS = ("answer", "solution")
FORMATS: tuple[str, ...] = ("jsonl", "json", "parquet", "csv", "save_to_disk")
_SUFFIXES = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
}
# Files that `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write at the top of the folder.
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
ROLES = ("system", "user", "assistant")


class DatasetError(ValueError):
    """A dataset cannot be read or mapped; the message names the file, the row and the field."""


class _Strict(SpecModel):
    """Unknown fields rejected, numbers finite, strings bounded (shared.spectypes)."""


def template_fields(template: str) -> list[str]:
    """The columns a ``str.format`` prompt template reads (``"Q: {question}"`` -> ``["question"]``).

    Raises:
        ValueError: the template does not parse, uses a positional or attribute field, an unknown
            conversion, or no column at all.
    """
    fields: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(
            f"prompt_template does not parse as a str.format template ({e}); write a literal brace as '{{{{' or '}}}}'"
        ) from None
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if spec and "{" in spec:
            raise ValueError(f"prompt_template field {{{name}:{spec}}}: a format spec may not hold a field")
        if spec and any(int(d) > MAX_FORMAT_WIDTH for d in re.findall(r"\d+", spec)):
            raise ValueError(
                f"prompt_template field {{{name}:{spec}}}: widths and precisions are at most {MAX_FORMAT_WIDTH}"
            )
        top = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not top or top.isdigit():
            raise ValueError(f"prompt_template uses a positional field {{{name}}}; name a column, e.g. {{question}}")
        if "." in name:
            raise ValueError(
                f"prompt_template field {{{name}}} uses attribute access; name a column "
                "(indexing like {meta[level]} is fine)"
            )
        if conversion not in (None, "r", "s", "a"):
            raise ValueError(f"prompt_template field {{{name}!{conversion}}}: conversion must be !r, !s or !a")
        fields.append(top)
    if not fields:
        raise ValueError("prompt_template names no column; e.g. 'Q: {question}\\nA:'")
    return fields


def _template_padding(template: str) -> int:
    """An upper bound of the characters the template's format specs add (widths, precisions)."""
    return sum(
        max((int(d) for d in re.findall(r"\d+", spec)), default=0)
        for _literal, name, spec, _conversion in string.Formatter().parse(template)
        if name is not None and spec
    )


class DatasetSource(_Strict):
    """One local dataset: a file or a saved folder, with its share of the training mixture."""

    path: PrintableStr = Field(
        ...,
        min_length=1,
        max_length=4096,
        description="Local file (.jsonl, .json, .parquet, .csv) or a folder written by `datasets`' "
        "save_to_disk. A relative path resolves against the current directory of the process that "
        "loads it (the trainer's or the evaluator's), not against the spec file.",
    )
    format: Format | None = Field(
        None,
        description=f"One of {', '.join(FORMATS)}; None infers it from the file's suffix, or "
        "`save_to_disk` for a folder holding dataset_info.json, state.json or dataset_dict.json.",
    )
    split: PrintableStr | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="The split of a DatasetDict folder to read (e.g. 'train'); may be left out "
        "when the folder holds a single split. Only for save_to_disk folders.",
    )
    weight: float | None = Field(
        None,
        gt=0.0,
        le=1e6,
        description="Relative share of the training list (training datasets only). Give every "
        "training dataset a weight or none: with none, each contributes all its rows; with "
        "weights, n_train rows are split in proportion and a dataset smaller than its share is "
        "repeated.",
    )
    name: PrintableStr | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="Label in Problem.source and logs; defaults to the path (with ':split').",
    )
    prompt_field: PrintableStr | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="This dataset's prompt column; None: the task's prompt_field.",
    )
    answer_field: PrintableStr | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="This dataset's answer column; None: the task's answer_field.",
    )
    prompt_template: str | None = Field(
        None,
        min_length=1,
        max_length=100_000,
        description="This dataset's prompt template (str.format over its columns); None: the task's.",
    )

    @field_validator("prompt_template")
    @classmethod
    def _template_parses(cls, v: str | None) -> str | None:
        if v is not None:
            template_fields(v)
        return v

    @property
    def label(self) -> str:
        """The dataset's name: ``name``, else the path (with ``:split``)."""
        if self.name:
            return self.name
        return f"{self.path}:{self.split}" if self.split else self.path


# Generated rows (arithmetic) have no dataset of their own, hence no per-dataset overrides.
_NO_OVERRIDES = DatasetSource(path="(generated)")


class TaskSpec(_Strict):
    """Where prompts and reference answers come from (the job spec's ``task`` section)."""

    name: Literal["arithmetic", "gsm8k", "dataset", "reasoning_gym", "verifiers"] = Field(
        "arithmetic",
        description="Preset: `dataset` (your own files), `gsm8k` (GSM8K-format files: question, "
        "answer ending '#### <number>'), `arithmetic` (synthetic a+b=, generated from the seed), "
        "`reasoning_gym` (a reasoning-gym dataset by name, generated from the seed: task.dataset, "
        "task.config, task.size; pip install 'asyncrl[gym]') or `verifiers` (an installed verifiers "
        "environment by module name: task.env, task.args; pip install 'asyncrl[verifiers]'). "
        "Left out: `dataset` when files are given, else `arithmetic`.",
    )
    format: Layout | None = Field(
        None,
        description="Another framework's data layout, read with no field mapping: `verl` (verl's "
        "preprocessed parquet: `prompt` a list of chat messages, the answer at "
        "`reward_model.ground_truth`, `data_source`, `ability`, `extra_info` beside them) or `trl` "
        "(TRL's GRPO datasets: `prompt` chat messages (conversational) or text (standard), the "
        "answer in `answer` or `solution` when the row has one). Every column of the row, the prompt "
        "included, reaches the reward as its metadata, as those frameworks hand the row to theirs. "
        "None: the fields below map the columns. answer_field may still be set (a dotted path too).",
    )
    dataset: PrintableStr | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="reasoning_gym: the dataset's registered name, e.g. 'letter_counting' (shared/gym.py).",
    )
    config: dict[Annotated[str, Field(max_length=200)], Any] = Field(
        default_factory=dict,
        max_length=64,
        description="reasoning_gym: the dataset's config (its dataclass's fields but seed and size), "
        'e.g. {"min_words": 1, "max_words": 2}; checked by the dataset itself when the job is submitted.',
    )
    size: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="reasoning_gym: training problems, generated from the job's seed (default "
        f"{GYM_SIZE}); the held-out problems (n_test) come from the seeds after them.",
    )
    env: PrintableStr | None = Field(
        None,
        min_length=1,
        max_length=200,
        pattern=r"^(?:[A-Za-z0-9_.-]+/)?[A-Za-z_][A-Za-z0-9_.-]*(?:@[A-Za-z0-9_.+-]+)?$",
        description="verifiers: the installed environment's module name (the package exporting its "
        "vf.Taskset, e.g. 'vf_reverse_text'; a hub id 'owner/name@version' names the module 'name', "
        "dashes as underscores, as verifiers resolves it; shared/vfenv.py). The module is imported where "
        "the job is validated and run: only packages installed there can be named.",
    )
    args: dict[Annotated[str, Field(max_length=200)], Any] = Field(
        default_factory=dict,
        max_length=64,
        description="verifiers: the taskset's config (its TasksetConfig fields), e.g. "
        '{"num_tasks": 500}; checked by the environment itself when the job is submitted.',
    )
    eval_args: dict[Annotated[str, Field(max_length=200)], Any] | None = Field(
        None,
        max_length=64,
        description='verifiers: the held-out taskset\'s config (e.g. {"split": "test"}); None: n_test '
        "tasks held out of the training ones (a seeded split, disjoint by prompt).",
    )
    path: PrintableStr | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="Shorthand for datasets=[{path}]: one local training file or saved folder "
        "(relative paths resolve against the loading process's current directory).",
    )
    test_path: PrintableStr | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="Shorthand for test=[{path}]: a held-out file; else a seeded split of the training rows.",
    )
    datasets: list[DatasetSource] = Field(
        default_factory=list,
        max_length=64,
        description="Training datasets, mixed by their weights (see DatasetSource.weight).",
    )
    test: list[DatasetSource] = Field(
        default_factory=list,
        max_length=64,
        description="Held-out datasets, concatenated in order; none: a seeded split of the "
        "training rows (n_test or test_fraction), disjoint by prompt.",
    )
    prompt_field: PrintableStr | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="Column holding the prompt text, or a dotted path into a nested column "
        "('extra_info.question'); None: the preset's ('question' for gsm8k, else 'prompt'). Not with "
        "prompt_template or messages_field.",
    )
    answer_field: PrintableStr | None = Field(
        "answer",
        min_length=1,
        max_length=200,
        description="Column holding the reference answer (numbers become strings), or a dotted path "
        "into a nested column ('reward_model.ground_truth'; a list item by its index: 'answers.0'); "
        "null: no reference answer (Problem.answer is ''), for rewards that need none.",
    )
    messages_field: PrintableStr | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="Column (or dotted path) holding chat messages (a list of {role, content}, "
        "ending with a user turn) instead of a prompt column.",
    )
    system_prompt: str | None = Field(
        None,
        min_length=1,
        max_length=100_000,
        description="System turn put before each problem's user turn (Problem.messages); a row "
        "whose messages already start with a system turn keeps its own.",
    )
    prompt_template: str | None = Field(
        None,
        min_length=1,
        max_length=100_000,
        description="Python str.format template over the row's columns building the user text, "
        "e.g. 'Q: {question}\\nA:' (literal braces doubled). Replaces prompt_field.",
    )
    n_train: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Training problems; None: every training row (arithmetic: 300, drawn from its generated pool).",
    )
    n_test: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description=f"Held-out problems; None: {DEFAULT_SPLIT_N_TEST} split off the training rows, "
        f"or the first {DEFAULT_MAX_TEST} rows of the test datasets (a warning says when it cuts).",
    )
    test_fraction: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="Share of the (deduplicated) training rows held out, instead of n_test; only "
        "when no test datasets are given.",
    )
    max_bytes: int = Field(
        DEFAULT_MAX_BYTES,
        ge=1,
        le=1 << 40,
        description="Largest file or saved folder read, in bytes (default 2 GiB), checked before opening.",
    )
    max_rows: int = Field(
        DEFAULT_MAX_ROWS,
        ge=1,
        le=1_000_000_000,
        description="Most rows read from one file or folder (default 1M, about 1 GiB of memory as problems; "
        "counted as they are read).",
    )
    max_columns: int = Field(
        DEFAULT_MAX_COLUMNS,
        ge=1,
        le=1_000_000,
        description="Most columns of one file or folder (CSV header, Parquet schema, saved table), and most "
        "fields of one JSON row; checked before the rows are read (default 1000).",
    )
    max_row_bytes: int = Field(
        DEFAULT_MAX_ROW_BYTES,
        ge=1,
        le=GiB,
        description="Longest row: a JSON Lines or CSV line in bytes, a JSON array element in characters, "
        "and the prompt a prompt_template builds (default 4 MiB). A longer JSON Lines line is skipped "
        "unread (a bad row); in CSV or a JSON array it fails the load.",
    )
    bad_rows: BadRows = Field(
        "reject",
        description="A row that cannot be used: a field missing, empty or of the wrong type; text that is "
        "not UTF-8 or holds a lone surrogate; JSON that does not parse or nests deeper than 32 levels; "
        "a line over max_row_bytes; more fields than max_columns; a prompt the tokenizer or the chat "
        "template refuses. `reject` fails the job at load (before step 0) naming the file and the row; "
        "`drop` leaves such rows out and the trainer's log counts them per file, with the first "
        "reasons. A file that cannot be read at all fails the job either way.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "name" not in data:
            has_files = any(data.get(k) for k in ("path", "test_path", "datasets", "test"))
            data = {**data, "name": "dataset" if has_files else "arithmetic"}
        if isinstance(data, dict) and data.get("name") == "verifiers" and "answer_field" not in data:
            # the rubric reads the task's own data; 'verifiers.task.answer' names a task's answer
            data = {**data, "answer_field": None}
        return data

    @field_validator("prompt_template")
    @classmethod
    def _template_parses(cls, v: str | None) -> str | None:
        if v is not None:
            template_fields(v)
        return v

    @field_validator("format", mode="before")
    @classmethod
    def _layout_not_file_format(cls, v: Any) -> Any:
        if v in FORMATS:
            raise ValueError(
                f"task.format is a framework's data layout ({', '.join(LAYOUTS)}); {v!r} is a file format, "
                f"which goes on a dataset: datasets: [{{path: ..., format: {v!r}}}] (or leave it out: the "
                "suffix tells it)"
            )
        return v

    @field_validator("config", "args", "eval_args")
    @classmethod
    def _config_is_json(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        from shared.rewards.spec import check_kwargs  # pydantic only; the same bounds as a plug-in's kwargs

        return None if v is None else check_kwargs(v)

    @model_validator(mode="after")
    def _consistent(self) -> TaskSpec:
        self._gym_fields()
        self._verifiers_fields()
        if self.format is not None:
            if self.name != "dataset":
                raise ValueError(
                    f"task.format={self.format!r} reads your own files (task.name 'dataset'); the "
                    f"{self.name!r} preset has columns of its own: remove task.format or task.name"
                )
            mapped = self._text_prompt_fields(("prompt_field", "prompt_template", "messages_field"))
            if mapped:
                raise ValueError(
                    f"task.format={self.format!r} reads the prompt from the layout's 'prompt' column: remove "
                    f"{', '.join(mapped)} (or leave task.format out and map the columns yourself)"
                )
        if self.name == "arithmetic":
            given = [k for k in ("path", "test_path", "datasets", "test", "test_fraction") if getattr(self, k)]
            if given:
                raise ValueError(
                    f"task.name='arithmetic' is generated from the seed: remove task.{', task.'.join(given)} "
                    "(or set task.name='dataset' to read files)"
                )
        elif self.name not in ("reasoning_gym", "verifiers") and not (self.path or self.datasets):
            if self.name == "gsm8k":
                raise ValueError(
                    "task.path is required for task.name='gsm8k': give a local GSM8K-format JSONL "
                    "file (or list files in task.datasets)"
                )
            raise ValueError("task.path or task.datasets is required for task.name='dataset': give local files")
        if self.path and self.datasets:
            raise ValueError("give task.path or task.datasets, not both (path is a shorthand for one dataset)")
        if self.test_path and self.test:
            raise ValueError("give task.test_path or task.test, not both (test_path is a shorthand for one dataset)")
        if self.n_test is not None and self.test_fraction is not None:
            raise ValueError("give task.n_test or task.test_fraction, not both")
        if self.test_fraction is not None and (self.test_path or self.test):
            raise ValueError(
                "task.test_fraction splits the training rows, but test datasets are given; use task.n_test to cut them"
            )
        weighted = [d.weight is not None for d in self.datasets]
        if any(weighted) and not all(weighted):
            raise ValueError(
                "give every dataset in task.datasets a weight, or none (each then contributes all its rows)"
            )
        if any(d.weight is not None for d in self.test):
            raise ValueError("weight applies to training datasets; remove it from task.test")
        if self.messages_field is not None:
            text_fields = self._text_prompt_fields(("prompt_field", "prompt_template"))
            if text_fields:
                raise ValueError(
                    f"task.messages_field reads the prompt from chat messages: remove {', '.join(text_fields)}"
                )
        if self.prompt_field is not None and self.prompt_template is not None:
            raise ValueError(
                "give task.prompt_field or task.prompt_template, not both (the template names its columns)"
            )
        return self

    def _text_prompt_fields(self, own: tuple[str, ...]) -> list[str]:
        """The fields among `own` set on the task, and each dataset's prompt_field and
        prompt_template that are set (named with the dataset)."""
        fields = [k for k in own if getattr(self, k) is not None]
        return fields + [
            f"{k} of {d.label}"
            for d in [*self.datasets, *self.test]
            for k in ("prompt_field", "prompt_template")
            if getattr(d, k) is not None
        ]

    def _gym_fields(self) -> None:
        """dataset, config and size belong to reasoning_gym, which reads no files; its dataset and
        config are checked by reasoning-gym itself (shared.gym.check_config)."""
        gym_only = [k for k in ("dataset", "config", "size") if getattr(self, k)]
        if self.name != "reasoning_gym":
            if gym_only:
                raise ValueError(
                    f"task.{', task.'.join(gym_only)} apply to task.name='reasoning_gym' only; remove them "
                    f"or set task.name='reasoning_gym'"
                )
            return
        given = [
            k
            for k in ("path", "test_path", "datasets", "test", "test_fraction", "n_train", "messages_field")
            if getattr(self, k)
        ]
        if given:
            hint = " (task.size sets the training problems)" if "n_train" in given else ""
            raise ValueError(
                f"task.name='reasoning_gym' generates its problems from the seed: remove task.{', task.'.join(given)}"
                + hint
            )
        if self.dataset is None:
            raise ValueError(
                "task.dataset is required for task.name='reasoning_gym': a reasoning-gym dataset name, "
                "e.g. 'letter_counting'"
            )
        from shared.gym import check_config  # imports reasoning-gym: only for a job that names it

        check_config(self.dataset, self.config)

    def _verifiers_fields(self) -> None:
        """env, args and eval_args belong to verifiers, which reads no files; the environment is
        loaded and checked by shared.vfenv.check."""
        own = [k for k in ("env", "args", "eval_args") if getattr(self, k)]
        if self.name != "verifiers":
            if own:
                raise ValueError(
                    f"task.{', task.'.join(own)} apply to task.name='verifiers' only; remove them "
                    "or set task.name='verifiers'"
                )
            return
        given = [
            k
            for k in ("path", "test_path", "datasets", "test", "messages_field", "prompt_field", "prompt_template")
            if getattr(self, k)
        ]
        if given:
            raise ValueError(
                "task.name='verifiers' takes its prompts from the environment's tasks: remove "
                f"task.{', task.'.join(given)}"
            )
        if self.env is None:
            raise ValueError(
                "task.env is required for task.name='verifiers': the installed environment's module name, "
                "e.g. 'vf_reverse_text'"
            )
        if self.eval_args is not None and self.test_fraction is not None:
            raise ValueError("task.eval_args gives the held-out tasks; task.test_fraction splits the training ones")
        from shared.vfenv import check  # imports verifiers: only for a job that names it

        check(self.env, self.args)
        if self.eval_args is not None:
            check(self.env, self.eval_args)

    def train_sources(self) -> list[DatasetSource]:
        """The training datasets (``path`` expanded)."""
        return [DatasetSource(path=self.path)] if self.path else list(self.datasets)

    def test_sources(self) -> list[DatasetSource]:
        """The held-out datasets (``test_path`` expanded); empty: split the training rows."""
        return [DatasetSource(path=self.test_path)] if self.test_path else list(self.test)


# --- reading ---------------------------------------------------------------------------------


class _RowError(Exception):
    """A row-level problem; the caller prefixes the file and row."""


Row = dict[str, Any]
ReadRow = tuple[str, "Row | _RowError"]
"""Where a row is ("data.jsonl line 17"), and the row, or why it cannot be read (task.bad_rows decides)."""

_CHUNK = 1 << 20  # bytes read at a time where a file is scanned
_BATCH = 1024  # rows turned into Python objects at a time
_SPACE = " \t\n\r"


@dataclass
class _Table:
    """One dataset's rows, read lazily as ``ReadRow`` pairs. A file that cannot be read at all
    raises DatasetError while its rows are iterated (still at load, before any training step)."""

    name: str
    rows: Iterable[ReadRow]
    source: DatasetSource | None = None  # None for generated rows
    presampled: bool = False  # generated already in a seeded random order: not reshuffled


def _check_size(label: str, size: int, spec: TaskSpec) -> None:
    if size > spec.max_bytes:
        raise DatasetError(
            f"{label} is {size / GiB:.2f} GiB ({size} bytes), over task.max_bytes={spec.max_bytes}; "
            "raise task.max_bytes or split the data"
        )


def _check_count(label: str, n: int, spec: TaskSpec) -> None:
    """A row count known before reading (Parquet's footer, a saved folder's table)."""
    if n > spec.max_rows:
        raise DatasetError(
            f"{label} has {n} rows, over task.max_rows={spec.max_rows}; raise task.max_rows or cut the file"
        )


def _check_columns(label: str, n: int, spec: TaskSpec) -> None:
    if n > spec.max_columns:
        raise DatasetError(
            f"{label} has {n} columns, over task.max_columns={spec.max_columns}; drop the columns the job "
            "does not need (every column other than the prompt and answer becomes the rows' metadata), "
            "or raise task.max_columns"
        )


def _capped(label: str, spec: TaskSpec, rows: Iterable[ReadRow]) -> Iterator[ReadRow]:
    """``rows``, refused once they pass task.max_rows (counted as they are read, so a file of
    millions of rows is refused before they are all in memory) or when there are none."""
    n = 0
    for item in rows:
        n += 1
        if n > spec.max_rows:
            raise DatasetError(
                f"{label} has more rows than task.max_rows={spec.max_rows}; raise task.max_rows or cut the file"
            )
        yield item
    if n == 0:
        raise DatasetError(f"{label} has no rows")


def _stat(path: Path, label: str) -> os.stat_result:
    try:
        return os.stat(path)  # stat never opens: a FIFO or device is rejected before any read
    except FileNotFoundError:
        where = (
            "" if path.is_absolute() else f" (relative paths resolve against the current directory: {path.absolute()})"
        )
        raise DatasetError(f"{label} does not exist{where}") from None
    except OSError as e:
        raise DatasetError(f"{label} cannot be read: {e.strerror}") from None


def _kind(mode: int) -> str:
    for test, what in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def _open_table(source: DatasetSource, spec: TaskSpec) -> _Table:
    """Check, then open one dataset. Regular files and saved folders only, within the caps."""
    path, label = Path(source.path), source.path
    st = _stat(path, label)
    fmt: str | None = source.format
    if stat.S_ISDIR(st.st_mode):
        if fmt not in (None, "save_to_disk"):
            raise DatasetError(f"{label} is a directory, but task format is {fmt!r}")
        if not any((path / m).is_file() for m in _SAVED_MARKERS):
            raise DatasetError(
                f"{label} is a directory but not a `datasets` save_to_disk folder (it holds none of "
                f"{', '.join(_SAVED_MARKERS)}); give a file or a folder written by save_to_disk"
            )
        _check_size(label, _folder_size(path, label), spec)
        fmt = "save_to_disk"
    elif stat.S_ISREG(st.st_mode):
        if fmt == "save_to_disk":
            raise DatasetError(f"{label} is a file; format 'save_to_disk' reads a folder")
        if fmt is None:
            fmt = _SUFFIXES.get(path.suffix.lower())
            if fmt is None:
                raise DatasetError(
                    f"{label}: cannot tell the format from the suffix {path.suffix or '(none)'!r}; "
                    f"set format to one of: {', '.join(FORMATS)}"
                )
        _check_size(label, st.st_size, spec)
    else:
        raise DatasetError(f"{label} is {_kind(st.st_mode)}; give a regular file or a save_to_disk folder")
    if source.split is not None and fmt != "save_to_disk":
        raise DatasetError(f"{label}: split applies to save_to_disk folders; remove it")
    table = READERS[fmt](path, label, source, spec)
    return dataclasses.replace(table, name=source.label, source=source, rows=_capped(label, spec, table.rows))


def _folder_size(path: Path, label: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.stat(os.path.join(root, f))
            except OSError as e:
                raise DatasetError(f"{label}: {os.path.join(root, f)} cannot be read: {e.strerror}") from None
            if not stat.S_ISREG(st.st_mode):
                raise DatasetError(f"{label}: {os.path.join(root, f)} is {_kind(st.st_mode)}")
            total += st.st_size
    return total


def _lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) of each non-blank line of ``f``, never holding more than ``limit`` + 1
    bytes of one: a longer line is skipped unread and comes as None."""
    lineno = 0
    while raw := f.readline(limit + 1):
        lineno += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(_CHUNK)
            yield lineno, None
        elif raw.strip():
            yield lineno, raw


def _json_object(raw: bytes) -> Row | _RowError:
    """One JSON Lines record, or why it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _RowError(f"not UTF-8 ({e.reason} at byte {e.start + 1} of the line)")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return _RowError(f"not valid JSON ({e.msg} at column {e.colno})")
    except RecursionError:
        return _RowError(f"JSON nested too deeply to parse (a row may nest {MAX_DEPTH} levels)")
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        return _RowError(f"not readable as JSON ({e})")
    if not isinstance(record, dict):
        return _RowError(f"expected a JSON object, got {type(record).__name__}")
    return record


def _read_jsonl(path: Path, label: str, source: DatasetSource, spec: TaskSpec) -> _Table:
    # Line by line with the standard library, not pyarrow: one line in memory at a time, each
    # row's error names its line, and a column whose type changes between rows reads as written.
    def rows() -> Iterator[ReadRow]:
        with path.open("rb") as f:
            for lineno, raw in _lines(f, spec.max_row_bytes):
                where = f"{label} line {lineno}"
                if raw is None:
                    yield where, _RowError(f"longer than task.max_row_bytes={spec.max_row_bytes} (skipped unread)")
                else:
                    yield where, _json_object(raw)

    return _Table(label, rows())


class _JsonArray:
    """The elements of a file holding one JSON array, one at a time: at most one element (up to
    ``limit`` characters) and one chunk of the file are held. The standard library parses each
    element (``raw_decode``); an element that does not parse ends the read, since the array
    cannot be followed past it (JSON Lines can: there each line is a row)."""

    def __init__(self, path: Path, label: str, limit: int) -> None:
        self.path, self.label, self.limit = path, label, limit
        self.buf, self.pos, self.eof, self.row = "", 0, False, 0
        # Bytes that are not UTF-8 become lone surrogates, so the row holding them is a bad row
        # (named, droppable) rather than the end of the read.
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.json = json.JSONDecoder()

    def _error(self, what: str) -> DatasetError:
        return DatasetError(f"{self.label} row {self.row}: {what}; a JSON array cannot be read past it")

    def _fill(self, f: BinaryIO) -> bool:
        if self.eof:
            return False
        chunk = f.read(_CHUNK)
        self.eof = not chunk
        self.buf, self.pos = self.buf[self.pos :] + self.utf8.decode(chunk, final=self.eof), 0
        return True

    def _next_char(self, f: BinaryIO) -> str:
        """The next character that is not white space ('' at the end of the file), not consumed."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _SPACE:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._fill(f):
                return ""

    def _element(self, f: BinaryIO) -> Row | _RowError:
        while True:
            try:
                value, end = self.json.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if len(self.buf) - self.pos > self.limit:
                    raise self._error(f"longer than task.max_row_bytes={self.limit} characters") from None
                if not self._fill(f):
                    raise self._error(f"not valid JSON ({e.msg})") from None
                continue
            except RecursionError:
                raise self._error(f"JSON nested too deeply to parse (a row may nest {MAX_DEPTH} levels)") from None
            except ValueError as e:  # e.g. an integer of more digits than Python converts
                raise self._error(f"not readable as JSON ({e})") from None
            if end == len(self.buf) and self._fill(f):
                continue  # a number at the end of the chunk may go on in the next one
            break
        size, self.pos = end - self.pos, end
        if size > self.limit:
            return _RowError(f"longer than task.max_row_bytes={self.limit} characters")
        return value if isinstance(value, dict) else _RowError(f"expected a JSON object, got {type(value).__name__}")

    def rows(self) -> Iterator[ReadRow]:
        with self.path.open("rb") as f:
            self._next_char(f)
            self.pos += 1  # the '[' the caller found
            while (c := self._next_char(f)) != "]":
                if self.row:
                    if c != ",":
                        raise self._error(f"expected ',' or ']' after it, found {c!r}" if c else "the array never ends")
                    self.pos += 1
                    self._next_char(f)
                self.row += 1
                yield f"{self.label} row {self.row}", self._element(f)
            self.pos += 1
            if self._next_char(f):
                raise DatasetError(f"{self.label}: data after the array's closing ']'")


def _read_json(path: Path, label: str, source: DatasetSource, spec: TaskSpec) -> _Table:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        # Hugging Face's convention: a .json file that is not an array is JSON Lines.
        return _read_jsonl(path, label, source, spec)
    return _Table(label, _JsonArray(path, label, spec.max_row_bytes).rows())


def _arrow_rows(label: str, batches: Iterable[Any], broken: str) -> Iterator[ReadRow]:
    """Rows of arrow record batches as Python dicts, ``_BATCH`` at a time; an arrow error while
    reading is a DatasetError prefixed with ``broken``."""
    import pyarrow as pa

    n = 0
    try:
        for batch in batches:
            for start in range(0, batch.num_rows, _BATCH):
                for row in batch.slice(start, _BATCH).to_pylist():
                    n += 1
                    yield f"{label} row {n}", row
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{label}: {broken}{e}") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{label} row {n + 1} or near it: not UTF-8 ({e.reason})") from None


def _read_parquet(path: Path, label: str, source: DatasetSource, spec: TaskSpec) -> _Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{label}: not a readable Parquet file ({e})") from None
    meta = pf.metadata  # the footer: counts and sizes before a row is read
    _check_columns(label, len(pf.schema_arrow), spec)
    _check_count(label, meta.num_rows, spec)
    unpacked = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    if unpacked > spec.max_bytes:
        raise DatasetError(
            f"{label} holds {unpacked} bytes uncompressed, over task.max_bytes={spec.max_bytes}; "
            "raise task.max_bytes or split the data"
        )
    return _Table(label, _arrow_rows(label, pf.iter_batches(batch_size=_BATCH), "not a readable Parquet file: "))


def _long_line(path: Path, limit: int) -> int | None:
    """The number of the first line of the file longer than ``limit`` bytes, or None; one chunk
    in memory at a time."""
    lineno, run = 1, 0  # run: bytes of the current line so far
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            parts = chunk.split(b"\n")
            if run + len(parts[0]) > limit:
                return lineno
            if len(parts) > 1:
                for k, part in enumerate(parts[1:-1], start=1):
                    if len(part) > limit:
                        return lineno + k
                lineno, run = lineno + len(parts) - 1, 0
            run += len(parts[-1])
            if run > limit:
                return lineno
    return None


def _read_csv(path: Path, label: str, source: DatasetSource, spec: TaskSpec) -> _Table:
    import pyarrow.csv as pc

    # pyarrow's CSV reader takes a line of any length into memory: the lines are measured first.
    if (lineno := _long_line(path, spec.max_row_bytes)) is not None:
        raise DatasetError(
            f"{label} line {lineno} is longer than task.max_row_bytes={spec.max_row_bytes}; "
            "a CSV file cannot be read past it (raise task.max_row_bytes, or cut the line)"
        )
    with path.open("rb") as f:
        header = f.readline(spec.max_row_bytes + 1)
    _check_columns(label, len(next(csv.reader([header.decode("utf-8", "replace")]), [])), spec)

    # Streamed block by block; a column holding bytes that are not UTF-8 reads as binary, and its
    # cells are decoded here with those bytes as lone surrogates: only their rows are bad rows.
    def batches() -> Iterator[Any]:  # opened as it is read: opening parses the first block
        yield from pc.open_csv(str(path), read_options=pc.ReadOptions(block_size=_CHUNK))

    def rows() -> Iterator[ReadRow]:
        for where, row in _arrow_rows(label, batches(), ""):  # rows count from the line after the header
            if isinstance(row, dict):
                row = {k: v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else v for k, v in row.items()}
            yield where, row

    return _Table(label, rows())


def _read_saved(path: Path, label: str, source: DatasetSource, spec: TaskSpec) -> _Table:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise DatasetError(f"{label}: not a readable save_to_disk folder ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if source.split is None:
            if len(splits) != 1:
                raise DatasetError(f"{label} holds the splits {', '.join(splits)}; choose one with split")
            ds = ds[splits[0]]
        elif source.split not in ds:
            raise DatasetError(f"{label} has no split {source.split!r}; its splits are: {', '.join(splits)}")
        else:
            ds = ds[source.split]
    elif source.split is not None:
        raise DatasetError(f"{label} holds one Dataset, not a DatasetDict; remove split={source.split!r}")
    _check_columns(label, len(ds.column_names), spec)
    _check_count(label, len(ds), spec)

    def rows() -> Iterator[ReadRow]:
        n = 0
        for batch in ds.iter(batch_size=_BATCH):  # memory-mapped: one batch in Python at a time
            for values in zip(*batch.values(), strict=True):
                n += 1
                yield f"{label} row {n}", dict(zip(batch.keys(), values, strict=True))

    return _Table(label, rows())


Reader = Callable[[Path, str, DatasetSource, TaskSpec], _Table]
READERS: dict[str, Reader] = {
    "jsonl": _read_jsonl,
    "json": _read_json,
    "parquet": _read_parquet,
    "csv": _read_csv,
    "save_to_disk": _read_saved,
}


# --- mapping rows to problems ----------------------------------------------------------------


def _unicode(text: str, what: str) -> str:
    """``text``, refused when it holds a lone surrogate (``"\\ud800"`` is valid JSON but not
    Unicode text: no tokenizer encodes it, nor UTF-8, nor the wire or the ledger)."""
    m = _SURROGATE.search(text)
    if m is None:
        return text
    c, at = ord(m.group()), m.start() + 1
    if 0xDC80 <= c <= 0xDCFF:  # how the JSON array reader keeps a byte that is not UTF-8
        why = f"the byte 0x{c - 0xDC00:02x} at character {at} is not UTF-8 (or it is a \\u{c:04x} escape)"
    else:
        why = f"a lone surrogate (\\u{c:04x} at character {at}) is not valid Unicode text"
    raise _RowError(f"{what}: {why}; no tokenizer can encode it; fix or drop the row")


def _plain(value: Any, field: str, depth: int = 0) -> Any:
    """``value`` as JSON-like plain Python: numpy and arrow scalars unwrapped, dates as ISO text,
    decimals as text, non-finite floats as None, tuples as lists; text checked (``_unicode``) and
    nesting bounded (``MAX_DEPTH``)."""
    if depth > MAX_DEPTH:
        raise _RowError(f"field {field!r} is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        return _unicode(value, f"field {field!r}")
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {_unicode(str(k), f"a key of field {field!r}"): _plain(v, field, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, field, depth + 1) for v in value]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        raise _RowError(f"field {field!r} holds binary data, which cannot reach the reward; drop or convert the column")
    module = type(value).__module__.split(".")[0]
    if module == "numpy" and hasattr(value, "tolist"):
        return _plain(value.tolist(), field, depth)  # numpy scalar or array
    if module == "pyarrow" and hasattr(value, "as_py"):
        return _plain(value.as_py(), field, depth)
    raise _RowError(f"field {field!r} holds a {type(value).__name__}, not a JSON-like value")


def _columns(row: Mapping[str, Any]) -> str:
    # Readers that build a table (pyarrow) give every row every column, None where it had none.
    # For error messages: at most 20 names, a lone surrogate in one escaped.
    names = [str(k).encode("utf-8", "backslashreplace").decode() for k, v in row.items() if v is not None]
    more = f" and {len(names) - 20} more" if len(names) > 20 else ""
    return ", ".join(names[:20]) + more if names else "(none)"


def _at(row: Mapping[str, Any], path: str, what: str, hint: str = "") -> Any:
    """The value a field names: a column, or a dotted path into nested columns
    (``reward_model.ground_truth``, ``extra_info.index``; a list item by its index, ``answers.0``).
    A column whose own name holds the dots is taken first.

    Raises:
        _RowError: the path, or a part of it, is missing or null; the message names the path,
            the part and what the row holds there.
    """
    hint = f" ({hint})" if hint else ""
    if path in row or "." not in path:
        value = row.get(path)
        if value is None:
            raise _RowError(f"field {path!r} ({what}) is missing or null; the row's columns are: {_columns(row)}{hint}")
        return value
    value = row
    done: list[str] = []
    for part in path.split("."):
        found: Any = None
        if isinstance(value, Mapping):
            found, have = value.get(part), f"its keys are: {_columns(value)}"
        elif isinstance(value, (list, tuple)):
            if part.isdigit() and int(part) < len(value):
                found = value[int(part)]
            have = f"it is a list of {len(value)} items"
        else:
            have = f"it is a {type(value).__name__}, not an object"
        if found is None:
            at = f"{'.'.join(done)!r}" if done else "the row"
            raise _RowError(f"field {path!r} ({what}) is missing or null: {at} has no {part!r}; {have}{hint}")
        value = found
        done.append(part)
    return value


def _text(row: Mapping[str, Any], field: str, what: str) -> str:
    value = _at(row, field, what)
    if not isinstance(value, str):
        raise _RowError(f"field {field!r} ({what}) must be a string, got {type(value).__name__}")
    if not value.strip():
        raise _RowError(f"field {field!r} ({what}) is empty")
    return value


def _answer_text(value: Any, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _RowError(f"field {field!r} (answer) must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _RowError(f"field {field!r} (answer) is {value}")
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def _messages(row: Mapping[str, Any], field: str) -> list[dict[str, str]]:
    value = _at(row, field, "messages")
    if not isinstance(value, (list, tuple)) or not value:
        raise _RowError(
            f"field {field!r} (messages) must be a non-empty list of {{role, content}}, got {type(value).__name__}"
        )
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _RowError(f'field {field!r} (messages) item {k}: expected {{"role": str, "content": str}}')
        if m["role"] not in ROLES:
            raise _RowError(f"field {field!r} (messages) item {k}: role {m['role']!r} is not one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user" or not out[-1]["content"].strip():
        raise _RowError(f"field {field!r} (messages) must end with a non-empty user turn (the prompt)")
    return out


@dataclass(frozen=True)
class _FieldMap:
    """How a dataset's rows become problems: the task's fields with the dataset's overrides."""

    prompt_field: str
    answer_field: str | None
    messages_field: str | None
    system_prompt: str | None
    template: str | None
    template_cols: tuple[str, ...]  # one per replacement field of the template, repeats included
    template_pad: int  # the most padding the template's format specs add
    clean_prompt: Callable[[str], str]  # applied to the prompt column's text, not to a template's output
    clean_answer: Callable[[str], str]
    max_columns: int
    max_chars: int  # the longest prompt a template may build (task.max_row_bytes)
    layout: Layout | None = None  # task.format: the whole row reaches the reward
    answer_columns: tuple[str, ...] = ()  # TRL: the answer is the first of these the row has

    @classmethod
    def of(cls, spec: TaskSpec, preset: Preset, source: DatasetSource | None) -> _FieldMap:
        src = source or _NO_OVERRIDES
        template = src.prompt_template or (None if src.prompt_field else spec.prompt_template)
        answer_field = src.answer_field or spec.answer_field
        # By value, not by model_fields_set: a spec that went through the ledger comes back with
        # every default set. The layouts have no top-level 'answer' column to mean otherwise.
        answer_set = src.answer_field is not None or spec.answer_field != TaskSpec.model_fields["answer_field"].default
        messages_field = spec.messages_field or preset.messages_field
        answer_columns: tuple[str, ...] = ()
        if spec.format == "verl":
            # verl's preprocessing (examples/data_preprocess/*.py) writes every row this way.
            messages_field = "prompt"
            answer_field = answer_field if answer_set else "reward_model.ground_truth"
        elif spec.format == "trl" and not answer_set:
            answer_field, answer_columns = None, TRL_ANSWER_COLUMNS
        return cls(
            prompt_field=src.prompt_field or spec.prompt_field or preset.prompt_field,
            answer_field=answer_field,
            messages_field=messages_field,
            system_prompt=spec.system_prompt,
            template=template,
            template_cols=tuple(template_fields(template)) if template else (),
            template_pad=_template_padding(template) if template else 0,
            clean_prompt=preset.clean_prompt,
            clean_answer=preset.clean_answer,
            max_columns=spec.max_columns,
            max_chars=spec.max_row_bytes,
            layout=spec.format,
            answer_columns=answer_columns,
        )

    def used(self) -> set[str]:
        """Columns that make the prompt and the answer (not repeated in metadata). None under a
        framework's layout, whose rewards read the whole row; a dotted path names no column, so
        its column stays in metadata (reward_model holds more than ground_truth)."""
        if self.layout is not None:
            return set()
        cols = {self.answer_field} if self.answer_field else set()
        if self.messages_field:
            cols.add(self.messages_field)
        elif self.template:
            cols.update(self.template_cols)
        else:
            cols.add(self.prompt_field)
        return cols

    def _templated(self, row: Mapping[str, Any]) -> str:
        assert self.template is not None
        for col in self.template_cols:
            if row.get(col) is None:
                raise _RowError(
                    f"field {col!r} (used by prompt_template) is missing or null; "
                    f"the row's columns are: {_columns(row)}"
                )
        # Bounded before it is built: a short template repeating a long column could make a prompt
        # of gigabytes. (An upper bound: the template's text, its padding, each field's value.)
        sizes = {col: len(str(row[col])) for col in set(self.template_cols)}
        if len(self.template) + self.template_pad + sum(sizes[c] for c in self.template_cols) > self.max_chars:
            raise _RowError(
                f"prompt_template would build a prompt of over task.max_row_bytes={self.max_chars} characters"
            )
        try:
            prompt = self.template.format_map(row)
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise _RowError(f"prompt_template cannot be filled from this row ({type(e).__name__}: {e})") from None
        if not prompt.strip():
            raise _RowError("prompt_template gives an empty prompt")
        return prompt

    def problem(self, row: Mapping[str, Any], index: int, source: str, used: set[str], where: str) -> Problem:
        if len(row) > self.max_columns:
            raise _RowError(f"has {len(row)} fields, over task.max_columns={self.max_columns}")
        messages: list[dict[str, str]] | None = None
        messages_field = self.messages_field
        if self.layout == "trl" and isinstance(row.get("prompt"), (list, tuple)):
            messages_field = "prompt"  # TRL's conversational layout; a string is its standard one
        if messages_field:
            messages = _messages(row, messages_field)
            for m in messages:
                _unicode(m["content"], f"field {messages_field!r} (messages)")
            prompt = messages[-1]["content"]
        elif self.template:
            prompt = _unicode(self._templated(row), "the prompt (prompt_template over the row)")
        else:
            text = _text(row, self.prompt_field, "prompt")
            prompt = _unicode(self.clean_prompt(text), f"field {self.prompt_field!r}")
        if self.system_prompt is not None:
            messages = messages or [{"role": "user", "content": prompt}]
            if messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": self.system_prompt})
        answer = ""
        f = self.answer_field or next((c for c in self.answer_columns if row.get(c) is not None), None)
        if f is not None:
            value = _at(row, f, "answer", "set answer_field to null if the reward needs no reference answer")
            try:
                answer = self.clean_answer(_answer_text(value, f)).strip()
            except ValueError as e:
                raise _RowError(f"field {f!r} (answer) {e}") from None
            if not answer:
                raise _RowError(f"field {f!r} (answer) is empty (set answer_field to null if the reward needs none)")
            _unicode(answer, f"field {f!r} (answer)")
        metadata = {_unicode(str(k), "a column name"): _plain(v, k) for k, v in row.items() if k not in used}
        return Problem(
            index=index,
            prompt=prompt,
            answer=answer,
            metadata=metadata,
            messages=tuple(messages) if messages is not None else None,
            source=source,
            origin=where,
        )


def _problems(table: _Table, spec: TaskSpec, preset: Preset) -> list[Problem]:
    """The table's rows as problems, read whole before any is used. A row that cannot be used
    fails the load naming its file and row (task.bad_rows reject), or is left out and counted
    (drop); a file that cannot be read fails it either way."""
    mapping = _FieldMap.of(spec, preset, table.source)
    used = mapping.used()
    out: list[Problem] = []
    dropped: list[str] = []
    for where, row in table.rows:
        try:
            if isinstance(row, _RowError):
                raise row
            out.append(mapping.problem(row, len(out), table.name, used, where))
        except _RowError as e:
            if spec.bad_rows == "reject":
                raise DatasetError(f"{where}: {e} (task.bad_rows=drop leaves such rows out)") from None
            dropped.append(f"{where}: {e}")
    if dropped:
        if not out:
            raise DatasetError(f"{table.name}: every row is bad ({len(dropped)} dropped), e.g. {dropped[0]}")
        log.warning(
            "%s: %d bad rows dropped (task.bad_rows=drop), %d kept; first: %s",
            table.name,
            len(dropped),
            len(out),
            "; ".join(dropped[:3]),
        )
    return out


# --- presets ---------------------------------------------------------------------------------


def _same(text: str) -> str:
    return text


def _file_tables(spec: TaskSpec, seed: int) -> tuple[list[_Table], list[_Table]]:
    return ([_open_table(s, spec) for s in spec.train_sources()], [_open_table(s, spec) for s in spec.test_sources()])


def _arithmetic_tables(spec: TaskSpec, seed: int) -> tuple[list[_Table], list[_Table]]:
    # The generator draws train and held-out problems disjointly from the seed; its rows then
    # take the same path as a file's (mapping, template, system prompt, mixing).
    train, test = synthetic_arithmetic(seed, spec.n_train or ARITHMETIC_N_TRAIN, spec.n_test or ARITHMETIC_N_TEST)

    def table(problems: list[Problem], part: str) -> _Table:
        rows = [
            (f"arithmetic ({part}) row {i + 1}", {"prompt": p.prompt, "answer": p.answer})
            for i, p in enumerate(problems)
        ]
        return _Table("arithmetic", rows, presampled=True)

    return [table(train, "train")], [table(test, "test")]


def _gym_tables(spec: TaskSpec, seed: int) -> tuple[list[_Table], list[_Table]]:
    # reasoning-gym draws train and held-out entries from disjoint seeds (shared.gym); its rows
    # then take the same path as a file's (mapping, template, system prompt).
    from shared.gym import gym_rows

    assert spec.dataset is not None, "TaskSpec requires task.dataset for reasoning_gym"
    n_test = spec.n_test if spec.n_test is not None else DEFAULT_SPLIT_N_TEST
    try:
        train, test = gym_rows(spec.dataset, spec.config, seed, spec.size or GYM_SIZE, n_test)
    except ValueError as exc:
        raise DatasetError(str(exc)) from None
    name = f"reasoning_gym {spec.dataset}"

    def table(rows: list[dict[str, Any]], part: str) -> _Table:
        return _Table(name, [(f"{name} ({part}) entry {i}", r) for i, r in enumerate(rows)], presampled=True)

    return [table(train, "train")], [table(test, "held-out")]


def _verifiers_tables(spec: TaskSpec, seed: int) -> tuple[list[_Table], list[_Table]]:
    # A verifiers environment's tasks (shared.vfenv): the training taskset, and the held-out one
    # when eval_args gives it (else load_task's seeded split of the training tasks). An infinite
    # taskset is read as far as n_train (and n_test) need.
    from shared.vfenv import VerifiersError, task_rows

    assert spec.env is not None, "TaskSpec requires task.env for verifiers"
    name = f"verifiers {spec.env}"

    def table(args: dict[str, Any], limit: int | None, part: str) -> _Table:
        def rows() -> Iterator[ReadRow]:
            try:
                yield from task_rows(spec.env or "", args, limit)
            except VerifiersError as exc:
                raise DatasetError(f"{name} ({part}): {exc}") from None

        return _Table(name if part == "train" else f"{name} (held-out)", rows())

    n_test = spec.n_test if spec.n_test is not None else DEFAULT_SPLIT_N_TEST
    if spec.eval_args is None:
        limit = None if spec.n_train is None else spec.n_train + n_test
        return [table(spec.args, limit, "train")], []
    held_out = table(spec.eval_args, spec.n_test or DEFAULT_MAX_TEST, "held-out")
    return [table(spec.args, spec.n_train, "train")], [held_out]


@dataclass(frozen=True)
class Preset:
    """A task preset: where its rows come from and how its columns read."""

    tables: Callable[[TaskSpec, int], tuple[list[_Table], list[_Table]]]
    prompt_field: str = "prompt"
    messages_field: str | None = None
    clean_prompt: Callable[[str], str] = _same
    clean_answer: Callable[[str], str] = _same


PRESETS: dict[str, Preset] = {
    "arithmetic": Preset(_arithmetic_tables),
    "gsm8k": Preset(_file_tables, prompt_field="question", clean_prompt=str.strip, clean_answer=gsm8k_final_answer),
    "dataset": Preset(_file_tables),
    "reasoning_gym": Preset(_gym_tables, prompt_field="question"),
    "verifiers": Preset(_verifiers_tables, messages_field="messages"),
}
TASKS: tuple[str, ...] = tuple(PRESETS)


# --- split and mixture -----------------------------------------------------------------------


def _key(p: Problem) -> tuple[str, str]:
    return p.prompt, json.dumps(p.messages) if p.messages else ""


def _split(
    groups: list[list[Problem]], names: Sequence[str], spec: TaskSpec, rng: random.Random
) -> tuple[list[list[Problem]], list[Problem]]:
    """Hold out problems from the pooled training rows: repeated prompts dropped first (the first
    occurrence stays), so no prompt is in both splits; then a seeded shuffle."""
    seen: set[tuple[str, str]] = set()
    pooled: list[tuple[int, Problem]] = []
    for g, problems in enumerate(groups):
        for p in problems:
            if (k := _key(p)) not in seen:
                seen.add(k)
                pooled.append((g, p))
    rng.shuffle(pooled)
    if spec.n_test is not None:
        n_test, why = spec.n_test, "n_test"
    elif spec.test_fraction is not None:
        n_test, why = max(1, round(spec.test_fraction * len(pooled))), f"test_fraction={spec.test_fraction}"
    else:
        n_test, why = DEFAULT_SPLIT_N_TEST, "the default n_test"
    if n_test >= len(pooled):
        raise DatasetError(
            f"n_test={n_test} ({why}) but {', '.join(names)} has {len(pooled)} usable problems after "
            "removing repeated prompts, and the split leaves none for training; lower task.n_test, "
            "or give task.test"
        )
    rest = pooled[n_test:]
    return [[p for g, p in rest if g == k] for k in range(len(groups))], [p for _, p in pooled[:n_test]]


def _quotas(n: int, shares: Sequence[float]) -> list[int]:
    """``n`` split in proportion to ``shares`` by largest remainder (sums to ``n`` exactly)."""
    total = sum(shares)
    exact = [n * s / total for s in shares]
    q = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (q[i] - exact[i], i))
    for i in by_remainder[: n - sum(q)]:
        q[i] += 1
    return q


def _mix(
    groups: list[list[Problem]], names: Sequence[str], weights: Sequence[float | None], n_train: int | None
) -> list[Problem]:
    """The training list: each dataset's share of ``n_train`` taken from the front of its
    (shuffled) rows, repeated when the share is larger, then interleaved evenly so that every
    stretch of the list has the mixture's proportions."""
    sizes = [len(g) for g in groups]
    for name, size in zip(names, sizes, strict=True):
        if size == 0:
            raise DatasetError(f"dataset {name} has no training problems left (all held out or repeated)")
    total = sum(sizes)
    n = n_train if n_train is not None else total
    if all(w is None for w in weights):
        if n > total:
            raise DatasetError(
                f"n_train={n} but the training data ({', '.join(names)}) has {total} usable problems; "
                "lower task.n_train, or give the datasets weights to repeat rows"
            )
        shares: list[float] = [float(s) for s in sizes]
    else:
        shares = [float(w) for w in weights if w is not None]
    picks: list[tuple[float, int, Problem]] = []
    for i, (problems, q) in enumerate(zip(groups, _quotas(n, shares), strict=True)):
        picks.extend(((j + 0.5) / q, i, problems[j % len(problems)]) for j in range(q))
    picks.sort(key=lambda t: (t[0], t[1]))
    return [p for _, _, p in picks]


def _indexed(problems: Sequence[Problem]) -> list[Problem]:
    return [dataclasses.replace(p, index=i) for i, p in enumerate(problems)]


# --- public ----------------------------------------------------------------------------------


def load_task(spec: TaskSpec, seed: int) -> tuple[list[Problem], list[Problem]]:
    """``(train, test)`` for a job's task section, each indexed 0..n-1, the same for a seed.

    Held-out set: the test datasets concatenated in order, their first ``n_test`` rows (default:
    all, up to ``DEFAULT_MAX_TEST``); without test datasets, ``n_test`` (default 100) or
    ``test_fraction`` of the training rows, after dropping repeated prompts, by a seeded shuffle.

    Training list: each training dataset's rows in a seeded shuffled order (generated rows keep
    their seeded order). Without weights, every dataset contributes all its rows, or with
    ``n_train`` a share in proportion to its size. With weights, ``n_train`` (default: the
    total row count) is split in proportion to the weights and a dataset smaller than its share
    is repeated. The datasets are interleaved evenly; the trainer shuffles per epoch.

    Raises:
        DatasetError: a file cannot be read, a row lacks a field or has the wrong type (the
            message names the file, the row and the field), or the sizes do not fit the data.
        ValueError: from the arithmetic generator, when n_train + n_test exceed its pool.
    """
    preset = PRESETS[spec.name]
    train_tables, test_tables = preset.tables(spec, seed)
    names = [t.name for t in train_tables]
    groups = [_problems(t, spec, preset) for t in train_tables]
    rng = random.Random(seed)
    if test_tables:
        for table, problems in zip(train_tables, groups, strict=True):
            if not table.presampled:
                rng.shuffle(problems)
        held = [p for t in test_tables for p in _problems(t, spec, preset)]
        n_test = spec.n_test if spec.n_test is not None else min(len(held), DEFAULT_MAX_TEST)
        test_names = ", ".join(t.name for t in test_tables)
        if n_test > len(held):
            raise DatasetError(f"n_test={n_test} but the test data ({test_names}) has {len(held)} usable problems")
        if spec.n_test is None and len(held) > n_test:
            log.warning(
                "test data %s has %d problems; evaluating the first %d (set task.n_test to choose)",
                test_names,
                len(held),
                n_test,
            )
        test = held[:n_test]
        _warn_overlap(groups, test)
    else:
        groups, test = _split(groups, names, spec, rng)
    train = _mix(groups, names, [t.source.weight if t.source else None for t in train_tables], spec.n_train)
    return _indexed(train), _indexed(test)


def load_source(source: DatasetSource, spec: TaskSpec, seed: int) -> list[Problem]:
    """Every row of one dataset (e.g. a named evaluation set) as problems, in file order, indexed
    0..n-1, mapped with the task's fields and preset (and the dataset's own overrides).

    ``seed`` is taken for symmetry with ``load_task``: a file's rows do not depend on it.

    Raises:
        DatasetError: as ``load_task``.
    """
    del seed
    preset = PRESETS[spec.name]
    return _indexed(_problems(_open_table(source, spec), spec, preset))


def _warn_overlap(groups: list[list[Problem]], test: list[Problem]) -> None:
    held = {_key(p) for p in test}
    both = sum(_key(p) in held for g in groups for p in g)
    if both:
        log.warning("%d training problems also appear in the test data (same prompt)", both)
