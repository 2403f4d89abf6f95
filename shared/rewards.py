"""Reward functions, selected by name from the job spec. Pure: (completion text, reference answer) -> float.

In `shared` (no torch, vLLM or Redis) because the reward service scores with them and so does the
broker's offline checkpoint evaluation.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.tasks import extract_answer

RewardFn = Callable[[str, str], float]


def _norm_number(s: str) -> str:
    s = s.strip().replace(",", "")
    try:
        f = float(s)
    except ValueError:
        return s
    return str(int(f)) if f.is_integer() else repr(f)


def exact_match(completion: str, answer: str) -> float:
    """1.0 if the last number in the completion equals the reference number, else 0.0."""
    got = extract_answer(completion)
    return 1.0 if got is not None and _norm_number(got) == _norm_number(answer) else 0.0


def math_verify(completion: str, answer: str) -> float:
    """Mathematical equivalence via the `math-verify` library (fractions, LaTeX, sets, ...)."""
    from math_verify import parse, verify

    gold = parse(answer)
    pred = parse(completion)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


REWARD_FUNCTIONS: dict[str, RewardFn] = {"exact_match": exact_match, "math_verify": math_verify}


def get_reward_fn(name: str) -> RewardFn:
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown reward function '{name}'; valid: {sorted(REWARD_FUNCTIONS)}") from None
