"""Tasks: the problem record, the synthetic arithmetic generator and the answer extractor.

Pure Python on purpose (no torch, vLLM or transformers): the API, the reward service and the
trainer all import it. The loader that turns a job's ``task`` section into problems is
``shared.datasets.load_task``; the built-in tasks are presets of it:

- ``arithmetic``: synthetic ``"a+b="`` problems from ``synthetic_arithmetic``, short and
  character-level friendly, for the tiny locally built model (``asyncrl.tiny_model``). The
  defaults are tuned so that a short supervised warm start leaves the policy weak greedily but
  often right when sampling, which is the regime where GRPO visibly lifts held-out accuracy
  within a few hundred steps.
- ``gsm8k``: grade-school word problems from a GSM8K-format file; ``gsm8k_final_answer`` turns
  its ``answer`` column into the reference answer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ARITHMETIC_MAX_OPERAND",
    "ARITHMETIC_OPS",
    "Problem",
    "extract_answer",
    "gsm8k_final_answer",
    "synthetic_arithmetic",
]


@dataclass(frozen=True)
class Problem:
    """One problem.

    Attributes:
        index: position of the problem in the list it was returned in (for a loaded file before
            splitting: its row among the file's rows). Stable for a given seed.
        prompt: the user text the policy is conditioned on, e.g. ``"17+25="``, after the job's
            ``prompt_template``; for a model without a chat template exactly what it sees.
        answer: the canonical final answer, e.g. ``"42"``; compared with ``extract_answer`` of a
            completion for an exact-match reward. ``""`` when the job has no reference answer.
        metadata: the row's other columns, JSON-like (str, int, float, bool, None, lists and
            dicts of those): test cases, ids, difficulty. The reward receives it. Read-only by
            convention (a plain dict so that it serialises).
        messages: the chat conversation (``{"role", "content"}`` dicts) when the job gives a
            system prompt or reads a messages column: the system turn first, the user turn last.
            None for plain-text problems.
        source: the name of the dataset the problem came from (mixing, logs).
        origin: where its row is, for error messages (``"data.jsonl line 17"``); "" when made
            in code. Not compared.
    """

    index: int
    prompt: str
    answer: str
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)
    messages: tuple[dict[str, str], ...] | None = field(default=None, hash=False)
    source: str = ""
    origin: str = field(default="", compare=False)


# --- arithmetic -----------------------------------------------------------------------------

# Operands 0..19, addition only: 400 distinct problems, answers 0..38. Small enough that the
# 2-layer tiny model learns the sum in a ~20 s warm start and generalises to held-out problems
# (an exact teacher trained to convergence reaches ~0.88 held-out greedy accuracy with 300 train
# problems); larger ranges learn several times slower. Tuned with asyncrl.warmstart.
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


def gsm8k_final_answer(answer: str) -> str:
    """The final answer of a GSM8K ``answer`` text: after the last ``####``, stripped, without
    thousands separators (``"... #### 1,234 "`` -> ``"1234"``).

    Raises:
        ValueError: the text has no ``####`` or nothing after the last one.
    """
    if "####" not in answer:
        raise ValueError("must be a string containing '####' before the final answer")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise ValueError("has nothing after the last '####'")
    return final


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
