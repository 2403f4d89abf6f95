"""Experiment tracking: a job's run in the metric sinks its spec (`tracking.sinks`) or the trainer's
settings (`TRAINER_TRACKING`) choose, fed by the trainer's main rank.

Each sink gets the job spec as its config when the run opens, every step's metrics (numbers only)
at their step, every evaluation round (`eval/<set>/reward_mean` and the round's figures) at the
step it evaluated, the run's changes (live knobs, collapse-guard trips) as text at their step, and
a close (flush) when the trainer stops. Under TRAINER_TRACKING_DIR (default runs/tracking):

    tensorboard/<project>/<job id>/events.out.tfevents.*    tensorboard --logdir <dir>/tensorboard
    mlruns/                  the MLflow file store (TRAINER_MLFLOW_URI for another); experiment
                             <project>, one run per job: mlflow ui --backend-store-uri <dir>/mlruns
    wandb/offline-run-*-<job id>/run-<job id>.wandb         wandb sync (upload), wandb leet (look)

No sink is required and none is imported unless chosen: each class imports its library when it
opens. A sink that fails never fails training: `Tracking` logs a warning the first time one fails
(a sink that cannot open is left out) and goes on; the close reports how many calls failed.

A restarted trainer continues the job's run: TensorBoard purges the steps it re-does, MLflow
reopens the job's run (found by its `asyncrl.job_id` tag), W&B resumes the job's run id (an offline
run writes a new directory; `wandb sync` appends it to the same run).
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from shared.jobspec import JobSpec
from shared.settings import TrainerSettings

log = logging.getLogger(__name__)


class Tracker(Protocol):
    """One sink's run, opened with the job's config."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Numbers at `step` (a step's metrics, or an evaluation round's)."""

    def change(self, step: int, kind: str, change: Mapping[str, Any]) -> None:
        """A change to the run at `step`: `kind` is `knobs` (live knobs) or `guard` (a trip)."""

    def close(self, ok: bool) -> None:
        """Flush and close; `ok`: the trainer stopped without an error."""


@dataclass(frozen=True)
class RunInfo:
    """What every sink names the run by and where it writes."""

    job_id: str
    project: str
    name: str
    dir: Path
    start_step: int = 0  # a resumed trainer's checkpointed step: the steps after it are re-done

    @property
    def key(self) -> str:
        """The job id as a file name and a W&B run id."""
        return re.sub(r"[^A-Za-z0-9_.-]", "-", self.job_id) or "job"


def _text(value: Any, limit: int) -> str:
    out = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"algorithm": {"lr": 1e-6}} -> {"algorithm.lr": 1e-6}; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, Mapping) and v:
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


class TensorBoardTracker:
    """Event files under <dir>/tensorboard/<project>/<job id>: scalars, the config and changes as text."""

    def __init__(self, run: RunInfo, config: Mapping[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run.dir / "tensorboard" / run.project / run.key
        # purge_step: TensorBoard hides what an earlier trainer wrote from this step on (the re-done steps)
        self.writer = SummaryWriter(
            str(self.path), purge_step=run.start_step + 1 if run.start_step else None, flush_secs=30
        )
        self.writer.add_text("config", f"```json\n{json.dumps(config, indent=1, sort_keys=True)}\n```", run.start_step)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def change(self, step: int, kind: str, change: Mapping[str, Any]) -> None:
        self.writer.add_text(
            f"changes/{kind}", f"```json\n{json.dumps(change, sort_keys=True, default=str)}\n```", step
        )

    def close(self, ok: bool) -> None:
        self.writer.close()


class MlflowTracker:
    """The job's run in experiment <project>: metrics with their steps, the spec flattened into
    params, changes as tags `change.<step>.<kind>`."""

    JOB_TAG = "asyncrl.job_id"

    def __init__(self, run: RunInfo, config: Mapping[str, Any], uri: str):
        if "://" not in uri or uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode behind this opt-in; it is our default
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self._metric, self._tag = Metric, RunTag
        self.client = client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(run.project)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(run.project)
        found = client.search_runs([exp_id], filter_string=f"tags.`{self.JOB_TAG}` = '{run.key}'", max_results=1)
        if found:  # a restarted trainer: the job's run goes on
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
            have = found[0].data.params
        else:
            self.run_id = client.create_run(exp_id, run_name=run.name, tags={self.JOB_TAG: run.key}).info.run_id
            have = {}
        # params cannot change once logged: a resumed run keeps its first (the spec's live knobs are changes)
        params = [Param(self._key(k), _text(v, 6000)) for k, v in _flat(config).items() if self._key(k) not in have]
        for i in range(0, len(params), 100):
            client.log_batch(self.run_id, params=params[i : i + 100])

    @staticmethod
    def _key(name: str) -> str:
        """MLflow's key alphabet: letters, digits, _ - . / space (mean@4 -> mean_at_4)."""
        return re.sub(r"[^/\w.\- ]", "_", name.replace("@", "_at_"))[:250]

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        ts = int(time.time() * 1000)
        batch = [self._metric(self._key(k), v, ts, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def change(self, step: int, kind: str, change: Mapping[str, Any]) -> None:
        self.client.set_tag(self.run_id, f"change.{step:06d}.{kind}", _text(dict(change), 8000))

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class WandbTracker:
    """A W&B run with the job's id (offline by default: files under <dir>/wandb, no network, no
    login); every key is plotted against `trainer/step`, so a round logged late lands at its step."""

    STEP = "trainer/step"

    def __init__(self, run: RunInfo, config: Mapping[str, Any], mode: Literal["offline", "online"]):
        import wandb

        run.dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            console="off",
            silent=True,
            x_disable_stats=True,
            disable_git=True,
            save_code=False,
            x_save_requirements=False,
        )
        self.run = wandb.init(
            mode=mode,
            dir=str(run.dir),
            project=run.project,
            name=run.name,
            id=run.key,
            resume="allow",
            config=dict(config),
            reinit="create_new",
            settings=settings,
        )
        self.run.define_metric(self.STEP)
        self.run.define_metric("*", step_metric=self.STEP)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({**metrics, self.STEP: step})

    def change(self, step: int, kind: str, change: Mapping[str, Any]) -> None:
        self.run.log({f"changes/{kind}": json.dumps(change, sort_keys=True, default=str), self.STEP: step})

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


def _openers(settings: TrainerSettings) -> dict[str, Callable[[RunInfo, Mapping[str, Any]], Tracker]]:
    """One opener per sink name (shared/tracking.py TRACKING_SINKS)."""
    mlflow_uri = settings.mlflow_uri or (Path(settings.tracking_dir) / "mlruns").resolve().as_uri()
    return {
        "tensorboard": TensorBoardTracker,
        "mlflow": lambda run, config: MlflowTracker(run, config, mlflow_uri),
        "wandb": lambda run, config: WandbTracker(run, config, settings.wandb_mode),
    }


class Tracking:
    """The job's trackers, fed together; one that raises is warned about once and skipped for that
    call, never the trainer's failure. With no sinks every call is a no-op."""

    def __init__(self, trackers: Mapping[str, Tracker] | None = None):
        self.trackers = dict(trackers or {})
        self.failures: dict[str, int] = {}

    @classmethod
    def open(cls, settings: TrainerSettings, job_id: str, spec: JobSpec, start_step: int = 0) -> Tracking:
        """The sinks the spec and the settings choose, each opened with the spec as its config."""
        chosen = list(dict.fromkeys([*spec.tracking.sinks, *settings.tracking]))
        if not chosen:
            return cls()
        run = RunInfo(
            job_id,
            spec.tracking.project,
            spec.tracking.run_name or f"{spec.name}-{job_id}",
            Path(settings.tracking_dir),
            start_step,
        )
        config = {"job_id": job_id, **spec.model_dump(mode="json")}
        openers, trackers = _openers(settings), dict[str, Tracker]()
        for name in chosen:
            t0 = time.perf_counter()
            try:
                trackers[name] = openers[name](run, config)
            except Exception as exc:  # a missing package, a bad URI, a full disk: the job trains on
                log.warning(
                    "tracking: %s left out, it did not open (%s: %s)%s",
                    name,
                    type(exc).__name__,
                    exc,
                    " - pip install asyncrl[tracking]" if isinstance(exc, ImportError) else "",
                )
                continue
            log.info("tracking: %s opened in %.2fs", name, time.perf_counter() - t0)
        return cls(trackers)

    def _each(self, call: Callable[[Tracker], None]) -> None:
        for name, tracker in self.trackers.items():
            try:
                call(tracker)
            except Exception as exc:
                if name not in self.failures:
                    log.warning(
                        "tracking: %s failed (%s: %s); training goes on, later failures are counted",
                        name,
                        type(exc).__name__,
                        exc,
                    )
                self.failures[name] = self.failures.get(name, 0) + 1

    def step(self, step: int, metrics: Mapping[str, Any]) -> None:
        """A step's metrics; only the numbers."""
        if self.trackers:
            numbers_only = {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real)}
            self._each(lambda t: t.log(step, numbers_only))

    def eval(self, step: int, name: str, reward_mean: float, metrics: Mapping[str, Any] | None = None) -> None:
        """An evaluation round of set `name` on the policy after `step`."""
        figures = {"reward_mean": reward_mean, **(metrics or {})}
        self.step(step, {f"eval/{name}/{k}": v for k, v in figures.items()})

    def change(self, step: int, kind: str, change: Mapping[str, Any]) -> None:
        """A change to the run: `knobs` (live knobs applied) or `guard` (a collapse-guard trip)."""
        self._each(lambda t: t.change(step, kind, change))

    def close(self, ok: bool = True) -> None:
        self._each(lambda t: t.close(ok))
        for name, n in self.failures.items():
            log.warning("tracking: %s failed %d time(s) in this run", name, n)
        self.trackers.clear()

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.close(ok=exc_type is None)
