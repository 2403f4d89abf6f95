"""Relay fan-out of weights end to end (generator_svc/relay.py): relay processes over the real
transports and real Redis; a killed relay routed around; a relay serving bad bytes caught by the
checksums and routed around."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from broker.redis_server import resolve_redis_url
from broker.streams import POLICY, JobStreams, connect
from generator_svc.relay import RELAYS, RelayConfig, WeightRelay
from shared.ids import policy_version_id
from shared.schema import PolicyAnnouncement
from shared.transport import (
    ChecksumError,
    TcpWeightServer,
    build_manifest,
    make_client,
    make_server,
)

pytestmark = pytest.mark.integration

PREFIX = "testrelay:"
TTL_S = 3  # a relay not heard of for this long is dead (they beat every second)
SIZE = 6 * 1024 * 1024 + 123  # two 4 MiB chunks, the last one partial


def _streams() -> JobStreams:
    url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    return JobStreams(connect(url), f"relay-{uuid.uuid4().hex[:8]}", prefix=PREFIX)


def _version(v: int) -> tuple:
    buf = np.random.default_rng(v).integers(0, 256, SIZE, dtype=np.uint8)
    return build_manifest(v, [("w", [SIZE], "uint8", SIZE)], buf), buf


def _announce(streams: JobStreams, server, manifest) -> None:
    streams.publish(
        POLICY,
        PolicyAnnouncement(
            job_id=streams.job_id,
            msg_id=policy_version_id(streams.job_id, manifest.version),
            policy_version=manifest.version,
            manifest=manifest,
            transport=server.name,
            address=server.address,
            trainer_run="run-a",
        ),
    )


def _entries(streams: JobStreams) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in streams.r.hgetall(streams.key(RELAYS)).items()}


def _wait_served(streams: JobStreams, ids: list[str], v: int, timeout_s: float = 60) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        e = _entries(streams)
        if all(i in e and v in e[i]["versions"] for i in ids):
            return e
        time.sleep(0.05)
    raise AssertionError(f"v{v} not served by all of {ids}: {_entries(streams)}")


def _relay_procs(streams: JobStreams, ids: list[str], fanout: int) -> list[subprocess.Popen]:
    url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "generator_svc.relay",
                "--job",
                streams.job_id,
                "--id",
                i,
                "--redis",
                url,
                "--prefix",
                PREFIX,
                "--fanout",
                str(fanout),
                "--ttl",
                str(TTL_S),
                "--idle-wait",
                "1",
            ]
        )
        for i in ids
    ]


_FETCH_BACK = """
import sys
from shared.schema import Manifest
from shared.transport import make_client
m = Manifest.model_validate_json(sys.stdin.read())
client = make_client(sys.argv[1])
for address in sys.argv[2:]:
    client.fetch(address, m)  # raises ChecksumError unless every chunk is the trainer's
    print("verified", address, flush=True)
"""


def _check_bytes(transport: str, entries: dict[str, dict], ids: list[str], manifest) -> None:
    """What each relay serves is the trainer's version: fetched back from it and verified against
    the trainer's manifest, in a fresh process. (Not from this one: with UCX, a process that served
    a peer and then fetches from that peer's server gets its receives cancelled (ucxx 0.52, endpoint
    error handling off). Relays never do that: they fetch from smaller ids and serve larger ones.)"""
    addresses = [entries[i]["address"] for i in ids]
    out = subprocess.run(
        [sys.executable, "-c", _FETCH_BACK, transport, *addresses],
        input=manifest.model_dump_json(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.count("verified") == len(ids), out.stderr[-3000:]


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_relay_tree_and_a_killed_relay(transport):
    streams = _streams()
    server = make_server(transport, keep=3)
    ids = ["r0", "r1", "r2", "r3"]  # fan-out 2: r0 <- trainer; r1, r2 <- r0; r3 <- r1
    procs = _relay_procs(streams, ids, 2)
    try:
        deadline = time.monotonic() + 60
        while len(_entries(streams)) < len(ids):
            assert time.monotonic() < deadline, "relays did not register"
            time.sleep(0.05)

        # v1: the whole tree; the trainer sends one copy
        m1, b1 = _version(1)
        server.serve(m1, b1)
        _announce(streams, server, m1)
        e = _wait_served(streams, ids, 1)
        assert server.sent.bytes == SIZE
        _check_bytes(transport, e, ids, m1)

        # kill the root: its entry still looks live (for the ttl) but it never gets v2; its
        # children wait the idle grace, then go to the trainer; r3 still gets it from r1
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        sent = server.sent.bytes
        m2, b2 = _version(2)
        server.serve(m2, b2)
        _announce(streams, server, m2)
        e = _wait_served(streams, ids[1:], 2)
        assert server.sent.bytes - sent == 2 * SIZE  # r1 and r2; r3 from r1
        _check_bytes(transport, e, ids[1:], m2)

        # once its entry is past the ttl the tree re-forms without it: r1 <- trainer; r2, r3 <- r1
        while time.time() - _entries(streams)["r0"]["ts"] < TTL_S + 0.5:
            time.sleep(0.1)
        sent = server.sent.bytes
        m3, b3 = _version(3)
        server.serve(m3, b3)
        _announce(streams, server, m3)
        e = _wait_served(streams, ids[1:], 3)
        assert server.sent.bytes - sent == SIZE
        _check_bytes(transport, e, ids[1:], m3)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait(timeout=20)
        server.close()
        streams.r.delete(streams.key(RELAYS), streams.key(POLICY))
    assert [p.returncode for p in procs[1:]] == [0, 0, 0]  # SIGTERM: a clean exit


def test_a_relay_serving_bad_bytes_is_routed_around():
    """A live relay that serves corrupted bytes for the version: its children detect it by the
    trainer's checksums (the client re-fetches, still bad), route around it to the trainer, and
    only then serve the version, verified."""
    streams = _streams()
    trainer = TcpWeightServer(keep=2)
    bad = TcpWeightServer(keep=2)
    m, buf = _version(7)
    trainer.serve(m, buf)
    corrupt = buf.copy()
    corrupt[5_000_000] ^= 0xFF  # in the second chunk
    bad.serve(m, corrupt)
    # "a-bad" sorts first: the root, parent of both relays (fan-out 2)
    streams.r.hset(
        streams.key(RELAYS),
        "a-bad",
        json.dumps(
            {
                "address": bad.address,
                "transport": "tcp",
                "run": "run-a",
                "versions": [7],
                "served_at": {},
                "fetching": None,
                "ts": time.time() + 60,
            }
        ),
    )
    relays = [WeightRelay(streams, gid, RelayConfig(fanout=2, ttl_s=30)) for gid in ("c1", "c2")]
    ann = PolicyAnnouncement(
        job_id=streams.job_id,
        msg_id=policy_version_id(streams.job_id, 7),
        policy_version=7,
        manifest=m,
        transport="tcp",
        address=trainer.address,
        trainer_run="run-a",
    )
    got: dict[str, object] = {}
    try:
        threads = [threading.Thread(target=lambda r=r: got.__setitem__(r.id, r.fetch(ann))) for r in relays]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for r in relays:
            f = got[r.id]
            assert f.source == "trainer" and "ChecksumError" in f.failed["a-bad"], f  # type: ignore[attr-defined]
            assert np.array_equal(f.buf, buf)  # type: ignore[attr-defined]
            assert r.serves(ann) is not None
            # and what it serves verifies
            assert np.array_equal(make_client("tcp").fetch(r.serves(ann), m), buf)
        assert bad.sent.bytes > SIZE  # each child fetched and re-fetched from it
        assert trainer.sent.bytes == 2 * SIZE
        # the bad relay's bytes alone never pass verification
        with pytest.raises(ChecksumError):
            make_client("tcp").fetch(bad.address, m)
    finally:
        for r in relays:
            r.close()
        trainer.close()
        bad.close()
        streams.r.delete(streams.key(RELAYS))
