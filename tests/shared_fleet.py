"""One standing fleet for the whole test session: a broker, generator, reward service and trainer
started once without JOB_ID (broker/fleet.py), as real processes on the real Redis, the real vLLM CPU
engine and a SQLite ledger, serving a queue of jobs as one deployment serves its users.

Tests that need "a real job runs" submit to it (`fleet` fixture, tests/conftest.py) instead of
starting a stack of their own: the engine is built once for the session, not once per test. A test
that kills, stops or reconfigures a fleet process must start its own stack instead.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from asyncrl.launch import Supervisor
from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url

END = ("finished", "failed", "stopped", "cancelled")
SERVICES = (("broker", "broker"), ("generator", "generator_svc"), ("reward", "reward_svc"), ("trainer", "trainer_svc"))


@dataclass
class Fleet:
    sup: Supervisor
    api: str
    ledger: Ledger
    model: Path
    tmp: Path
    prefix: str
    redis_url: str

    def spec(self, name: str, steps: int = 2, **extra: Any) -> dict[str, Any]:
        """A small job on the fleet's model: `extra` replaces whole top-level fields."""
        return {
            "name": name,
            "model_path": str(self.model),
            "steps": steps,
            "group_size": 4,
            "prompts_per_step": 4,
            "eval_every": 0,
            "task": {"n_train": 64, "n_test": 8},
            "sampling": {"max_tokens": 8},
            **extra,
        }

    def submit(self, name: str, steps: int = 2, **extra: Any) -> str:
        return self.post(self.spec(name, steps, **extra))

    def post(self, spec: dict[str, Any]) -> str:
        """Submit a whole spec; the new job's id."""
        r = httpx.post(f"{self.api}/jobs", json=spec, timeout=30)
        assert r.status_code == 201, r.text
        assert r.json()["state"] == "queued"
        return str(r.json()["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(httpx.get(f"{self.api}/jobs/{job_id}", timeout=30).json())

    def wait(self, job_id: str, states: tuple[str, ...] = END, timeout: float = 300) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (job := self.job(job_id))["state"] not in states:
            failed = self.sup.failed()
            assert not failed, "\n".join(f"{p.name}:\n{self.sup.tail(p.name)}" for p in failed)
            assert time.monotonic() < deadline, f"job {job_id} stuck: {job['state']}\n{self.sup.tail('trainer')}"
            time.sleep(0.2)
        return job

    def log(self, name: str) -> str:
        return (self.tmp / "logs" / f"{name}.log").read_text(errors="replace")

    def alive(self) -> bool:
        return all(p.popen.poll() is None for p in self.sup.procs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(api: str) -> bool:
    """Whether the job API at `api` answers /health with 200."""
    try:
        return httpx.get(f"{api}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(sup: Supervisor, api: str, timeout: float) -> None:
    """Until the API answers; fails with the broker's log when a process failed or time ran out."""
    deadline = time.monotonic() + timeout
    while not healthy(api):
        assert not sup.failed() and time.monotonic() < deadline, f"broker did not come up:\n{sup.tail('broker')}"
        time.sleep(0.2)


@contextmanager
def standing_fleet(tmp: Path) -> Iterator[Fleet]:
    """Start the four services of a fleet under `tmp` and yield it once the API answers."""
    from asyncrl.tiny_model import build_tiny_model

    # the model every integration test uses (vLLM CPU attention needs head_dim >= 32)
    model = build_tiny_model(tmp / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    port = free_port()
    db_url = f"sqlite:///{tmp / 'ledger.db'}"
    prefix = f"fleet-{uuid.uuid4().hex[:8]}:"
    env = {
        "REDIS_URL": redis_url,
        "DATABASE_URL": db_url,
        "STREAM_PREFIX": prefix,
        "BROKER_PORT": str(port),
        "GEN_GENERATOR_ID": "gen-0",
        "TRAINER_THREADS": "1",
        "REWARD_WORKERS": "1",
        "PYTHONUNBUFFERED": "1",
        "TRAINER_CHECKPOINT_DIR": str(tmp / "checkpoints"),
    }
    env.pop("JOB_ID", None)
    sup = Supervisor(tmp / "logs", env)
    api = f"http://127.0.0.1:{port}"
    try:
        for name, module in SERVICES:
            sup.start(name, module)
        wait_healthy(sup, api, 120)
        with Ledger(db_url) as ledger:
            yield Fleet(sup, api, ledger, model, tmp, prefix, redis_url)
    finally:
        sup.stop_all()
