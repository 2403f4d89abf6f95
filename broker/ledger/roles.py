"""The ledger as each service sees it: one `Protocol` per role, listing exactly the methods that
role calls, so the services' seams are typed (mypy checks every call) without tying them to the
whole `Ledger`. `Ledger` satisfies each of them (checked below, and by mypy at every call site that
hands one over); a test double need only implement its role's methods.

- `GeneratorLedger`: generator_svc (the loads of policy versions, the generated samples).
- `RewardLedger`: reward_svc (the generated samples a generator may not have written, the scores).
- `TrainerLedger`: trainer_svc (the job's state, the samples' use, steps, versions, checkpoints,
  evals, changes, and the reads a resume plans from).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from typing_extensions import Unpack

from broker.ledger.rows import (
    EvalRow,
    PolicyVersionRow,
    SampleFilters,
    SampleIn,
    SampleRow,
    ScoredItem,
    StepInputIn,
    TrainStepRow,
    UsedItem,
)

__all__ = ["GeneratorLedger", "RewardLedger", "TrainerLedger"]


class GeneratorLedger(Protocol):
    """What generator_svc writes: the policy versions it loads, the samples it generates."""

    def record_generator_load(
        self, job_id: str, version: int, generator_id: str, fingerprint: str | None = None
    ) -> bool: ...

    def record_generated(self, rows: Sequence[SampleIn]) -> int: ...


class RewardLedger(Protocol):
    """What reward_svc writes: the generated samples (a generator may have died before writing
    them), then their scores."""

    def record_generated(self, rows: Sequence[SampleIn]) -> int: ...

    def record_scored_ids(self, items: Sequence[ScoredItem]) -> set[str]: ...


class TrainerLedger(Protocol):
    """What trainer_svc reads and writes."""

    # the job
    def move_job(self, job_id: str, from_states: Iterable[str], state: str, error: str | None = None) -> bool: ...

    def mark_job_started(self, job_id: str) -> None: ...

    def record_change(self, job_id: str, actor: str, changes: dict[str, Any]) -> None: ...

    # samples
    def record_generated(self, rows: Sequence[SampleIn]) -> int: ...

    def record_used(self, items: Sequence[UsedItem]) -> int: ...

    def samples(
        self, job_id: str, *, limit: int | None = None, offset: int = 0, **filters: Unpack[SampleFilters]
    ) -> list[SampleRow]: ...

    def used_msg_ids(self, job_id: str, msg_ids: Iterable[str]) -> set[str]: ...

    # steps, versions, checkpoints, evals
    def record_train_step(
        self, job_id: str, step: int, policy_version: int, metrics: dict[str, Any], *, job_step: bool = False
    ) -> None: ...

    def last_train_step(self, job_id: str) -> TrainStepRow | None: ...

    def record_step_input(self, row: StepInputIn) -> None: ...

    def train_steps(self, job_id: str) -> list[TrainStepRow]: ...

    def record_policy_version(self, job_id: str, version: int, checksum: str, num_bytes: int) -> bool: ...

    def policy_versions(self, job_id: str) -> list[PolicyVersionRow]: ...

    def record_checkpoint(self, job_id: str, step: int, policy_version: int, path: str) -> None: ...

    def record_eval(
        self,
        job_id: str,
        step: int,
        vmin: int,
        vmax: int,
        reward_mean: float,
        n: int,
        source: str = "pipeline",
        name: str = "held_out",
        metrics: dict[str, Any] | None = None,
        wall_s: float | None = None,
    ) -> None: ...

    def evals(self, job_id: str, source: str | None = None) -> list[EvalRow]: ...


if TYPE_CHECKING:
    from broker.ledger.core import Ledger

    def _ledger_plays_every_role(ledger: Ledger) -> tuple[GeneratorLedger, RewardLedger, TrainerLedger]:
        return ledger, ledger, ledger
