"""Evaluation metrics over n samples per problem: mean@n, pass@k (unbiased), maj@k; episode means. Pure.

Shared by the trainer's in-pipeline rounds and the offline checkpoint evaluation, so the two
figures of one step are computed alike.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

from shared.tasks import extract_answer


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. 2021 (Codex, eq. 1): the probability that at
    least one of k samples drawn without replacement from n, c of them correct, is correct:
    1 - C(n - c, k) / C(n, k).

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def answer_key(completion: str) -> str:
    """What two completions must share to count as the same answer in a majority vote: the final
    number when there is one, else the stripped text."""
    num = extract_answer(completion)
    return num if num is not None else completion.strip()


def majority_correct(completions: Sequence[str], rewards: Sequence[float], threshold: float) -> float:
    """1.0 if the most frequent answer among `completions` (ties: the one seen first) belongs to
    a sample whose reward reaches `threshold`, else 0.0 (maj@k over these k samples)."""
    keys = [answer_key(c) for c in completions]
    counts = Counter(keys)
    top = max(counts.values())
    winner = next(k for k in keys if counts[k] == top)
    return 1.0 if any(r >= threshold for k, r in zip(keys, rewards, strict=True) if k == winner) else 0.0


def round_metrics(
    problems: Sequence[tuple[Sequence[str], Sequence[float]]], ks: Sequence[int], threshold: float
) -> dict[str, float]:
    """Metrics of one evaluation round: per problem its completions and rewards (n each).

    Returns `mean@n` (mean reward over every sample), `pass@k` for each k <= n, and `maj@n` when
    n > 1; each averaged over problems. A sample is correct when its reward >= threshold.

    Raises:
        ValueError: no problems, or problems with different numbers of samples.
    """
    if not problems:
        raise ValueError("an evaluation round needs at least one problem")
    ns = {len(r) for _, r in problems}
    if len(ns) != 1:
        raise ValueError(f"every problem of a round needs the same number of samples, got {sorted(ns)}")
    (n,) = ns
    out = {f"mean@{n}": sum(sum(r) for _, r in problems) / (n * len(problems))}
    for k in sorted({k for k in ks if 1 <= k <= n}):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(x >= threshold for x in r), k) for _, r in problems) / len(problems)
    if n > 1:
        out[f"maj@{n}"] = sum(majority_correct(c, r, threshold) for c, r in problems) / len(problems)
    return out


def episode_means(per_sample: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """`env/<key>`: each episode metric's mean over the samples that carry it (Rollout.env_metrics;
    a single-turn sample carries none, and nothing is returned for a batch of them)."""
    sums: dict[str, list[float]] = {}
    for m in per_sample:
        for k, v in m.items():
            sums.setdefault(k, []).append(v)
    return {f"env/{k}": math.fsum(v) / len(v) for k, v in sums.items()}
