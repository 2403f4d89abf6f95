"""Admin tasks: checkpoint export and evaluation, the exactly-once task shell, the API endpoints,
and a real Celery worker process on Redis running them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest
import redis
from fastapi.testclient import TestClient

from broker.admin import EXPORT_MANIFEST, evaluate, export, export_destination, run_task
from broker.api import create_app
from broker.ledger import Ledger
from shared.settings import AdminSettings, BrokerSettings

REDIS_URL = "redis://127.0.0.1:6379/0"
RW, RO = "rw-admin-token", "ro-admin-token"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from asyncrl.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0
    )


def _checkpoint(root: Path, model: Path, job_id: str, step: int) -> Path:
    """A committed checkpoint directory as the trainer writes it: HF files, trainer state, COMMIT."""
    ck = root / job_id / f"step-{step:06d}"
    ck.mkdir(parents=True)
    for f in model.iterdir():
        (ck / f.name).write_bytes(f.read_bytes())
    (ck / "trainer_state").mkdir()
    (ck / "trainer_state" / "optimizer.safetensors").write_bytes(b"not part of an export")
    (ck / "COMMIT").write_text(json.dumps({"job_id": job_id, "step": step, "policy_version": step}))
    return ck


@pytest.fixture
def job(tmp_path, tiny_model) -> tuple[Ledger, AdminSettings, str, Path]:
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    job_id = f"job{uuid4().hex[:8]}"
    spec = {
        "name": "t",
        "model_path": str(tiny_model),
        "task": {"n_train": 16, "n_test": 12},
        "sampling": {"max_tokens": 6},
    }
    ledger.create_job(job_id, "t", spec)
    ck = _checkpoint(tmp_path / "checkpoints", tiny_model, job_id, 2)
    ledger.record_checkpoint(job_id, 2, 2, str(ck))
    settings = AdminSettings(
        redis_url=REDIS_URL,
        database_url=str(ledger.url),
        export_dir=str(tmp_path / "exports"),
        key_prefix=f"test-admin-{uuid4().hex[:8]}:",
        queue=f"admin-{uuid4().hex[:6]}",
    )
    return ledger, settings, job_id, ck


def test_export_copies_the_hf_files_only_verifies_and_is_idempotent(job):
    ledger, settings, job_id, ck = job
    out = export(ledger, settings, job_id, 2)
    dest = Path(out["path"])
    assert dest == Path(settings.export_dir).resolve() / job_id / "step-000002" and not out["already_exported"]
    exported = {p.name for p in dest.iterdir()}
    assert "config.json" in exported and EXPORT_MANIFEST in exported
    assert "COMMIT" not in exported and "trainer_state" not in exported
    manifest = json.loads((dest / EXPORT_MANIFEST).read_text())
    assert manifest["job_id"] == job_id and manifest["step"] == 2 and manifest["spec"]["name"] == "t"
    assert set(manifest["files"]) == exported - {EXPORT_MANIFEST}
    assert not [p for p in dest.parent.iterdir() if ".tmp-" in p.name]  # nothing left half-written
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(dest).num_parameters() > 0
    # The same export again finds its own result and writes nothing.
    mtime = (dest / "config.json").stat().st_mtime_ns
    assert export(ledger, settings, job_id, 2)["already_exported"]
    assert (dest / "config.json").stat().st_mtime_ns == mtime
    # A destination holding anything else is never overwritten.
    (dest / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not this export"):
        export(ledger, settings, job_id, 2)


def test_export_names_stay_inside_the_export_folder(job):
    _, settings, job_id, _ = job
    root = Path(settings.export_dir).resolve()
    assert export_destination(settings, job_id, 2, "release/v1") == root / "release" / "v1"
    for bad in ("/etc/passwd", "../outside", "a/../../b", "", "a\\..\\b"):
        with pytest.raises(ValueError, match="relative folder name"):
            export_destination(settings, job_id, 2, bad)


def test_export_refuses_an_uncommitted_or_unknown_checkpoint(job):
    ledger, settings, job_id, ck = job
    with pytest.raises(LookupError, match="no checkpoint at step 7"):
        export(ledger, settings, job_id, 7)
    (ck / "COMMIT").unlink()
    with pytest.raises(FileNotFoundError, match="not committed"):
        export(ledger, settings, job_id, 2)


def test_run_task_has_one_effect_per_task(job):
    ledger, _, job_id, _ = job
    ledger.create_admin_task("t1", job_id, "evaluate", {"job_id": job_id, "step": 2}, "tester")
    calls = []

    def work():
        calls.append(1)
        return {"reward_mean": 0.5}, {"job_id": job_id, "step": 2, "vmin": 2, "vmax": 2, "reward_mean": 0.5, "n": 4}

    assert run_task(ledger, "t1", work) == {"reward_mean": 0.5}
    # Redelivered after success (the worker died before its ack): the stored result, no second run.
    assert run_task(ledger, "t1", work) == {"reward_mean": 0.5} and len(calls) == 1
    task = ledger.get_admin_task("t1")
    assert task["state"] == "succeeded" and task["attempts"] == 1 and task["finished_at"] is not None
    (row,) = ledger.evals(job_id)
    assert row["source"] == "checkpoint" and row["reward_mean"] == 0.5 and row["n"] == 4
    # The trainer's pipeline evaluation of the same step is a separate row, not overwritten.
    ledger.record_eval(job_id, 2, 1, 2, 0.25, 12)
    assert [(e["source"], e["reward_mean"]) for e in ledger.evals(job_id)] == [("pipeline", 0.25), ("checkpoint", 0.5)]

    ledger.create_admin_task("t2", job_id, "export", {"job_id": job_id, "step": 2, "name": None}, "tester")

    def broken():
        raise OSError("disk full")

    with pytest.raises(OSError):
        run_task(ledger, "t2", broken)
    task = ledger.get_admin_task("t2")
    assert task["state"] == "failed" and task["error"] == "OSError: disk full"
    with pytest.raises(LookupError, match="not in the ledger"):
        run_task(ledger, "never-submitted", work)


@pytest.mark.slow
def test_evaluate_scores_the_held_out_set_with_the_engine(job):
    ledger, settings, job_id, _ = job
    result, row = evaluate(ledger, settings, job_id, 2)
    assert result["n"] == 12 == row["n"] and 0.0 <= result["reward_mean"] <= 1.0
    assert result["reward_mean"] == pytest.approx(result["correct"] / 12)
    assert len(result["examples"]) == 8 and all(len(e["completion"]) <= 6 * 4 for e in result["examples"])
    assert row == {"job_id": job_id, "step": 2, "vmin": 2, "vmax": 2, "reward_mean": result["reward_mean"], "n": 12}


def test_a_failing_evaluation_says_why(job, tmp_path):
    ledger, settings, job_id, ck = job
    (ck / "config.json").write_text("{}")  # not a model any more
    with pytest.raises(RuntimeError, match="evaluation exited with code"):
        evaluate(ledger, settings, job_id, 2)


# -- API ------------------------------------------------------------------------------------


@pytest.fixture
def api(job) -> Iterator[tuple[TestClient, Ledger, str]]:
    ledger, admin, job_id, _ = job
    settings = BrokerSettings(redis_url=REDIS_URL, stream_prefix=f"test-{uuid4().hex}:", tokens=RW, read_only_tokens=RO)
    with TestClient(create_app(settings, ledger=ledger, admin=admin), headers={"Authorization": f"Bearer {RW}"}) as c:
        yield c, ledger, job_id
    _clear(admin)


def _clear(admin: AdminSettings) -> None:
    r = redis.Redis.from_url(REDIS_URL)
    keys = list(r.scan_iter(match=f"{admin.key_prefix}*"))
    if keys:
        r.delete(*keys)


def test_api_submits_tasks_and_answers_retries_with_the_same_task(api):
    c, ledger, job_id = api
    r = c.post(f"/jobs/{job_id}/checkpoints/2/export", json={"name": "rel/one"})
    assert r.status_code == 202, r.text
    task = r.json()
    assert task["state"] == "queued" and task["kind"] == "export" and task["actor"].startswith("rw token")
    assert task["params"] == {"job_id": job_id, "step": 2, "name": "rel/one"}
    again = c.post(f"/jobs/{job_id}/checkpoints/2/export", json={"name": "rel/one"})
    assert again.status_code == 200 and again.json()["id"] == task["id"]  # a retry, not a second task
    other = c.post(f"/jobs/{job_id}/checkpoints/2/export")  # no body: the default folder
    assert other.status_code == 202 and other.json()["id"] != task["id"]
    ev = c.post(f"/jobs/{job_id}/checkpoints/2/evaluate")
    assert ev.status_code == 202 and ev.json()["kind"] == "evaluate"
    assert c.get(f"/tasks/{task['id']}").json()["state"] == "queued"
    assert [t["kind"] for t in c.get(f"/jobs/{job_id}/tasks").json()] == ["export", "export", "evaluate"]
    assert [t["kind"] for t in c.get(f"/jobs/{job_id}/tasks", params={"kind": "evaluate"}).json()] == ["evaluate"]
    # A failed task may be submitted again.
    ledger.finish_admin_task(ev.json()["id"], error="boom")
    assert c.post(f"/jobs/{job_id}/checkpoints/2/evaluate").status_code == 202
    metrics = c.get("/metrics").text
    for line in (
        'asyncrl_admin_tasks{kind="export",state="queued"} 2.0',
        'asyncrl_admin_tasks{kind="evaluate",state="failed"} 1.0',
        'asyncrl_admin_tasks{kind="evaluate",state="queued"} 1.0',
    ):
        assert line in metrics, metrics


def test_api_admin_error_paths(api):
    c, _, job_id = api
    for path in (f"/jobs/{job_id}/checkpoints/2/evaluate", f"/jobs/{job_id}/checkpoints/2/export"):
        assert c.post(path, headers={"Authorization": ""}).status_code == 401
        r = c.post(path, headers={"Authorization": f"Bearer {RO}"})
        assert r.status_code == 403 and "read-only" in r.json()["error"]
    r = c.post(f"/jobs/{job_id}/checkpoints/9/evaluate")
    assert r.status_code == 404 and "no checkpoint at step 9" in r.json()["error"] and "[2]" in r.json()["error"]
    assert c.post("/jobs/nope/checkpoints/2/evaluate").status_code == 404
    assert c.post(f"/jobs/{job_id}/checkpoints/-1/evaluate").status_code == 422
    r = c.post(f"/jobs/{job_id}/checkpoints/2/export", json={"name": "../../etc"})
    assert r.status_code == 422 and "relative folder name" in r.json()["error"]
    r = c.post(f"/jobs/{job_id}/checkpoints/2/export", json={"dest": "x"})
    assert r.status_code == 422 and "dest" in r.json()["error"]
    r = c.get("/tasks/unknown")
    assert r.status_code == 404 and "no admin task" in r.json()["error"]
    assert c.get(f"/jobs/{job_id}/tasks", params={"kind": "train"}).status_code == 422
    assert c.get("/jobs/nope/tasks").status_code == 404
    assert c.get("/tasks/unknown", headers={"Authorization": ""}).status_code == 401
    assert c.get(f"/jobs/{job_id}/tasks", headers={"Authorization": f"Bearer {RO}"}).status_code == 200


def test_api_reports_an_unreachable_queue_and_leaves_no_task_waiting(job):
    ledger, admin, job_id, _ = job
    down = admin.model_copy(update={"celery_broker_url": "redis://127.0.0.1:1/0"})
    settings = BrokerSettings(redis_url=REDIS_URL, stream_prefix=f"test-{uuid4().hex}:")
    with TestClient(create_app(settings, ledger=ledger, admin=down)) as c:
        r = c.post(f"/jobs/{job_id}/checkpoints/2/export")
    assert r.status_code == 503 and "unreachable" in r.json()["error"]
    (task,) = ledger.admin_tasks(job_id)
    assert task["state"] == "failed" and "could not enqueue" in task["error"]


# -- a real worker process -------------------------------------------------------------------


def _worker(admin: AdminSettings, log: Path, extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {
        **os.environ,
        "REDIS_URL": REDIS_URL,
        "DATABASE_URL": admin.database_url,
        "ADMIN_KEY_PREFIX": admin.key_prefix,
        "ADMIN_QUEUE": admin.queue,
        "ADMIN_EXPORT_DIR": admin.export_dir,
        **(extra or {}),
    }
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "broker.admin",
        "worker",
        "-Q",
        admin.queue,
        "--concurrency",
        "1",
        "--loglevel",
        "INFO",
        "--hostname",
        f"test-{uuid4().hex[:6]}@%h",
    ]
    return subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_task(c: TestClient, task_id: str, log: Path, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        task = c.get(f"/tasks/{task_id}").json()
        if task["state"] in ("succeeded", "failed"):
            return task
        assert time.monotonic() < deadline, f"task stuck: {task}\n{log.read_text()[-3000:]}"
        time.sleep(0.3)


@pytest.mark.slow
def test_celery_worker_runs_export_and_evaluation(api, job, tmp_path):
    c, ledger, job_id = api
    _, admin, _, _ = job
    log = tmp_path / "worker.log"
    worker = _worker(admin, log)
    try:
        task = c.post(f"/jobs/{job_id}/checkpoints/2/export").json()
        done = _wait_task(c, task["id"], log)
        assert done["state"] == "succeeded", done
        assert done["attempts"] == 1 and Path(done["result"]["path"], "config.json").is_file()
        ev = _wait_task(c, c.post(f"/jobs/{job_id}/checkpoints/2/evaluate").json()["id"], log)
        assert ev["state"] == "succeeded", ev
        assert ev["result"]["n"] == 12
        status = c.get(f"/jobs/{job_id}").json()
        assert [(e["source"], e["n"]) for e in status["evals"]] == [("checkpoint", 12)]
        assert status["evals"][0]["reward_mean"] == pytest.approx(ev["result"]["reward_mean"])
    finally:
        os.killpg(worker.pid, 15)
        worker.wait(30)


@pytest.mark.slow
def test_a_task_whose_worker_is_killed_is_redelivered_and_has_one_effect(api, job, tmp_path):
    """acks_late + reject_on_worker_lost: SIGKILL the worker (and its evaluation) mid-task; once
    the visibility timeout passes a new worker runs the task again, to one ledger result."""
    c, ledger, job_id = api
    _, admin, _, _ = job
    admin = admin.model_copy(update={"visibility_timeout_s": 5.0})
    log = tmp_path / "worker.log"
    first = _worker(admin, log, {"ADMIN_VISIBILITY_TIMEOUT_S": "5"})
    task_id = c.post(f"/jobs/{job_id}/checkpoints/2/evaluate").json()["id"]
    deadline = time.monotonic() + 120
    while c.get(f"/tasks/{task_id}").json()["state"] != "running":
        assert time.monotonic() < deadline and first.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    os.killpg(first.pid, 9)  # the worker, its pool process and the evaluation subprocess
    first.wait(30)
    assert c.get(f"/tasks/{task_id}").json()["state"] == "running"  # nobody finished it
    time.sleep(6)  # past the visibility timeout
    second = _worker(admin, log, {"ADMIN_VISIBILITY_TIMEOUT_S": "5"})
    try:
        done = _wait_task(c, task_id, log)
        assert done["state"] == "succeeded" and done["attempts"] == 2, done
        assert [e["source"] for e in ledger.evals(job_id)] == ["checkpoint"]
    finally:
        os.killpg(second.pid, 15)
        second.wait(30)
