"""reasoning-gym datasets by name: the rows of a `reasoning_gym` task and the reward that scores them.

`reasoning-gym` (an optional extra: ``pip install 'asyncrl[gym]'``) registers about a hundred
procedural generators, each a dataset class with a config dataclass and its own
``score_answer(answer, entry)``. A job names one::

    "task": {"name": "reasoning_gym", "dataset": "letter_counting",
             "config": {"min_words": 1, "max_words": 2}, "size": 500, "n_test": 100}

and this module turns it into rows that ``shared.datasets.load_task`` maps like any file's:
``question`` (the prompt), ``answer`` (the dataset's reference answer; ``None`` for the few
generators that have none and verify the completion itself: the task then needs
``answer_field: null``), ``metadata`` (the entry's own metadata, for a ``prompt_template`` such as
``"{metadata[expression]}="``) and ``reasoning_gym`` (the dataset's name, its config and the whole
entry), which reaches the reward service as the problem's metadata. The built-in reward
``reasoning_gym`` rebuilds the dataset object from name and config and calls its own
``score_answer`` on the entry: nothing but JSON crosses the wire, never a pickled object.

Train and held-out splits are disjoint by seed: every generator draws entry ``i`` from
``Random(seed + i)``, so the training entries come from seeds ``seed .. seed + size - 1`` (the
job's seed) and the held-out entries from ``seed + size`` on. Two seeds may still draw the same
question when the generator's pool is small (one-digit sums), so held-out entries whose prompt is a
training prompt, or repeats one already held out, are skipped; a pool too small to fill ``n_test``
that way is an error that says so.

The package is imported only when a job names it (its import takes about a second and pulls
sympy); the API, the trainer and the reward service then need it installed.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Mapping
from typing import Any

__all__ = [
    "COLUMN",
    "INSTALL_HINT",
    "GymError",
    "check_config",
    "dataset_names",
    "gym_rows",
    "held_out_seed",
    "score_completion",
]

INSTALL_HINT = "pip install 'asyncrl[gym]'"
COLUMN = "reasoning_gym"
"""The row column (then the problem's metadata key) holding {dataset, config, entry} for the reward."""
RESERVED_CONFIG = ("seed", "size")
# Held-out entries are drawn until n_test distinct new prompts are found, at most this many times
# n_test (a pool that yields fewer is too small for the split).
HELD_OUT_TRIES = 20
# Entries whose scoring is checked to survive the JSON trip to the reward service (per split):
# whether it does depends on the generator's metadata types (tuples, int keys), not on the entry.
JSON_CHECKED = 20


class GymError(ValueError):
    """A reasoning_gym task cannot be built; the message says what to change."""


def _rg() -> Any:
    """The reasoning_gym package.

    Raises:
        GymError: it is not installed (the message says how to install it).
    """
    try:
        import reasoning_gym
    except ImportError as exc:
        raise GymError(
            f"task.name='reasoning_gym' needs the reasoning-gym package, which is not installed here "
            f"({exc}): {INSTALL_HINT}"
        ) from None
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every registered reasoning-gym dataset name, sorted (``composite`` excluded: it mixes
    datasets by a config of configs, which a job gives as several tasks instead)."""
    _rg()
    from reasoning_gym.factory import DATASETS

    return sorted(n for n in DATASETS if n != "composite")


def _classes(name: str) -> tuple[Any, Any]:
    """(dataset class, config class) of `name`.

    Raises:
        GymError: not installed, or no dataset has that name (a few valid ones listed).
    """
    _rg()
    from reasoning_gym.factory import DATASETS

    names = dataset_names()
    if name not in names:
        some = difflib.get_close_matches(name, names, n=5) or [
            "letter_counting",
            "basic_arithmetic",
            "chain_sum",
            "spell_backward",
            "gcd",
        ]
        raise GymError(
            f"reasoning-gym has no dataset {name!r}; e.g. {', '.join(some)} ({len(names)} in all: "
            "python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')"
        )
    cls, config_cls = DATASETS[name]
    return cls, config_cls


def _dataset(name: str, config: Mapping[str, Any], seed: int, size: int) -> Any:
    """The dataset object, built as reasoning-gym's ``create_dataset`` builds it.

    Raises:
        GymError: an unknown name, a config key the dataset does not have (its keys listed), or a
            value its config refuses (the dataset's own message).
    """
    cls, config_cls = _classes(name)
    reserved = [k for k in RESERVED_CONFIG if k in config]
    if reserved:
        raise GymError(
            f"task.config may not set {', '.join(reserved)}: the job's seed and task.size decide them "
            "(the held-out split takes the seeds after the training ones)"
        )
    fields = [f for f in getattr(config_cls, "__dataclass_fields__", {}) if f not in RESERVED_CONFIG]
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise GymError(
            f"reasoning-gym dataset {name!r} has no config key {', '.join(map(repr, unknown))}; "
            f"its keys are: {', '.join(fields) or '(none)'}"
        )
    try:
        cfg = config_cls(**config, seed=seed, size=size)
        if hasattr(cfg, "validate"):
            cfg.validate()
        return cls(config=cfg)
    except Exception as exc:  # the library's own check: AssertionError, ValueError or TypeError
        raise GymError(f"reasoning-gym dataset {name!r} refuses task.config {dict(config)}: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _entry(ds: Any, name: str, index: int) -> dict[str, Any]:
    try:
        entry = ds[index]
    except Exception as exc:
        raise GymError(f"reasoning-gym dataset {name!r} failed to generate entry {index}: {_why(exc)}") from None
    if not isinstance(entry, Mapping) or not isinstance(entry.get("question"), str):
        raise GymError(f"reasoning-gym dataset {name!r} entry {index} has no question text")
    return dict(entry)


def check_config(name: str, config: Mapping[str, Any]) -> None:
    """What the API checks for a `reasoning_gym` task: the package is installed, the dataset
    exists, and its config builds and generates an entry. Remembered per process for a valid
    (name, config): a spec is validated several times (submission, storage, each service), and
    some generators take a second per entry.

    Raises:
        GymError: saying which of those fails.
    """
    _checked(name, json.dumps(dict(config), sort_keys=True))


@functools.lru_cache(maxsize=256)
def _checked(name: str, config_json: str) -> None:
    _entry(_dataset(name, json.loads(config_json), seed=0, size=1), name, 0)


def held_out_seed(seed: int, size: int) -> int:
    """The first seed of the held-out entries: the one after the training entries' seeds
    (``seed .. seed + size - 1``)."""
    return seed + size


def _json_safe(entry: dict[str, Any], name: str) -> dict[str, Any]:
    """The entry as the reward service will see it (a JSON round trip).

    Raises:
        GymError: the entry is not JSON (e.g. a set or an object in its metadata).
    """
    try:
        return dict(json.loads(json.dumps(entry, allow_nan=False)))
    except (TypeError, ValueError) as exc:
        raise GymError(
            f"reasoning-gym dataset {name!r} makes entries that are not JSON ({exc}); it cannot be scored "
            "in the reward service"
        ) from None


def _check_scoring(ds: Any, name: str, entry: dict[str, Any], plain: dict[str, Any]) -> None:
    """The dataset's score for its own answer must not change when the entry went through JSON
    (tuples become lists, integer keys strings: a score_answer comparing them would fail every
    completion)."""
    answer = entry.get("answer")
    if answer is None:
        return
    before, after = ds.score_answer(str(answer), entry), ds.score_answer(str(answer), plain)
    if before != after:
        raise GymError(
            f"reasoning-gym dataset {name!r} scores its own answer {before} but {after} once the entry went "
            "through JSON (its metadata holds tuples or non-string keys), so it cannot be scored in the "
            "reward service; choose another dataset"
        )


def _row(ds: Any, name: str, config: Mapping[str, Any], entry: dict[str, Any], check: bool) -> dict[str, Any]:
    plain = _json_safe(entry, name)
    if check:
        _check_scoring(ds, name, entry, plain)
    answer = plain.get("answer")
    return {
        "question": plain["question"],
        "answer": None if answer is None else str(answer),
        "metadata": plain.get("metadata") or {},
        COLUMN: {"dataset": name, "config": dict(config), "entry": plain},
    }


def gym_rows(
    name: str, config: Mapping[str, Any], seed: int, size: int, n_test: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training and held-out rows of a reasoning-gym dataset (columns in the module docstring).

    Args:
        name: the dataset (task.dataset).
        config: its config without seed and size (task.config).
        seed: the job's seed: training entries come from seeds seed .. seed + size - 1.
        size: training entries (task.size).
        n_test: held-out entries, from seeds seed + size on, none with a training prompt, none
            repeated.

    Returns:
        ``(train, test)`` rows, in generation order (already seeded: not to be reshuffled).

    Raises:
        GymError: not installed, an unknown dataset or config, entries that are not JSON or do not
            score the same after JSON, or a pool too small for n_test distinct held-out prompts.
    """
    train_ds = _dataset(name, config, seed, size)
    train = [_row(train_ds, name, config, _entry(train_ds, name, i), i < JSON_CHECKED) for i in range(size)]
    seen = {r["question"] for r in train}
    tries = HELD_OUT_TRIES * n_test
    test_ds = _dataset(name, config, held_out_seed(seed, size), tries)
    test: list[dict[str, Any]] = []
    for i in range(tries):
        entry = _entry(test_ds, name, i)
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        test.append(_row(test_ds, name, config, entry, len(test) < JSON_CHECKED))
        if len(test) == n_test:
            return train, test
    raise GymError(
        f"reasoning-gym dataset {name!r} with config {dict(config)} gave only {len(test)} held-out questions "
        f"that are not training questions in {tries} draws; its pool is too small for task.size={size} and "
        f"task.n_test={n_test}: lower them, or widen the config"
    )


@functools.lru_cache(maxsize=64)
def _scorer(name: str, config_json: str) -> Any:
    """The dataset object whose score_answer scores (one per dataset and config in a process)."""
    return _dataset(name, json.loads(config_json), seed=0, size=1)


def extract(completion: str) -> str:
    """The answer in a completion: the last ``<answer>...</answer>`` (reasoning-gym's format),
    else the whole completion, stripped."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(completion)
    return tagged if tagged is not None else completion.strip()


def score_completion(completion: str, metadata: Mapping[str, Any]) -> float:
    """The dataset's own ``score_answer(answer, entry)`` for a completion (the ``reasoning_gym``
    built-in reward): `metadata` is the problem's, holding the ``reasoning_gym`` column.

    Raises:
        GymError: not installed, or the metadata is not a reasoning_gym task's.
    """
    info = metadata.get(COLUMN)
    if not isinstance(info, Mapping) or not isinstance(info.get("entry"), Mapping):
        raise GymError(
            f"the reasoning_gym reward needs the problem's metadata[{COLUMN!r}] (dataset, config, entry), which a "
            "task with name 'reasoning_gym' gives; this problem has none (a prompt_template naming the "
            f"{COLUMN!r} column uses it up: template with {{question}} or {{metadata[...]}} instead)"
        )
    ds = _scorer(str(info["dataset"]), json.dumps(info.get("config") or {}, sort_keys=True))
    return float(ds.score_answer(extract(completion), dict(info["entry"])))
