"""The experiment-tracking sinks by name: what a job spec (`tracking.sinks`) and the trainer's
settings (`TRAINER_TRACKING`) may choose. trainer_svc/tracking.py has one class per name (a test
keeps the two in step); nothing here imports a sink's library."""

from __future__ import annotations

from typing import Literal, get_args

TrackingSink = Literal["tensorboard", "mlflow", "wandb"]
TRACKING_SINKS: tuple[str, ...] = get_args(TrackingSink)
