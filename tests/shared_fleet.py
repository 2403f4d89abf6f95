"""One standing fleet for the whole test session: a broker, generator, reward service and trainer
started once without JOB_ID (broker/fleet.py), as real processes on the real Redis, the real vLLM CPU
engine and a SQLite ledger, serving a queue of jobs as one deployment serves its users.

Tests that need "a real job runs" submit to it (`fleet` fixture, tests/conftest.py) instead of
starting a stack of their own: the engine is built once for the session, not once per test. A test
that kills, stops or reconfigures a fleet process must start its own stack instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from asyncrl.demo import free_port  # noqa: F401 - the integration stacks' port, from here
from asyncrl.launch import Supervisor
from bench.standing import standing_services
from broker.ledger import Ledger

END = ("finished", "failed", "stopped", "cancelled")
# The tiny verifiers environments (tests/test_verifiers_job.py): a verifiers environment is named by
# its module, so every service of the fleet imports them from PYTHONPATH.
VF_ENVS = Path(__file__).resolve().parent / "vf_envs"


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


@contextmanager
def standing_fleet(tmp: Path, trainers: int = 1, env: dict[str, str] | None = None) -> Iterator[Fleet]:
    """Start the four services of a fleet under `tmp` and yield it once the API answers (with
    `trainers` trainers: that many jobs at once; `env` added to every service's)."""
    from asyncrl.tiny_model import build_tiny_model

    # the model every integration test uses (vLLM CPU attention needs head_dim >= 32)
    model = build_tiny_model(tmp / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    path = os.pathsep.join(p for p in (str(VF_ENVS), os.environ.get("PYTHONPATH", "")) if p)
    with standing_services(tmp, trainers=trainers, env={"PYTHONPATH": path, **(env or {})}) as f:
        yield Fleet(f.sup, f.api, f.ledger, model, tmp, f.prefix, f.redis_url)
