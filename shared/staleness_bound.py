"""The staleness bound k a job starts from, and the in-flight budget it sets.

One rule for every reader: the trainer's bound (trainer_svc/staleness.py `StalenessBound`, the
only writer of k while a job runs) starts here, and `broker verify` reports the nominal in-flight
bound from the same rule. Plain values in, so a stored spec (a JSON dict) needs no validation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def start_bound(mode: str, max_staleness: int, adaptive_k_max: int | None) -> int:
    """The bound a trainer starts from: sync mode is async with k = 0; an adaptive bound (async
    only) starts at its loosest, k_max, and never exceeds it; else the spec's max_staleness."""
    if mode == "sync":
        return 0
    if adaptive_k_max is not None:
        return adaptive_k_max
    return max_staleness


def groups_in_flight(bound: int, prompts_per_step: int) -> int:
    """Training groups the feeder keeps outstanding under bound k: (k + 1) * prompts_per_step."""
    return (bound + 1) * prompts_per_step


def in_flight_samples(spec: Mapping[str, Any]) -> int:
    """Samples one trainer run may have in flight for a job spec as stored (JSON): the groups of
    `groups_in_flight` at the starting bound, group_size each, plus one evaluation round of the
    task's n_test problems.

    Raises:
        KeyError, TypeError, ValueError: the spec lacks prompts_per_step or group_size, or holds
            non-numbers.
    """
    adaptive = spec.get("adaptive_staleness")
    k = start_bound(str(spec.get("mode", "async")), int(spec.get("max_staleness", 1)),
                    None if not adaptive else int(adaptive.get("k_max", 4)))
    evals = int((spec.get("task") or {}).get("n_test", 0))
    return groups_in_flight(k, int(spec["prompts_per_step"])) * int(spec["group_size"]) + evals
