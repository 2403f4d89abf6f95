"""A fleet on this box for `asyncrl run` when no job API answers: the launcher (`python -m
asyncrl.launch`, serving the queue until stopped) as a child process in its own process group.

The launcher does the rest as it does for anyone: Redis from REDIS_URL, else a local one on 6379,
else a private redis-server (`--private-redis`); the ledger from DATABASE_URL, else SQLite
(`runs/ledger.db`); the broker API and every service as supervised processes, each with its log,
placed on this box's cores. The API listens on 127.0.0.1:$BROKER_PORT (8000: the CLI's default
`--api`) when that port is free, so a fleet left up (`--keep`) is the one the next `asyncrl`
command finds; SIGTERM to the launcher stops it all.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.launch import Supervisor, wait_healthy


def default_api() -> str:
    """Where this box's API listens when it runs here: 127.0.0.1:$BROKER_PORT (8000)."""
    return f"http://127.0.0.1:{os.environ.get('BROKER_PORT') or 8000}"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalFleet:
    """A launcher this process started; `api` is its job API."""

    sup: Supervisor
    api: str

    @property
    def pid(self) -> int:
        return self.sup.procs[0].popen.pid

    @property
    def logdir(self) -> Path:
        return self.sup.logdir

    def check(self) -> None:
        """Raises RuntimeError when the launcher exited (a service failed past its restart budget)."""
        code = self.sup.procs[0].popen.poll()
        if code is not None:
            raise RuntimeError(
                f"the fleet on this box stopped (launcher exit {code}); its log, "
                f"{self.logdir / 'launch.log'}:\n{self.sup.tail('launch')}"
            )

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM to the launcher, which stops every service it runs (then SIGKILL after `grace_s`)."""
        self.sup.stop_all(grace_s)


def start_local_fleet(
    *, generators: int = 1, placement: str | None = None, logdir: Path | None = None, timeout_s: float = 120.0
) -> LocalFleet:
    """Start the launcher serving the queue and wait for its API's /health.

    Args:
        placement: NODE_PLACEMENT for the services (`colocated` for such jobs); None: the
            launcher's default.
        logdir: the launcher's and every service's logs; default runs/launch/<timestamp>.

    Raises:
        RuntimeError: the launcher exited before its API answered (its log's tail).
        TimeoutError: no answer within `timeout_s`.
    """
    port = int(os.environ.get("BROKER_PORT") or 8000)
    port = port if _port_free(port) else _free_port()
    env = {"BROKER_HOST": "127.0.0.1", "BROKER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
    if placement is not None:
        env["NODE_PLACEMENT"] = placement
    logdir = (logdir or Path("runs/launch") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    sup = Supervisor(logdir, env)
    sup.start(
        "launch", "asyncrl.launch", args=("--generators", str(generators), "--private-redis", "--logdir", str(logdir))
    )
    api = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{api}/health", sup, "launch", timeout_s)
    except BaseException:
        sup.stop_all()
        raise
    return LocalFleet(sup, api)
