"""The four services of a standing fleet (broker, generator, reward, trainer; no JOB_ID, so they
serve the queue: broker/fleet.py) as real processes on the real Redis and a SQLite ledger under a
folder: the test session's fleet (tests/shared_fleet.py) and the golden curve's reference runs
(bench/golden.py) are the same fleet, so the reference is measured where the test runs."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from asyncrl.demo import free_port
from asyncrl.launch import Supervisor, wait_healthy
from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url

SERVICES = (("broker", "broker"), ("generator", "generator_svc"), ("reward", "reward_svc"), ("trainer", "trainer_svc"))


@dataclass
class Services:
    sup: Supervisor
    api: str
    ledger: Ledger
    prefix: str
    redis_url: str


@contextmanager
def standing_services(
    tmp: Path, label: str = "fleet", trainers: int = 1, env: dict[str, str] | None = None
) -> Iterator[Services]:
    """Start the fleet's services under `tmp` (logs, ledger, checkpoints; stream prefix
    `<label>-<random>:`) and yield them once the API answers; stopped on exit. `trainers` > 1
    adds trainers `trainer-1`, ...: the fleet then runs that many jobs at once. `env` adds to
    every service's environment."""
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    port = free_port()
    db_url = f"sqlite:///{tmp / 'ledger.db'}"
    prefix = f"{label}-{uuid.uuid4().hex[:8]}:"
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
        **(env or {}),
    }
    sup = Supervisor(tmp / "logs", env)
    api = f"http://127.0.0.1:{port}"
    try:
        for name, module in SERVICES:
            sup.start(name, module, {"TRAINER_CONSUMER_ID": "trainer-0"} if name == "trainer" else None)
        for i in range(1, trainers):
            sup.start(f"trainer-{i}", "trainer_svc", {"TRAINER_CONSUMER_ID": f"trainer-{i}"})
        wait_healthy(f"{api}/health", sup, "broker", 120)
        with Ledger(db_url) as ledger:
            yield Services(sup, api, ledger, prefix, redis_url)
    finally:
        sup.stop_all()
