"""Commands ride out a Redis outage (broker.redis_retry): a real redis-server with AOF is
SIGKILLed and started again from its AOF on the same port while a client waits in a command."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import redis
from chaos.harness import RedisAOF  # tests/ is on sys.path

from broker.redis_retry import OUTAGE_SECONDS, OUTAGES
from broker.streams import connect

pytestmark = [pytest.mark.hostile]


@pytest.fixture
def aof(tmp_path):
    server = RedisAOF(tmp_path / "redis")
    yield server
    server.close()


def _kill(server: RedisAOF) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)


def test_a_command_waits_out_a_kill_and_restart_from_aof(aof):
    client = connect(aof.url, outage_s=60)
    client.xadd("s", {"d": b"before"})
    client.xgroup_create("s", "g", id="0")
    time.sleep(1.5)  # appendfsync everysec: the entry is on disk
    outages, seconds = OUTAGES._value.get(), OUTAGE_SECONDS._value.get()
    _kill(aof)
    restarter = threading.Timer(4.0, aof.start)
    restarter.start()
    t0 = time.monotonic()
    got = client.xreadgroup("g", "c", {"s": ">"}, count=10, block=100)  # issued while Redis is down
    waited = time.monotonic() - t0
    restarter.join()
    assert got and got[0][1][0][1] == {b"d": b"before"}  # the AOF kept the entry and the group
    assert 3.5 <= waited < 15, waited
    assert OUTAGES._value.get() == outages + 1
    assert OUTAGE_SECONDS._value.get() - seconds >= 3.5


def test_the_outage_budget_ends_the_wait(aof):
    client = connect(aof.url, outage_s=1.0)
    client.ping()
    _kill(aof)
    t0 = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert time.monotonic() - t0 < 3.0


def test_a_wrong_password_fails_at_once(aof):
    client = connect(aof.url.replace("redis://", "redis://nobody:wrong@"), outage_s=60)
    t0 = time.monotonic()
    with pytest.raises(redis.AuthenticationError):
        client.ping()
    assert time.monotonic() - t0 < 2.0


def test_a_frozen_server_times_a_command_out_and_it_is_retried_once_thawed(aof):
    # A server that stops answering (SIGSTOP: the kernel still holds the connection) would hang a
    # reply forever; the socket timeout turns it into a retried timeout, and the command goes
    # through once the server answers again.
    client = connect(aof.url, outage_s=30, socket_timeout_s=0.5)
    client.set("k", "v")
    assert aof.proc is not None
    aof.proc.send_signal(signal.SIGSTOP)
    thaw = threading.Timer(2.0, lambda: aof.proc.send_signal(signal.SIGCONT))
    outages = OUTAGES._value.get()
    thaw.start()
    try:
        assert client.get("k") == b"v"
    finally:
        thaw.join()
        aof.proc.send_signal(signal.SIGCONT)
    assert OUTAGES._value.get() == outages + 1  # the frozen spell counted as an outage
