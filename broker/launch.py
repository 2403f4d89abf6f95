"""One-box launcher: the broker API and every service as supervised OS processes, each with its log.

Processes only talk through Redis and the ledger; this module just starts them with the right
environment, watches them, and stops them (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path


class Supervisor:
    def __init__(self, logdir: str | Path, env: dict[str, str]):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.env = env
        self.procs: list[Proc] = []

    def start(self, name: str, module: str, env: dict[str, str] | None = None, cpus: set[int] | None = None) -> Proc:
        """Start `python -m module` with the supervisor's env plus `env`, optionally pinned to `cpus`."""
        log_path = self.logdir / f"{name}.log"
        fh = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        full_env = {**os.environ, **self.env, **(env or {})}
        available = os.sched_getaffinity(0)
        pin = (cpus & available) if cpus else None

        def preexec() -> None:
            os.setpgrp()  # our Ctrl-C goes to us; we stop children in order
            if pin:
                os.sched_setaffinity(0, pin)

        popen = subprocess.Popen(
            [sys.executable, "-m", module], env=full_env, stdout=fh, stderr=subprocess.STDOUT, preexec_fn=preexec
        )
        fh.close()
        p = Proc(name, popen, log_path)
        self.procs.append(p)
        log.info("started %s (pid %d), log %s", name, popen.pid, log_path)
        return p

    def failed(self) -> list[Proc]:
        """Processes that exited with a non-zero code."""
        return [p for p in self.procs if p.popen.poll() not in (None, 0)]

    def wait(self, name: str, timeout: float) -> int | None:
        for p in self.procs:
            if p.name == name:
                try:
                    return p.popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    return None
        raise KeyError(name)

    def wait_all(self, timeout_s: float, exclude: tuple[str, ...] = ()) -> bool:
        """Wait for every process (but `exclude`) to exit on its own; True if they all did."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            if p.name in exclude:
                continue
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop_all(self, grace_s: float = 20.0) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing", p.name, grace_s)
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()

    def tail(self, name: str, lines: int = 30) -> str:
        for p in self.procs:
            if p.name == name and p.log_path.exists():
                return "\n".join(p.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""
