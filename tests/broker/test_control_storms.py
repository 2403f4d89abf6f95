"""Control writes under concurrency (issue 31, item 4): storms of parallel PATCHes, and of pause,
resume and PATCH racing a job's end, through a real API server on each ledger.

The API runs as a real `python -m broker` process (uvicorn on a free port, the local Redis, a
SQLite file or a fresh PostgreSQL database); the storms are real concurrent HTTP clients (threads
released together by a barrier). What the services run is what they fold from the job's control
stream, read here by the services' own `ControlWatcher`.

- `patch_lost_updates`: over every PATCH storm, the knobs whose stored value differs from the
  value the services run (a lost update: a read-modify-write of the spec that overwrote another);
  `patch_audit_misordered`: the storms whose audit log orders the changes otherwise than the
  control stream the services fold.
- `terminal_state_overwritten`: the terminal storms whose job did not end in the terminal state
  that was answered (cancel 202) or written (the trainer's `finished`, a service's `failed`), or
  whose later pause, resume or PATCH was not refused with 409.

The default run does a few storms of each per ledger (seconds); `-m bench` does 30 of each per
ledger and records the figures in results/hostile.json.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import pytest
from hostile_results import record_hostile

from broker.fleet import LIVE_STATES, fail_everywhere
from broker.ledger import Ledger
from broker.runtime import ControlWatcher
from broker.streams import JobStreams, connect

pytestmark = [pytest.mark.hostile]

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
TOKEN = "storm-rw-token"
SPEC = {"name": "storm", "model_path": "models/tiny", "group_size": 4, "steps": 3, "max_staleness": 1}
PATCHES = 100  # per PATCH storm, as in the issue
RACERS = 24  # pause / resume / PATCH requests racing one job's end
FAST_STORMS = 3  # of each kind per ledger in the default run
BENCH_STORMS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Api:
    """A `python -m broker` process, its ledger and the job streams' prefix."""

    url: str
    ledger: Ledger
    prefix: str
    client: httpx.Client
    redis: Any

    def streams(self, job_id: str) -> JobStreams:
        return JobStreams(self.redis, job_id, prefix=self.prefix)

    def running_job(self) -> str:
        """A submitted job that a trainer took (running), as the fleet's trainer claims it."""
        r = self.client.post("/jobs", json=SPEC)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        assert self.ledger.move_job(job_id, ("queued",), "running")
        return str(job_id)


@contextmanager
def api_server(tmp: Path, ledger_url: str) -> Iterator[Api]:
    port, prefix = _free_port(), f"test-storm-{uuid4().hex[:8]}:"
    env = {
        **os.environ,
        "BROKER_PORT": str(port),
        "DATABASE_URL": ledger_url,
        "REDIS_URL": REDIS_URL,
        "STREAM_PREFIX": prefix,
        "BROKER_TOKENS": TOKEN,
        "LOG_LEVEL": "WARNING",
    }
    log_path, redis = tmp / f"broker-{port}.log", connect(REDIS_URL)
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "broker"], cwd=REPO, env=env, stdout=log, stderr=log)
    limits = httpx.Limits(max_connections=PATCHES, max_keepalive_connections=PATCHES)
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60, limits=limits
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the API exited {proc.returncode}: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the API did not answer: {log_path.read_text()[-3000:]}"
            try:
                client.get("/health", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        with Ledger(ledger_url, migrate=False) as ledger:
            yield Api(f"http://127.0.0.1:{port}", ledger, prefix, client, redis)
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        keys = list(redis.scan_iter(match=f"{prefix}*"))
        if keys:
            redis.delete(*keys)
        redis.close()


@pytest.fixture(scope="module")
def sqlite_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    tmp = tmp_path_factory.mktemp("storm-sqlite")
    with api_server(tmp, f"sqlite:///{tmp}/ledger.db") as api:
        yield api


@pytest.fixture(scope="module")
def pg_api(
    tmp_path_factory: pytest.TempPathFactory, postgres_database: Callable[[], AbstractContextManager[str]]
) -> Iterator[Api]:
    with postgres_database() as url, api_server(tmp_path_factory.mktemp("storm-pg"), url) as api:
        yield api


def _together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run every call at once, each in its own thread, released together; their results in order."""
    gate = threading.Barrier(len(calls))

    def run(call: Callable[[], Any]) -> Any:
        gate.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


# The live knobs of a storm and where the stored spec keeps each.
KNOBS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "lr": lambda spec: spec["algorithm"]["lr"],
    "temperature": lambda spec: spec["sampling"]["temperature"],
    "top_p": lambda spec: spec["sampling"]["top_p"],
    "max_staleness": lambda spec: spec["max_staleness"],
}


def _patch_body(i: int) -> dict[str, Any]:
    """The i-th PATCH of a storm: one knob (every fifth, two) set to a value no other PATCH sets."""
    values = {"lr": (i + 1) * 1e-6, "temperature": 0.5 + i / 1000, "top_p": 0.5 + i / 250, "max_staleness": 1 + i % 60}
    names = list(KNOBS)
    body = {names[i % 4]: values[names[i % 4]]}
    if i % 5 == 0:
        body[names[(i + 1) % 4]] = values[names[(i + 1) % 4]]
    return body


def patch_storm(api: Api) -> tuple[int, bool]:
    """100 PATCHes of one running job at once, each answered 200. Returns the knobs whose stored
    value is not the value the services run, and whether the audit log holds the changes in
    another order than the services received them."""
    job_id = api.running_job()
    answers = _together([lambda i=i: api.client.patch(f"/jobs/{job_id}", json=_patch_body(i)) for i in range(PATCHES)])
    assert [r.status_code for r in answers] == [200] * PATCHES, [r.text for r in answers if r.status_code != 200][:3]
    watcher = ControlWatcher(api.streams(job_id))
    watcher.poll()
    stored = api.ledger.get_job(job_id)["spec"]  # type: ignore[index]
    lost = sum(KNOBS[k](stored) != v for k, v in watcher.settings.items())
    audited = [c["changes"]["settings"] for c in api.ledger.job_changes(job_id)]
    sent = [m.settings for m in _controls(api, job_id)]
    return lost, audited != sent


def _controls(api: Api, job_id: str) -> list[Any]:
    from broker.streams import CONTROL
    from shared.schema import Control

    return api.streams(job_id).read_broadcast(CONTROL, "0", Control)[1]


TERMINAL_KINDS = ("cancelled", "finished", "failed")


def terminal_storm(api: Api, storm: int) -> bool:
    """Pauses, resumes and PATCHes of a running job racing its end: a cancel through the API, or
    the trainer's `finished`, or a service's `failed` (by storm number). Returns whether the end was
    overwritten: the job is not in that state afterwards, the services' control state disagrees
    with it, or a later pause, resume or PATCH is not refused with 409."""
    job_id = api.running_job()
    end = TERMINAL_KINDS[storm % 3]
    ended: list[bool] = []

    def finish() -> None:
        if end == "cancelled":
            ended.append(api.client.post(f"/jobs/{job_id}/cancel").status_code == 202)
        elif end == "finished":  # as the trainer ends a job (trainer_svc/parts.py)
            ended.append(api.ledger.move_job(job_id, LIVE_STATES, "finished"))
        else:
            fail_everywhere(api.ledger, api.streams(job_id), job_id, "storm: a service failed the job")
            ended.append(True)

    def race(i: int) -> httpx.Response:
        if i % 3 == 2:
            return api.client.patch(f"/jobs/{job_id}", json={"temperature": 0.5 + i / 100})
        return api.client.post(f"/jobs/{job_id}/{'pause' if i % 3 == 0 else 'resume'}")

    calls: list[Callable[[], Any]] = [lambda i=i: race(i) for i in range(RACERS)]
    calls.insert(RACERS // 2, finish)
    answers = [a for a in _together(calls) if isinstance(a, httpx.Response)]
    assert all(r.status_code in (200, 202, 409) for r in answers), [r.text for r in answers if r.status_code >= 500]
    assert ended == [True], f"the job's end ({end}) was refused"
    overwritten = api.ledger.get_job(job_id)["state"] != end  # type: ignore[index]
    if end == "cancelled":
        watcher = ControlWatcher(api.streams(job_id))
        overwritten |= watcher.poll() != "cancelled"
    later = [
        api.client.post(f"/jobs/{job_id}/pause"),
        api.client.post(f"/jobs/{job_id}/resume"),
        api.client.patch(f"/jobs/{job_id}", json={"lr": 0.5}),
    ]
    overwritten |= any(r.status_code != 409 or end not in r.json()["error"] for r in later)
    return overwritten or api.ledger.get_job(job_id)["state"] != end  # type: ignore[index]


def _storms(api: Api, n: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    patched = [patch_storm(api) for _ in range(n)]
    t1 = time.perf_counter()
    overwritten = sum(terminal_storm(api, i) for i in range(n))
    t2 = time.perf_counter()
    return {
        "patch_storms": n,
        "patches": n * PATCHES,
        "patch_lost_updates": sum(lost for lost, _ in patched),
        "patch_audit_misordered": sum(misordered for _, misordered in patched),
        "patch_storm_s": round((t1 - t0) / n, 2),
        "terminal_storms": n,
        "terminal_state_overwritten": overwritten,
        "terminal_storm_s": round((t2 - t1) / n, 2),
    }


def _record(backend: str, figures: dict[str, Any], name: str) -> None:
    """The storms' figures in results/hostile.json: the counters summed over the tests, the
    details under `name` per backend."""
    record_hostile(
        patch_lost_updates=figures["patch_lost_updates"],
        terminal_state_overwritten=figures["terminal_state_overwritten"],
        **{f"{name}_{backend}": figures},
    )


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_control_storms_lose_no_update_and_never_leave_an_end(backend: str, request: pytest.FixtureRequest) -> None:
    api = request.getfixturevalue("sqlite_api" if backend == "sqlite" else "pg_api")
    figures = _storms(api, FAST_STORMS)
    _record(backend, figures, "control_storms_fast")
    assert figures["patch_lost_updates"] == figures["patch_audit_misordered"] == 0, figures
    assert figures["terminal_state_overwritten"] == 0, figures


@pytest.mark.bench
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_control_storms_bench(backend: str, request: pytest.FixtureRequest) -> None:
    api = request.getfixturevalue("sqlite_api" if backend == "sqlite" else "pg_api")
    figures = _storms(api, BENCH_STORMS)
    _record(backend, figures, "control_storms")
    assert figures["patch_lost_updates"] == figures["patch_audit_misordered"] == 0, figures
    assert figures["terminal_state_overwritten"] == 0, figures
