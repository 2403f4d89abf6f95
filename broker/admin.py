"""Celery admin tasks, kept off the rollout path: evaluate a checkpoint, export a checkpoint.

Worker: `celery -A broker.admin worker -Q admin --concurrency 1` (or `python -m broker.admin`),
configured from the environment (`shared.settings.AdminSettings`, prefix `ADMIN_`). The broker
is Redis (`ADMIN_CELERY_BROKER_URL`, default `REDIS_URL`), under its own key prefix and queue:
admin work never touches a job's streams, and a slow evaluation never delays a rollout.

Delivery is at least once (`acks_late`; a worker that dies mid-task has its task redelivered),
the effect exactly once: the API records each task in the ledger (`admin_tasks`) before enqueuing
it; a task starts by marking its row `running` unless it already `succeeded` (then it returns
the stored result and does nothing), and ends by writing its result, and for an evaluation the
`evals` row, in one transaction. Messages carry ids only and are JSON: never pickle.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, cast

from celery import Celery
from pydantic import Field, TypeAdapter, ValidationError

from broker.ledger import Ledger, row_error
from broker.ledger.rows import CheckpointRow, EvalArgs
from broker.redis_server import resolve_redis_url
from shared.jobspec import JobSpec
from shared.schema import INT32_MAX, Name, clean_text
from shared.settings import AdminSettings

log = logging.getLogger(__name__)

EVALUATE = "asyncrl.evaluate_checkpoint"
EXPORT = "asyncrl.export_checkpoint"
TASK_NAMES = {"evaluate": EVALUATE, "export": EXPORT}
# Written into every export: what it is and the checksum of each file, so a repeated export can
# tell its own earlier result from someone else's folder.
EXPORT_MANIFEST = "asyncrl_export.json"
# Trainer-only content of a checkpoint directory: not part of an HF-format model.
NOT_EXPORTED = frozenset({"COMMIT", "trainer_state"})
_CHUNK = 4 << 20


def make_celery(settings: AdminSettings) -> Celery:
    """A Celery app for the admin queue (the worker's and the API's, which only sends)."""
    broker_url = settings.celery_broker_url or resolve_redis_url(settings.redis_url)[0]
    if "+cluster://" in broker_url.lower():
        raise ValueError(
            "Celery cannot use a Redis Cluster as its broker: set ADMIN_CELERY_BROKER_URL to a single "
            "Redis server for the admin queue (the job streams stay on the cluster)"
        )
    # No result backend: a task's state and result live in the ledger (`admin_tasks`), the source
    # of truth the API reads, so there is nothing for Celery to store or expire.
    app = Celery("asyncrl-admin", broker=broker_url)
    app.conf.update(
        task_acks_late=True,  # ack after the task ran: a worker killed mid-task loses nothing
        task_reject_on_worker_lost=True,  # ... and its task is redelivered, not marked failed
        worker_prefetch_multiplier=1,  # a long task must not sit on messages another worker could take
        task_default_queue=settings.queue,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        # Redelivery of an unacked task waits this long: it must exceed the longest task, or a
        # running evaluation would be handed to a second worker.
        broker_transport_options={
            "global_keyprefix": settings.key_prefix,
            "visibility_timeout": settings.visibility_timeout_s or settings.eval_timeout_s + 600,
        },
        broker_connection_retry_on_startup=True,
        # the worker rides out a Redis outage (a restart from the AOF) however long it lasts, as
        # the services do up to REDIS_OUTAGE_S; Celery logs each reconnect attempt
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        worker_hijack_root_logger=False,
    )
    return app


SETTINGS = AdminSettings()
app = make_celery(SETTINGS)
_ledger: Ledger | None = None


def _get_ledger() -> Ledger:
    global _ledger
    if _ledger is None:  # one per worker process, opened at first use (after the fork)
        _ledger = Ledger(SETTINGS.database_url)
    return _ledger


# -- the work, as plain functions (tested without Celery) --------------------------------------


def committed_checkpoint(ledger: Ledger, job_id: str, step: int) -> CheckpointRow:
    """The ledger's checkpoint row of (job, step), checked to be a committed directory on disk.

    Raises:
        LookupError: the ledger has no such checkpoint.
        FileNotFoundError: the directory or its COMMIT marker is missing on this machine.
    """
    row = next((c for c in ledger.checkpoints(job_id) if c["step"] == step), None)
    if row is None:
        raise LookupError(f"job {job_id} has no checkpoint at step {step}")
    path = Path(row["path"])
    if not (path / "COMMIT").is_file():
        raise FileNotFoundError(
            f"checkpoint {path} is not on this machine or not committed; the admin worker must "
            "see TRAINER_CHECKPOINT_DIR at the same path as the trainer"
        )
    return row


def evaluate(ledger: Ledger, settings: AdminSettings, job_id: str, step: int) -> tuple[dict, EvalArgs]:
    """Held-out reward of the checkpoint at `step` (`generator_svc.evaluate` in a subprocess).

    Returns (result, eval row for the ledger). Raises RuntimeError when the evaluation fails.
    """
    ck = committed_checkpoint(ledger, job_id, step)
    job = ledger.get_job(job_id)
    if job is None:
        raise LookupError(f"no job {job_id}")
    spec = JobSpec.model_validate(job["spec"])
    with tempfile.TemporaryDirectory(prefix="asyncrl-eval-") as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_file.write_text(spec.model_dump_json())
        cmd = [
            sys.executable,
            "-m",
            "generator_svc.evaluate",
            "--checkpoint",
            ck["path"],
            "--spec",
            str(spec_file),
            "--out",
            str(out_file),
            "--max-model-len",
            str(settings.eval_max_model_len),
        ]
        log.info("evaluating %s step %d: %s", job_id, step, ck["path"])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=settings.eval_timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"evaluation ran past ADMIN_EVAL_TIMEOUT_S={settings.eval_timeout_s:g} s") from None
        if proc.returncode != 0 or not out_file.is_file():
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"evaluation exited with code {proc.returncode}:\n{tail}")
        result = json.loads(out_file.read_text())
    result.update(checkpoint=ck["path"], policy_version=ck["policy_version"], step=step)
    eval_row: EvalArgs = {
        "job_id": job_id,
        "step": step,
        "vmin": ck["policy_version"],
        "vmax": ck["policy_version"],
        "reward_mean": result["reward_mean"],
        "n": result["n"],
    }
    return result, eval_row


def export_destination(settings: AdminSettings, job_id: str, step: int, name: str | None) -> Path:
    """Where an export goes: `name` (a relative path) or `<job>/step-NNNNNN`, under ADMIN_EXPORT_DIR.

    Confined to the export folder: the API is remote, and a token to submit exports must not be
    a way to write anywhere the worker can.

    Raises:
        ValueError: `name` is absolute, empty, or climbs out with `..`.
    """
    if name is None:
        rel = PurePosixPath(job_id) / f"step-{step:06d}"
    else:
        rel = PurePosixPath(name)
        if rel.is_absolute() or not rel.parts or ".." in rel.parts or "\\" in name:
            raise ValueError(
                f"export name {name!r} must be a relative folder name without '..'; exports go under ADMIN_EXPORT_DIR"
            )
    return Path(settings.export_dir).resolve() / rel


def _copy_hashed(src: Path, dst: Path) -> str:
    """Copy one file, returning the SHA-256 of the bytes written."""
    h = hashlib.sha256()
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while chunk := fi.read(_CHUNK):
            h.update(chunk)
            fo.write(chunk)
        fo.flush()
        os.fsync(fo.fileno())
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _matches(dest: Path, manifest: dict) -> bool:
    """Whether `dest` holds exactly the export that `manifest` describes (every file's checksum)."""
    try:
        found = json.loads((dest / EXPORT_MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    same = {k: found.get(k) for k in ("job_id", "step", "files")} == {
        k: manifest[k] for k in ("job_id", "step", "files")
    }
    return same and all(_sha256(dest / f) == digest for f, digest in manifest["files"].items())


def export(ledger: Ledger, settings: AdminSettings, job_id: str, step: int, name: str | None = None) -> dict:
    """Copy the checkpoint's HF-format files (not the trainer's state) to the export folder.

    Written to a temporary folder beside the destination, checked file by file against the
    source's checksums, then renamed into place: a reader sees the whole export or none. A repeated
    export of the same checkpoint to the same place finds its earlier result and changes nothing.

    Raises:
        FileExistsError: the destination holds something other than this export.
        RuntimeError: a copied file does not match its source.
    """
    ck = committed_checkpoint(ledger, job_id, step)
    job = ledger.get_job(job_id)
    if job is None:
        raise LookupError(f"no job {job_id}")
    src = Path(ck["path"])
    dest = export_destination(settings, job_id, step, name)
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.relative_to(src).parts[0] not in NOT_EXPORTED)
    if not any(p.name == "config.json" for p in files):
        raise FileNotFoundError(f"checkpoint {src} has no config.json: not an HF-format model")
    manifest: dict[str, Any] = {
        "job_id": job_id,
        "step": step,
        "policy_version": ck["policy_version"],
        "source": str(src),
        "files": {str(p.relative_to(src)): _sha256(p) for p in files},
    }
    result = {"path": str(dest), "files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    if dest.exists():
        if _matches(dest, manifest):
            return {**result, "already_exported": True}
        raise FileExistsError(f"{dest} exists and is not this export; pass another name or remove it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        for p in files:
            rel = p.relative_to(src)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            if _copy_hashed(p, tmp / rel) != manifest["files"][str(rel)]:
                raise RuntimeError(f"{rel} changed while it was copied from {src}")
        (tmp / EXPORT_MANIFEST).write_text(json.dumps({**manifest, "spec": job["spec"]}, indent=2))
        os.replace(tmp, dest)  # fails if another export created dest meanwhile: nothing is overwritten
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s step %d to %s (%d files)", job_id, step, dest, len(files))
    return {**result, "already_exported": False}


# A task message's arguments, checked as the stream boundary checks messages (shared.schema):
# strict types, a job id without control characters, a step a ledger `integer` column can hold.
_TASK_ARGS: TypeAdapter[tuple[str, int]] = TypeAdapter(
    tuple[Annotated[Name, Field(min_length=1, max_length=128)], Annotated[int, Field(ge=0, le=INT32_MAX)]]
)


def task_args(job_id: Any, step: Any) -> tuple[str, int]:
    """(job_id, step) of a task message. Raises ValueError with the reason (recorded as the task's
    failure) for anything else: a hand-made message must fail its task, not the worker."""
    try:
        return _TASK_ARGS.validate_python((job_id, step), strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = (first.get("loc") or ("",))[0]
        which = {0: "job_id", 1: "step"}.get(where, "arguments") if isinstance(where, int) else "arguments"
        raise ValueError(f"invalid task argument {which}: {first['msg']}") from None


def run_task(ledger: Ledger, task_id: str, work: Callable[[], tuple[dict, EvalArgs | None]]) -> dict:
    """The exactly-once shell around one task's work: start (or find it already done), run, record.

    A failure is recorded with its message and raised (Celery marks the task failed; the API shows
    the ledger's message). A result the ledger refuses (a value a column cannot hold) fails the
    task with the database's reason. Returns the task's result.
    """
    before = ledger.start_admin_task(task_id)
    if before is None:
        raise LookupError(f"admin task {task_id} is not in the ledger; submit tasks through the job API")
    if before["state"] == "succeeded":  # a redelivery after the first run succeeded
        log.info("admin task %s already succeeded; not running it again", task_id)
        return cast(dict, before["result"])  # a succeeded task recorded its result
    try:
        result, eval_row = work()
    except Exception as exc:
        ledger.finish_admin_task(task_id, error=clean_text(f"{type(exc).__name__}: {exc}")[:10_000])
        raise
    try:
        ledger.finish_admin_task(task_id, result=result, eval_row=eval_row)
    except Exception as exc:
        why = row_error(exc)
        if why is None:
            raise
        ledger.finish_admin_task(task_id, error=f"the ledger refused the task's result: {why}")
        raise RuntimeError(f"admin task {task_id}: the ledger refused its result: {why}") from None
    return result


# -- Celery tasks: ids in, the ledger for everything else -------------------------------------


@app.task(name=EVALUATE, bind=True, time_limit=SETTINGS.eval_timeout_s + 120)
def evaluate_checkpoint(self: Any, job_id: str, step: int) -> dict:
    ledger = _get_ledger()
    return run_task(ledger, self.request.id, lambda: evaluate(ledger, SETTINGS, *task_args(job_id, step)))


@app.task(name=EXPORT, bind=True)
def export_checkpoint(self: Any, job_id: str, step: int, name: str | None = None) -> dict:
    ledger = _get_ledger()
    return run_task(
        ledger, self.request.id, lambda: (export(ledger, SETTINGS, *task_args(job_id, step), _export_name(name)), None)
    )


_EXPORT_NAME: TypeAdapter[str | None] = TypeAdapter(Annotated[Name, Field(min_length=1, max_length=1024)] | None)


def _export_name(name: Any) -> str | None:
    try:
        return _EXPORT_NAME.validate_python(name, strict=True)
    except ValidationError as exc:
        raise ValueError(f"invalid task argument name: {exc.errors()[0]['msg']}") from None


def main() -> None:
    """`python -m broker.admin`: a worker on the admin queue, one task at a time."""
    app.worker_main(
        [
            "worker",
            "-Q",
            SETTINGS.queue,
            "--concurrency",
            "1",
            "--loglevel",
            SETTINGS.log_level,
            "--hostname",
            f"admin@{os.uname().nodename}-{os.getpid()}",
        ]
    )


if __name__ == "__main__":
    main()
