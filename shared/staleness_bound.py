"""The staleness bound k a job starts from, the in-flight budget it sets, and admission by version.

One rule for every reader: the trainer's bound (trainer_svc/staleness.py `StalenessBound`, the
only writer of k while a job runs) starts here, and `broker verify` reports the nominal in-flight
bound from the same rule. Plain values in: a stored spec (a JSON dict) is read by
shared/jobspec.py `stored_spec`, whose JobSpec holds the defaults.

Admission by version (ARCHITECTURE.md, "Staleness: admission by version"). The trainer's sink
trains groups in feed order, `prompts_per_step` per step, skipping only the ones it drops. So a
group fed while the trainer holds version v with `ahead` groups in flight in front of it is
trained at version v + ahead // prompts_per_step at the latest (`slot_versions`): groups in front
of it only ever leave. The feeder fills the slots of the versions v .. v + k, P per version, and
stamps each group with its slot's version (`PromptGroup.train_version`); a result is fresh when
trained at version t if the policy that generated it is at least t - k (`admission_floor`). A
generator holding at least that version (`min_generation_version`) therefore produces a sample
that is never dropped for staleness, with no counting in the generators and no coordination
between them.
"""

from __future__ import annotations


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


def slot_versions(version: int, bound: int, prompts_per_step: int, in_flight: int) -> list[int]:
    """The trainer versions of the free feeder slots, in feed order: the groups in flight fill the
    slots of versions version .. version + bound in feed order, `prompts_per_step` per version, and
    the slot at position i (groups ahead of it) belongs to version + i // prompts_per_step. Empty
    once `in_flight` reaches `groups_in_flight(bound, prompts_per_step)` (or exceeds it, after the
    bound was lowered: the groups beyond it are trained in their turn, or dropped if too stale).

    >>> slot_versions(5, 1, 2, 1)  # k = 1, 2 per step, 1 in flight: one slot left at v5, two at v6
    [5, 6, 6]
    """
    return [version + i // prompts_per_step for i in range(in_flight, groups_in_flight(bound, prompts_per_step))]


def admission_floor(train_version: int, bound: int) -> int:
    """The oldest policy version whose samples are still fresh when trained at `train_version`
    under bound k (staleness = trainer version - generating version <= k)."""
    return train_version - bound


def min_generation_version(
    fed_version: int, train_version: int | None, bound: int | None, newest: int | None = None
) -> int:
    """The policy version a generator must hold before generating a training group: at least the
    version it was fed at (sync mode relies on it), and at least the group's admission floor under
    the trainer's current bound when the group and the trainer say what those are. The floor is
    capped at `newest`, the newest version announced: past it (the bound was lowered after the
    group was fed) waiting could deadlock, since the trainer may need this very group to get
    there; the newest policy is then the freshest there is, and the sink's bound drops the group
    if it is still too stale.

    >>> min_generation_version(4, 6, 1)  # fed at v4 for v6, k = 1: v5 or newer
    5
    >>> min_generation_version(4, 6, 1, newest=4)  # v5 not published yet: the newest, v4
    4
    """
    if train_version is None or bound is None:
        return fed_version
    floor = admission_floor(train_version, bound)
    if newest is not None:
        floor = min(floor, newest)
    return max(fed_version, floor)


def in_flight_samples(bound: int, prompts_per_step: int, group_size: int, eval_problems: int) -> int:
    """Samples one trainer run may have in flight under bound k: the groups of `groups_in_flight`,
    group_size each, plus one evaluation round of `eval_problems` problems (a job spec's n_test).

    >>> in_flight_samples(1, 2, 2, 2)  # (1 + 1) * 2 groups of 2, plus 2 held-out problems
    10
    """
    return groups_in_flight(bound, prompts_per_step) * group_size + eval_problems
