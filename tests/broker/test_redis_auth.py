"""Redis AUTH/ACL and TLS for real: a private redis-server (Debian's 7.0) with a password, an ACL
user limited to one key prefix, and a TLS port with a self-signed certificate made by openssl.

A consumer with the right credentials publishes and consumes; wrong ones fail at once with redis-py's
AuthenticationError (not after the retry budget); an ACL user cannot touch keys outside its prefix.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError

from broker.redis_server import check_redis_url, redact_url, resolve_redis_url
from broker.streams import GROUP_GENERATORS, PROMPTS, Consumer, JobStreams, connect
from shared.schema import PromptGroup, SamplingParams

REDIS = shutil.which("redis-server") or "/usr/bin/redis-server"
JOB = "job-auth"
ADMIN_PW = "admin-secret"
ALICE_PW = "alice-secret"
PREFIX = "acl-test:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    port: int
    tls_port: int | None
    certs: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("redis-auth")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(d / "key.pem"),
            "-out",
            str(d / "cert.pem"),
        ],
        check=True,
        capture_output=True,
    )
    port, tls_port = free_port(), free_port()
    conf = d / "redis.conf"
    conf.write_text(
        f'port {port}\nbind 127.0.0.1\nsave ""\nappendonly no\ndir {d}\n'
        f"tls-port {tls_port}\ntls-cert-file {d / 'cert.pem'}\ntls-key-file {d / 'key.pem'}\n"
        f"tls-ca-cert-file {d / 'cert.pem'}\ntls-auth-clients no\n"
        # `default` is the requirepass user; alice may only use keys under PREFIX.
        f"user default on >{ADMIN_PW} ~* &* +@all\n"
        f"user alice on >{ALICE_PW} ~{PREFIX}* resetchannels -@all +@stream +@connection +@keyspace +@transaction\n"
    )
    proc = subprocess.Popen([REDIS, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://:{ADMIN_PW}@127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            if redis.Redis.from_url(url, socket_connect_timeout=0.2).ping():
                break
        except redis.RedisError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "private redis-server did not start"
        time.sleep(0.05)
    try:
        yield Server(port, tls_port, d)
    finally:
        proc.terminate()
        proc.wait(10)


def prompt(i: int) -> PromptGroup:
    return PromptGroup(
        job_id=JOB,
        msg_id=f"p-{i}",
        group_id=f"g-{i}",
        policy_version=0,
        prompt_index=i,
        prompt="What is 2 + 2?",
        answer="4",
        n=2,
        sampling=SamplingParams(),
    )


def round_trip(url: str) -> None:
    url, embedded = resolve_redis_url(url)
    assert embedded is None
    js = JobStreams(connect(url), JOB, prefix=PREFIX, claim_idle_ms=60_000)
    js.ensure_group(PROMPTS, GROUP_GENERATORS)
    ids = js.publish_many(PROMPTS, [prompt(0), prompt(1)])
    got = js.consume(Consumer(PROMPTS, GROUP_GENERATORS, "c1", PromptGroup), block_ms=100)
    assert [d.entry_id for d in got] == ids
    assert js.ack(PROMPTS, GROUP_GENERATORS, ids) == 2
    js.delete_all()


def test_password_and_acl_user_can_consume(server: Server) -> None:
    round_trip(f"redis://:{ADMIN_PW}@127.0.0.1:{server.port}/0")  # requirepass (the default user)
    round_trip(f"redis://alice:{ALICE_PW}@127.0.0.1:{server.port}/0")  # ACL user


@pytest.mark.parametrize(
    "userinfo,error",
    [
        ("", "Authentication required"),
        (":wrong@", "invalid username-password pair"),
        (f"bob:{ALICE_PW}@", "invalid username-password pair"),
        ("alice:wrong@", "invalid username-password pair"),
    ],
)
def test_wrong_credentials_fail_at_once_with_a_clear_error(server: Server, userinfo: str, error: str) -> None:
    js = JobStreams(connect(f"redis://{userinfo}127.0.0.1:{server.port}/0"), JOB, prefix=PREFIX)
    t0 = time.monotonic()
    with pytest.raises(AuthenticationError, match=error):
        js.ensure_group(PROMPTS, GROUP_GENERATORS)
    assert time.monotonic() - t0 < 1.0  # not retried: a credential does not heal with backoff


def test_acl_user_is_confined_to_its_prefix(server: Server) -> None:
    alice = connect(f"redis://alice:{ALICE_PW}@127.0.0.1:{server.port}/0")
    outside = JobStreams(alice, JOB, prefix="elsewhere:")
    with pytest.raises(NoPermissionError, match="no permissions to access one of the keys"):
        outside.publish(PROMPTS, prompt(0))
    with pytest.raises(NoPermissionError):
        alice.config_get("requirepass")


def test_tls_with_verified_certificate(server: Server) -> None:
    ca = server.certs / "cert.pem"
    url = f"rediss://alice:{ALICE_PW}@127.0.0.1:{server.tls_port}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required"
    opts = check_redis_url(url)
    assert opts["connection_class"] is redis.SSLConnection and opts["ssl_ca_certs"] == str(ca)
    round_trip(url)
    client = connect(url)
    assert client.ping()
    # The options reached the connection: it is really TLS, verified against our CA.
    conn = client.connection_pool.get_connection()
    try:
        assert isinstance(conn._sock, ssl.SSLSocket) and conn._sock.version()
        assert conn.cert_reqs == ssl.CERT_REQUIRED
    finally:
        client.connection_pool.release(conn)


def test_tls_rejects_an_unknown_certificate(server: Server) -> None:
    # The system CA store does not know our self-signed certificate.
    client = connect(f"rediss://alice:{ALICE_PW}@127.0.0.1:{server.tls_port}/0?ssl_cert_reqs=required")
    t0 = time.monotonic()
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        client.ping()
    assert time.monotonic() - t0 < 30


def test_plain_client_on_the_tls_port_fails(server: Server) -> None:
    client = redis.Redis(host="127.0.0.1", port=server.tls_port, socket_timeout=0.5, socket_connect_timeout=0.5)
    with pytest.raises(redis.RedisError):
        client.ping()


def test_urls_are_checked_early_and_passwords_redacted() -> None:
    with pytest.raises(ValueError, match=r"invalid REDIS_URL 'http://alice:\*\*\*@h:1/0'") as err:
        resolve_redis_url("http://alice:secret@h:1/0")
    assert "secret" not in str(err.value)
    assert (
        redact_url("rediss://alice:secret@h:6380/0?ssl_ca_certs=/ca.pem")
        == "rediss://alice:***@h:6380/0?ssl_ca_certs=/ca.pem"
    )
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
