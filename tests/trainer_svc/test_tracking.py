"""Experiment tracking (trainer_svc/tracking.py): each sink writes what a user opens, read back with
the sink's own reader — a TensorBoard event file through EventAccumulator, an MLflow run through
MlflowClient, a W&B offline run directory and its records — no sink is imported unless chosen, and
a sink that fails never fails training."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from shared.jobspec import JobSpec, format_validation_error
from shared.settings import TrainerSettings
from shared.tracking import TRACKING_SINKS
from trainer_svc.tracking import Tracking, _openers

REPO = Path(__file__).resolve().parents[2]
JOB = "0123456789ab"


def _open(tmp_path: Path, sinks: list[str], start_step: int = 0, **spec: Any) -> Tracking:
    settings = TrainerSettings(tracking_dir=str(tmp_path / "tracking"))
    job = JobSpec(model_path="models/tiny", name="tiny", tracking={"sinks": sinks, "project": "proj"}, **spec)
    tracking = Tracking.open(settings, JOB, job, start_step)
    assert sorted(tracking.trackers) == sorted(sinks)
    return tracking


def _feed(t: Tracking) -> None:
    """Three steps, the evaluation rounds of steps 0 and 2 recorded late, a knob change and a trip."""
    t.eval(0, "held_out", 0.25, None)
    for step in (1, 2, 3):
        t.step(
            step,
            {
                "loss": 0.5 / step,
                "reward/mean": 0.1 * step,
                "off_policy/max": step - 1,
                "note": "text",
                "flag": True,
                "grad_norm": float("nan") if step == 1 else 1.0,
            },
        )
        if step == 2:
            t.change(2, "knobs", {"lr": 1e-5})
    t.eval(2, "held_out", 0.5, {"mean@4": 0.5, "pass@4": 0.75})
    t.change(3, "guard", {"kind": "reward_collapse", "step": 3, "lr": 5e-6})
    t.close()
    assert not t.failures  # a failing sink is only a warning: here none may fail


# --- nothing unless chosen ------------------------------------------------------------------------


def test_no_sink_library_is_imported_unless_chosen():
    code = (
        "import sys\n"
        "from shared.jobspec import JobSpec\n"
        "from shared.settings import TrainerSettings\n"
        "import trainer_svc.train, trainer_svc.tracking as tr\n"
        "t = tr.Tracking.open(TrainerSettings(), 'job', JobSpec(model_path='m'))\n"
        "t.step(1, {'loss': 1.0}); t.eval(0, 'held_out', 0.5); t.change(1, 'knobs', {'lr': 1.0}); t.close()\n"
        "assert not t.trackers\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'mlflow', 'tensorboard', 'tensorboardX')"
        " or m.startswith('torch.utils.tensorboard')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_sink_name_has_a_tracker():
    assert set(_openers(TrainerSettings())) == set(TRACKING_SINKS) == {"tensorboard", "mlflow", "wandb"}


# --- choosing sinks -------------------------------------------------------------------------------


def test_unknown_or_repeated_sink_is_refused_naming_the_field():
    with pytest.raises(ValidationError) as err:
        JobSpec(model_path="m", tracking={"sinks": ["tensorboard", "comet"]})
    (e,) = format_validation_error(err.value)
    assert e["field"] == "tracking.sinks.1" and "'tensorboard', 'mlflow' or 'wandb'" in e["message"]
    with pytest.raises(ValidationError, match="must not repeat"):
        JobSpec(model_path="m", tracking={"sinks": ["mlflow", "mlflow"]})
    with pytest.raises(ValidationError):
        JobSpec(model_path="m", tracking={"project": "../up"})
    with pytest.raises(ValidationError):
        TrainerSettings(tracking="tensorboard,comet")
    assert JobSpec(model_path="m").tracking.sinks == []  # none by default


def test_the_settings_add_sinks_for_every_job(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_TRACKING", "tensorboard, tensorboard")
    monkeypatch.setenv("TRAINER_TRACKING_DIR", str(tmp_path))
    settings = TrainerSettings()
    assert settings.tracking == ("tensorboard",)
    t = Tracking.open(settings, JOB, JobSpec(model_path="m"))
    assert list(t.trackers) == ["tensorboard"]
    t.close()
    assert list((tmp_path / "tensorboard" / "asyncrl" / JOB).glob("events.out.tfevents.*"))


# --- a failing sink -------------------------------------------------------------------------------


class _Boom:
    def log(self, step, metrics):
        raise OSError("disk full")

    def change(self, step, kind, change):
        raise OSError("disk full")

    def close(self, ok):
        raise OSError("disk full")


class _Recorder:
    def __init__(self):
        self.calls: list[tuple] = []

    def log(self, step, metrics):
        self.calls.append(("log", step, dict(metrics)))

    def change(self, step, kind, change):
        self.calls.append(("change", step, kind, dict(change)))

    def close(self, ok):
        self.calls.append(("close", ok))


def test_a_failing_sink_is_warned_about_once_and_training_goes_on(caplog):
    good = _Recorder()
    t = Tracking({"bad": _Boom(), "good": good})
    with caplog.at_level(logging.WARNING, logger="trainer_svc.tracking"), t:
        for step in (1, 2, 3):
            t.step(step, {"loss": 1.0, "name": "x"})
        t.change(3, "knobs", {"lr": 1e-5})
        t.eval(3, "held_out", 0.5, {"pass@2": 1.0})
    assert good.calls == [
        ("log", 1, {"loss": 1.0}),
        ("log", 2, {"loss": 1.0}),
        ("log", 3, {"loss": 1.0}),
        ("change", 3, "knobs", {"lr": 1e-5}),
        ("log", 3, {"eval/held_out/reward_mean": 0.5, "eval/held_out/pass@2": 1.0}),
        ("close", True),
    ]
    failed = [r.getMessage() for r in caplog.records if "bad failed (OSError: disk full)" in r.getMessage()]
    assert len(failed) == 1  # once, not once per call
    assert any("bad failed 6 time(s)" in r.getMessage() for r in caplog.records)


def test_a_sink_that_cannot_open_is_left_out(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises ImportError
    settings = TrainerSettings(tracking_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="trainer_svc.tracking"):
        t = Tracking.open(settings, JOB, JobSpec(model_path="m", tracking={"sinks": ["wandb", "tensorboard"]}))
    assert list(t.trackers) == ["tensorboard"]
    assert any(
        "wandb left out" in r.getMessage() and "pip install asyncrl[tracking]" in r.getMessage() for r in caplog.records
    )
    t.step(1, {"loss": 1.0})
    t.close(ok=False)


def test_the_loop_records_guard_trips_and_knobs_in_the_tracking():
    """Parts' verbs feed the tracking: a trip (with its ledger record) and live knobs."""
    from trainer_svc.parts import Parts

    rec, changes = _Recorder(), []
    parts: Any = SimpleNamespace(
        job_id=JOB,
        tracking=Tracking({"rec": rec}),
        ledger=SimpleNamespace(record_change=lambda job, actor, change: changes.append((actor, change))),
        state=SimpleNamespace(step=4, lr=1e-3, bound=SimpleNamespace(set_knob=lambda k: None)),
        feeder=SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0),
    )
    Parts._record_trip(parts, 5, {"kind": "non_finite"})
    Parts.apply_knobs(parts, {"lr": 1e-4, "temperature": 0.7, "top_k": 20})
    assert changes == [("trainer collapse guard", {"kind": "non_finite"})]
    assert rec.calls == [
        ("change", 5, "guard", {"kind": "non_finite"}),
        ("change", 5, "knobs", {"lr": 1e-4, "temperature": 0.7, "top_k": 20}),
    ]
    assert parts.state.lr == 1e-4 and parts.feeder.temperature == 0.7 and parts.feeder.top_k == 20


# --- each sink, read back as a user opens it ------------------------------------------------------


def test_tensorboard_event_file_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _feed(_open(tmp_path, ["tensorboard"]))
    run = tmp_path / "tracking" / "tensorboard" / "proj" / JOB
    ea = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()

    def scalars(tag):
        return [(e.step, round(e.value, 6)) for e in ea.Scalars(tag)]

    assert scalars("loss") == [(1, 0.5), (2, 0.25), (3, round(0.5 / 3, 6))]
    assert scalars("flag") == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert "note" not in ea.Tags()["scalars"]  # numbers only
    assert scalars("eval/held_out/reward_mean") == [(0, 0.25), (2, 0.5)]  # at the step each round evaluated
    assert scalars("eval/held_out/pass@4") == [(2, 0.75)]

    def text(tag):
        return [(e.step, e.tensor_proto.string_val[0].decode()) for e in ea.Tensors(f"{tag}/text_summary")]

    ((step, config),) = text("config")
    assert step == 0 and '"model_path": "models/tiny"' in config and f'"job_id": "{JOB}"' in config
    ((step, knobs),) = text("changes/knobs")
    assert step == 2 and json.loads(knobs.strip("`\njson")) == {"lr": 1e-5}
    assert text("changes/guard")[0][0] == 3

    # A restarted trainer re-does the steps after its checkpoint (2): TensorBoard shows the new step 3.
    t = _open(tmp_path, ["tensorboard"], start_step=2)
    t.step(3, {"loss": 0.01})
    t.close()
    assert not t.failures
    ea = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    assert scalars("loss") == [(1, 0.5), (2, 0.25), (3, 0.01)]


def test_mlflow_run_read_back(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what a user reading MLflow 3's file store sets too

    _feed(_open(tmp_path, ["mlflow"], algorithm={"lr": 1e-4}))
    client = MlflowClient(tracking_uri=(tmp_path / "tracking" / "mlruns").as_uri())
    exp = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([exp.experiment_id])
    rid = run.info.run_id
    assert run.info.run_name == f"tiny-{JOB}" and run.info.status == "FINISHED"

    def history(key):
        return [(m.step, round(m.value, 6)) for m in client.get_metric_history(rid, key)]

    assert history("loss") == [(1, 0.5), (2, 0.25), (3, round(0.5 / 3, 6))]
    assert history("off_policy/max") == [(1, 0.0), (2, 1.0), (3, 2.0)]
    assert "note" not in run.data.metrics
    assert history("eval/held_out/reward_mean") == [(0, 0.25), (2, 0.5)]
    assert history("eval/held_out/pass_at_4") == [(2, 0.75)]  # MLflow keys take no '@'
    # the spec as params, flattened
    params = run.data.params
    assert params["model_path"] == "models/tiny" and params["job_id"] == JOB
    assert float(params["algorithm.lr"]) == 1e-4 and params["tracking.sinks"] == '["mlflow"]'
    # changes as tags at their step
    tags = run.data.tags
    assert json.loads(tags["change.000002.knobs"]) == {"lr": 1e-5}
    assert json.loads(tags["change.000003.guard"])["kind"] == "reward_collapse"
    assert tags["asyncrl.job_id"] == JOB

    # A restarted trainer (the stored spec's lr since changed by PATCH) goes on in the same run.
    t = _open(tmp_path, ["mlflow"], start_step=3, algorithm={"lr": 1e-5})
    t.step(4, {"loss": 0.1})
    t.close(ok=False)
    assert not t.failures
    (again,) = client.search_runs([exp.experiment_id])
    assert again.info.run_id == rid and again.info.status == "FAILED"
    assert history("loss")[-1] == (4, 0.1)
    assert float(again.data.params["algorithm.lr"]) == 1e-4  # params are the job's first; the change is a tag


def _wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file: a LevelDB-style log (7-byte header ':W&B' magic version, then
    32 KiB blocks of chunks: crc32, length, type) of protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    out, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # FULL or LAST: a whole record
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
            buf = b""
    return out


def test_wandb_offline_run_directory(tmp_path):
    # A trainer process of its own, as in a job: W&B's service writes the run file's last records
    # when the process exits. No API key, no W&B settings, a home of its own: offline needs no login.
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from pathlib import Path\n"
        "from test_tracking import _feed, _open\n"
        f"_feed(_open(Path({str(tmp_path)!r}), ['wandb']))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr

    (run_dir,) = (tmp_path / "tracking" / "wandb").glob(f"offline-run-*-{JOB}")
    (run_file,) = run_dir.glob("run-*.wandb")
    assert run_file.name == f"run-{JOB}.wandb"
    records = _wandb_records(run_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "run" in kinds and "exit" in kinds, kinds
    (run,) = [r.run for r in records if r.HasField("run")]
    assert run.run_id == JOB and run.project == "proj" and run.display_name == f"tiny-{JOB}"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["model_path"] == "models/tiny" and config["tracking"]["sinks"] == ["wandb"]

    rows = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    steps = [(row["trainer/step"], row["loss"]) for row in rows if "loss" in row]
    assert steps == [(1, 0.5), (2, 0.25), (3, pytest.approx(0.5 / 3))]
    assert all("note" not in row for row in rows)
    assert [
        (row["trainer/step"], row["eval/held_out/reward_mean"]) for row in rows if "eval/held_out/reward_mean" in row
    ] == [(0, 0.25), (2, 0.5)]
    assert [(row["trainer/step"], json.loads(row["changes/knobs"])) for row in rows if "changes/knobs" in row] == [
        (2, {"lr": 1e-5})
    ]
    assert [row["trainer/step"] for row in rows if "changes/guard" in row] == [3]
    assert kinds[-1] == "exit" and records[-1].exit.exit_code == 0
