"""Tasks: problems with a canonical final answer, and the answer extractor the reward uses.

Pure Python on purpose (no torch, vLLM or transformers): the API, the reward service and the
trainer all import it.

Two tasks, chosen by name through ``TASKS``:

- ``arithmetic``: synthetic ``"a+b="`` problems, short and character-level friendly, for the
  tiny locally built model (``trainer_svc.tiny_model``). The defaults are tuned so that a short
  supervised warm start leaves the policy weak greedily but often right when sampling, which is
  the regime where GRPO visibly lifts held-out accuracy within a few hundred steps.
- ``gsm8k``: grade-school word problems from a GSM8K-format JSONL file.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ARITHMETIC_MAX_OPERAND",
    "ARITHMETIC_OPS",
    "TASKS",
    "Problem",
    "extract_answer",
    "load_gsm8k_jsonl",
    "load_task",
    "synthetic_arithmetic",
]


@dataclass(frozen=True)
class Problem:
    """One problem.

    Attributes:
        index: position of the problem in the list it was returned in (for a loaded file before
            splitting: its position among the file's problems). Stable for a given seed.
        prompt: the text the policy is conditioned on, e.g. ``"17+25="``.
        answer: the canonical final answer, e.g. ``"42"``; compared with ``extract_answer`` of a
            completion for an exact-match reward.
    """

    index: int
    prompt: str
    answer: str


# --- arithmetic -----------------------------------------------------------------------------

# Operands 0..19, addition only: 400 distinct problems, answers 0..38. Small enough that the
# 2-layer tiny model learns the sum in a ~20 s warm start and generalises to held-out problems
# (an exact teacher trained to convergence reaches ~0.88 held-out greedy accuracy with 300 train
# problems); larger ranges learn several times slower. Tuned with trainer_svc.warmstart.
ARITHMETIC_MAX_OPERAND = 19
ARITHMETIC_OPS = "+"

_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def synthetic_arithmetic(
    seed: int,
    n_train: int,
    n_test: int,
    max_operand: int = ARITHMETIC_MAX_OPERAND,
    ops: str = ARITHMETIC_OPS,
) -> tuple[list[Problem], list[Problem]]:
    """Sample disjoint train and held-out sets of ``"a<op>b="`` problems.

    All problems ``a <op> b`` with ``0 <= a, b <= max_operand`` and ``op`` in ``ops`` form the
    pool; ``n_train + n_test`` distinct ones are drawn without replacement, so no problem is in
    both splits.

    Args:
        seed: the draw depends on nothing else.
        n_train: number of training problems (>= 0).
        n_test: number of held-out problems (>= 0).
        max_operand: largest operand (>= 0).
        ops: operator characters, a non-empty subset of ``"+-*"`` without repeats.

    Returns:
        ``(train, test)``, each indexed 0..n-1.

    Raises:
        ValueError: on an unknown operator, a negative size or more problems than the pool holds.
    """
    if not ops or len(set(ops)) != len(ops) or any(op not in _OPS for op in ops):
        raise ValueError(f"ops must be distinct characters from {''.join(_OPS)!r}, got {ops!r}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    if n_train < 0 or n_test < 0:
        raise ValueError(f"n_train and n_test must be >= 0, got {n_train} and {n_test}")
    m = max_operand + 1
    pool = len(ops) * m * m
    if n_train + n_test > pool:
        raise ValueError(
            f"n_train + n_test = {n_train + n_test} exceeds the {pool} distinct problems with "
            f"max_operand={max_operand} and ops={ops!r}; raise max_operand or add ops"
        )
    # Sampling indices into the implicit pool keeps large max_operand cheap (no enumeration).
    picks = random.Random(seed).sample(range(pool), n_train + n_test)

    def make(i: int, code: int) -> Problem:
        op_i, rest = divmod(code, m * m)
        a, b = divmod(rest, m)
        op = ops[op_i]
        return Problem(index=i, prompt=f"{a}{op}{b}=", answer=str(_OPS[op](a, b)))

    train = [make(i, c) for i, c in enumerate(picks[:n_train])]
    test = [make(i, c) for i, c in enumerate(picks[n_train:])]
    return train, test


# --- GSM8K ----------------------------------------------------------------------------------


def _normalize_number(s: str) -> str:
    """``"1,234"`` -> ``"1234"``, ``"42.50"`` -> ``"42.5"``, ``"42.0"`` -> ``"42"``."""
    s = s.replace(",", "")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s or "0"


def load_gsm8k_jsonl(path: str | Path) -> list[Problem]:
    """Read a GSM8K-format JSONL file.

    Each non-blank line is ``{"question": str, "answer": str}`` where the answer ends with
    ``#### <final answer>``. ``Problem.answer`` is the text after the last ``####``, stripped,
    with thousands separators removed; ``Problem.prompt`` is the question, stripped.

    Raises:
        ValueError: naming the file and 1-based line number of the first malformed line.
    """
    path = Path(path)
    problems: list[Problem] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            question, answer = record.get("question"), record.get("answer")
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"{where}: missing or empty string field 'question'")
            if not isinstance(answer, str) or "####" not in answer:
                raise ValueError(f"{where}: field 'answer' must be a string containing '####'")
            final = answer.rsplit("####", 1)[1].strip().replace(",", "")
            if not final:
                raise ValueError(f"{where}: nothing after the last '####' in 'answer'")
            problems.append(Problem(index=len(problems), prompt=question.strip(), answer=final))
    return problems


def _take(problems: list[Problem], n: int, what: str, source: str) -> list[Problem]:
    if n < 0 or n > len(problems):
        raise ValueError(f"{what}={n} but {source} has {len(problems)} usable problems")
    return [dataclasses.replace(p, index=i) for i, p in enumerate(problems[:n])]


def _gsm8k(
    *, seed: int, n_train: int, n_test: int, path: str | None, test_path: str | None
) -> tuple[list[Problem], list[Problem]]:
    if path is None:
        raise ValueError("task 'gsm8k' needs path= (a GSM8K-format JSONL file)")
    rng = random.Random(seed)
    if test_path is None:
        # One file: drop repeated questions first so the two splits cannot share a problem.
        unique = list({p.prompt: p for p in load_gsm8k_jsonl(path)}.values())
        rng.shuffle(unique)
        src = f"{path} (after removing repeated questions)"
        test = _take(unique, n_test, "n_test", src)
        train = _take(unique[n_test:], n_train, "n_train", f"{src} minus the held-out split")
        return train, test
    train_all = load_gsm8k_jsonl(path)
    rng.shuffle(train_all)
    return (
        _take(train_all, n_train, "n_train", path),
        _take(load_gsm8k_jsonl(test_path), n_test, "n_test", test_path),
    )


def _arithmetic(
    *, seed: int, n_train: int, n_test: int, path: str | None, test_path: str | None
) -> tuple[list[Problem], list[Problem]]:
    if path is not None or test_path is not None:
        raise ValueError("task 'arithmetic' is generated from the seed; do not pass path/test_path")
    return synthetic_arithmetic(seed, n_train, n_test)


TaskLoader = Callable[..., tuple[list[Problem], list[Problem]]]

TASKS: dict[str, TaskLoader] = {
    "arithmetic": _arithmetic,
    "gsm8k": _gsm8k,
}


def load_task(
    name: str,
    *,
    seed: int,
    n_train: int,
    n_test: int,
    path: str | None = None,
    test_path: str | None = None,
) -> tuple[list[Problem], list[Problem]]:
    """Load ``(train, test)`` for the task called ``name``.

    Args:
        name: a key of ``TASKS``.
        seed: fixes the draw (arithmetic) or the shuffle and split (gsm8k).
        n_train, n_test: split sizes.
        path: gsm8k only: the JSONL file. Without ``test_path`` both splits come from it,
            disjoint, split by ``seed``.
        test_path: gsm8k only: a separate held-out JSONL file (its first ``n_test`` problems).

    Raises:
        ValueError: for an unknown name (listing the valid ones) or arguments the task rejects.
    """
    try:
        loader = TASKS[name]
    except KeyError:
        raise ValueError(
            f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}"
        ) from None
    return loader(seed=seed, n_train=n_train, n_test=n_test, path=path, test_path=test_path)


# --- answer extraction ----------------------------------------------------------------------

# A number: optional sign (only when the minus is not glued to a preceding word, digit or dot,
# so "3-7" ends in "7" but "= -7" ends in "-7"), thousands groups or plain digits, decimals.
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
    """The last number in ``text``, normalized, or None when there is none.

    ``"42"`` -> ``"42"``, ``"= 42"`` -> ``"42"``, ``"-7"`` -> ``"-7"``, ``"1,234"`` -> ``"1234"``,
    ``"3.50"`` -> ``"3.5"``, ``"no idea"`` -> None.
    """
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    num = _normalize_number(matches[-1])
    return "0" if num == "-0" else num
