"""The built-in reward functions, by name: (completion text, reference answer) -> float.

In `shared` (no torch, vLLM or Redis) because the reward service scores with them and so does the
offline checkpoint evaluation. They follow the user-function convention of shared.rewards.python
(positional completion and answer), so the registry runs them like any plug-in.
"""

from __future__ import annotations

import decimal
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from shared.sandbox import run_python
from shared.tasks import extract_answer

RewardFn = Callable[..., float]  # (completion, answer) plus the keywords it names


def _norm_number(s: str) -> decimal.Decimal | str:
    """A number as an exact decimal (``"1,234"``, ``"1234.0"`` and ``"1.234e3"`` are equal; two
    20-digit integers that differ in the last digit are not, as they would be through a float),
    else the stripped text."""
    s = s.strip().replace(",", "")
    try:
        d = decimal.Decimal(s)
    except decimal.InvalidOperation:
        return s
    return d if d.is_finite() else s


def exact_match(completion: str, answer: str) -> float:
    """1.0 if the last number in the completion equals the reference number, else 0.0."""
    got = extract_answer(completion)
    return 1.0 if got is not None and _norm_number(got) == _norm_number(answer) else 0.0


def math_verify(completion: str, answer: str) -> float:
    """Mathematical equivalence via the `math-verify` library (fractions, LaTeX, sets, ...)."""
    from math_verify import parse, verify

    # math-verify's own 5 s limits use SIGALRM, which only the main thread may set; elsewhere (the
    # reward service's threads with REWARD_WORKERS=0) the caller's time budget bounds the call.
    limit: int | None = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer, parsing_timeout=limit)
    pred = parse(completion, parsing_timeout=limit)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=limit) else 0.0


_CODE_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_program(completion: str) -> str:
    """The last fenced code block (```python, ```py or a bare ```) of a completion, else all of it."""
    blocks = _CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def python_exec(completion: str, answer: str) -> float:
    """1.0 if the completion's program, run in the sandbox (shared.sandbox: kernel namespaces and
    seccomp, no network, CPU, memory, process, file and wall-clock limits), exits normally and the
    last non-empty line of its stdout equals the reference answer (numbers compared as in
    exact_match), else 0.0.

    Raises:
        SandboxUnavailable: no kernel confinement on this machine (see shared.sandbox).
    """
    res = run_python(extract_program(completion))
    if not res.ok:
        return 0.0
    lines = [line.strip() for line in res.stdout.splitlines() if line.strip()]
    return 1.0 if lines and _norm_number(lines[-1]) == _norm_number(answer) else 0.0


def environment(completion: str, answer: str, *, episode: Mapping[str, float]) -> float:
    """The environment's own reward for a multi-turn episode: the sum of its per-turn rewards
    (StepResult.reward; 0.0 where it gave none). As a term of a `sum` reward beside a verifier
    it adds the environment's view to a verifier's."""
    return float(episode.get("reward", 0.0))


def reasoning_gym(completion: str, answer: str, *, metadata: Mapping[str, Any]) -> float:
    """A reasoning-gym task's own ``score_answer(answer, entry)`` (shared.gym.score_completion):
    the answer is the completion's last ``<answer>...</answer>``, else the whole completion,
    stripped; the entry is the problem's metadata that a ``reasoning_gym`` task gives."""
    from shared.gym import score_completion  # imports reasoning-gym: only for jobs that use it

    return score_completion(completion, metadata)


def verifiers(completion: str, answer: str, *, metadata: Mapping[str, Any], episode: Mapping[str, float]) -> Any:
    """A verifiers task's own rubric (shared.vfenv.score_sample): each reward function's score a
    named component, the reward their weighted sum; read from the episode the `verifiers`
    environment scored, or scored here for a single-turn completion."""
    from shared.vfenv import score_sample  # imports verifiers: only for jobs that use it

    return score_sample(completion, metadata, episode)


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "environment": environment,
    "exact_match": exact_match,
    "math_verify": math_verify,
    "python_exec": python_exec,
    "reasoning_gym": reasoning_gym,
    "verifiers": verifiers,
}


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward function by name.

    Raises:
        ValueError: no built-in has that name (the message lists the valid ones).
    """
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown reward function '{name}'; valid: {sorted(REWARD_FUNCTIONS)}") from None
