"""The trainer loop's state at a step boundary, and its checkpoint.

`LoopState.save` and `LoopState.restore` are a pair over the named keys of the checkpoint's
`trainer_state/trainer.json` (trainer_svc/checkpoint.py), which the resume plan reads too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.ledger import TrainerLedger
from trainer_svc import checkpoint
from trainer_svc.algorithms import LrSchedule, lr_factor
from trainer_svc.feeder import Feeder
from trainer_svc.guard import CollapseGuard
from trainer_svc.learner import Learner
from trainer_svc.staleness import StalenessBound

log = logging.getLogger(__name__)


@dataclass
class LoopState:
    """step: optimizer steps done; version: the current policy version (one per step); lr: the
    peak lr the schedule scales (algorithm.lr; a live knob; the guard lowers it); bound: the
    staleness bound; guard: the collapse guard's trajectory; feeder: its data cursor and what is
    in flight; run_id: this trainer process's (new per process, resumed or not); knobs: the live
    knobs set so far (the control watcher's settings, shared); schedule: the lr by step (from the
    spec; its position is `step`, so a resume restores it with the step); replay_lr: the lr the
    ledger recorded for each step a resume re-does (not saved: the resume plan reads it)."""

    run_id: str
    lr: float
    bound: StalenessBound
    guard: CollapseGuard
    feeder: Feeder
    knobs: dict[str, float] = field(default_factory=dict)
    step: int = 0
    version: int = 0
    schedule: LrSchedule = field(default_factory=LrSchedule)
    replay_lr: dict[int, float] = field(default_factory=dict)

    def step_lr(self, step: int, scale: float = 1.0) -> float:
        """The lr step `step` (1-based) trains with: the recorded one for a re-done step (same
        weights, data and lr give the same update), else the schedule's at `step` scaled by the
        live lr relative to algorithm.lr (lr x lr_factor, so a PATCH scales the schedule and a
        constant one gives `lr` exactly) and by `scale` (staleness_lr)."""
        if step in self.replay_lr:
            return self.replay_lr[step]
        return self.lr * lr_factor(step, self.schedule) * scale

    def save(self) -> dict[str, Any]:
        """The checkpoint's trainer state (JSON): step, policy_version, run_id, k, adaptive, lr,
        knobs, feeder, guard."""
        return {
            "step": self.step,
            "policy_version": self.version,
            "run_id": self.run_id,
            **self.bound.state(),
            "lr": self.lr,
            "knobs": dict(self.knobs),
            "feeder": self.feeder.state(),
            "guard": self.guard.state(),
        }

    def restore(self, saved: dict[str, Any]) -> dict[str, float]:
        """The inverse of `save`, except for what a new process has of its own: its run id, and
        the feeder, which the resume plan restores from the newer feed journal. Returns the knobs
        the saved loop had been set (the caller applies those set since)."""
        self.step, self.version = int(saved["step"]), int(saved["policy_version"])
        self.bound.restore(saved)
        self.lr = float(saved["lr"])
        self.guard.restore(saved["guard"])
        return dict(saved["knobs"])

    def checkpoint(self, learner: Learner, root: str, job_id: str, ledger: TrainerLedger) -> Path:
        """The policy at this step boundary with this state, one of the guard's trajectory: an
        HF-format directory (model + tokenizer) plus `trainer_state/` (optimizer, RNG, `save()`),
        written atomically; only then recorded in the ledger."""
        self.guard.checkpointed(self.step)
        final = checkpoint.step_dir(root, job_id, self.step)
        weights, optimizer = learner.full_state()
        stats = checkpoint.save(
            final, learner.model, learner.tokenizer, optimizer, {"job_id": job_id, **self.save()}, model_state=weights
        )
        ledger.record_checkpoint(job_id, self.step, self.version, str(final.resolve()))
        log.info("checkpoint %s: %.1f MB in %.2fs", final, stats["bytes"] / 1e6, stats["seconds"])
        return final
