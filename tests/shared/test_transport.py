"""Weight transport: manifests with chunk checksums, and every server/client pair (tcp, ucx)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from shared.schema import Manifest
from shared.transport import (
    ChecksumError,
    TcpWeightClient,
    WeightServer,
    bad_chunks,
    build_manifest,
    chunk_checksums,
    make_client,
    make_server,
    version_checksum,
)
from shared.transport.ucx import UcxWeightClient

CHUNK = 1000  # small on purpose: the buffer below spans dozens of chunks, the last one partial


def random_weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((64, 32)).astype(np.float32),
        "layers.0.mlp.weight": rng.standard_normal((32, 96)).astype(np.float32),
        "layers.0.mlp.bias": rng.standard_normal(96).astype(np.float16),
        "head.bias": rng.integers(-(2**31), 2**31 - 1, size=(7,), dtype=np.int32),
    }


def flatten(tensors: dict[str, np.ndarray]) -> tuple[list, np.ndarray]:
    entries = [(name, t.shape, t.dtype.name, t.nbytes) for name, t in tensors.items()]
    buf = np.concatenate([np.ascontiguousarray(t).view(np.uint8).reshape(-1) for t in tensors.values()])
    return entries, buf


def version(v: int, seed: int | None = None) -> tuple[Manifest, np.ndarray, dict[str, np.ndarray]]:
    tensors = random_weights(v if seed is None else seed)
    entries, buf = flatten(tensors)
    return build_manifest(v, entries, buf, chunk_bytes=CHUNK), buf, tensors


def close_soon(srv) -> None:
    """socketserver's shutdown() waits out a 0.5 s poll; don't make every test pay for it."""
    threading.Thread(target=srv.close, daemon=True).start()


CLIENTS: dict[str, type] = {"tcp": TcpWeightClient, "ucx": UcxWeightClient}
TRANSPORT_NAMES = ["tcp", "ucx"]  # ucxx is a base dependency: both always run


@pytest.fixture(params=TRANSPORT_NAMES)
def transport(request) -> str:
    """Every transfer test runs once per transport: both must pass the same tests."""
    return request.param


@pytest.fixture
def server(transport: str) -> Iterator[WeightServer]:
    srv = make_server(transport, port=0, keep=3)
    try:
        yield srv
    finally:
        close_soon(srv)


@pytest.fixture
def client_cls(transport: str) -> type:
    return CLIENTS[transport]


def counting_client(base: type, **kw):
    """A `base` client that records every (offset, length) range requested from the server."""

    class CountingClient(base):
        def __init__(self, **kw) -> None:
            super().__init__(**kw)
            self.ranges: list[tuple[int, int]] = []

        def _fetch_range(self, sock, version, out, offset) -> Iterator[int]:
            self.ranges.append((offset, len(out)))
            yield from super()._fetch_range(sock, version, out, offset)

    return CountingClient(**kw)


# -- manifests --------------------------------------------------------------------------------


def test_manifest_layout_and_checksums() -> None:
    m, buf, tensors = version(4)
    assert m.version == 4
    assert m.total_bytes == buf.nbytes == sum(t.nbytes for t in tensors.values())
    assert buf.nbytes % CHUNK != 0 and buf.nbytes // CHUNK >= 20
    assert len(m.chunk_checksums) == -(-buf.nbytes // CHUNK)
    assert m.checksum == version_checksum(m.chunk_checksums)
    off = 0
    for entry, (name, t) in zip(m.tensors, tensors.items(), strict=True):
        assert (entry.name, entry.shape, entry.dtype, entry.offset, entry.nbytes) == (
            name,
            list(t.shape),
            t.dtype.name,
            off,
            t.nbytes,
        )
        off += t.nbytes
    assert bad_chunks(buf, m) == []


def test_manifest_checksum_identifies_content() -> None:
    m1, buf, _ = version(1)
    m2, _, _ = version(1, seed=99)
    assert m1.checksum != m2.checksum
    again = build_manifest(1, [(t.name, t.shape, t.dtype, t.nbytes) for t in m1.tensors], buf.copy(), CHUNK)
    assert again == m1


def test_manifest_rejects_sizes_that_do_not_add_up() -> None:
    entries, buf = flatten(random_weights(0))
    with pytest.raises(ValueError, match="add up"):
        build_manifest(0, entries[:-1], buf, chunk_bytes=CHUNK)


def test_bad_chunks_finds_exactly_the_corrupted_chunks() -> None:
    m, buf, _ = version(0)
    bad = buf.copy()
    last = len(m.chunk_checksums) - 1
    bad[3 * CHUNK] ^= 1
    bad[-1] ^= 0x80
    assert bad_chunks(bad, m) == [3, last]
    assert bad_chunks(buf[:-1], m) == [last]
    # A different chunk count makes every chunk suspect.
    assert bad_chunks(buf[: last * CHUNK], m) == list(range(last + 1))
    assert chunk_checksums(bad, CHUNK)[4] == m.chunk_checksums[4]


# -- transfer (every transport) -----------------------------------------------------------------


def test_fetch_returns_identical_bytes(server, client_cls: type) -> None:
    m, buf, tensors = version(0)
    server.serve(m, buf)
    client = counting_client(client_cls)
    got = client.fetch(server.address, m)
    assert got.dtype == np.uint8 and got.tobytes() == buf.tobytes()
    assert client.ranges == [(0, m.total_bytes)]  # one request, no re-fetches
    for entry in m.tensors:  # the manifest is enough to rebuild each tensor
        t = got[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).reshape(entry.shape)
        np.testing.assert_array_equal(t, tensors[entry.name])


def test_transit_corruption_is_refetched(server, client_cls: type) -> None:
    m, buf, _ = version(0)
    server.serve(m, buf)
    last = len(m.chunk_checksums) - 1

    spans: list[tuple[int, int]] = []

    def corrupt(b: np.ndarray, lo: int, hi: int) -> None:
        """Flips bytes of the span that has just landed, before it is hashed."""
        spans.append((lo, hi))
        if lo <= 5 * CHUNK + 17 < hi:
            b[5 * CHUNK + 17] ^= 0xFF
        if hi == b.nbytes:  # the short last chunk
            b[-3:] = 0 if buf[-3:].any() else 1

    client = counting_client(client_cls, piece_bytes=3 * CHUNK + 5)  # several spans, unaligned
    got = client.fetch(server.address, m, corrupt_hook=corrupt)
    assert got.tobytes() == buf.tobytes()
    assert client.ranges == [
        (0, m.total_bytes),
        (5 * CHUNK, CHUNK),
        (last * CHUNK, m.total_bytes - last * CHUNK),
    ]
    assert len(spans) > 5 and spans[-1][1] == m.total_bytes  # pieces landed (and were hashed) one by one


def test_persistent_corruption_raises_checksum_error(server, client_cls: type) -> None:
    m, buf, _ = version(0)
    wrong = buf.copy()
    wrong[7 * CHUNK + 1] ^= 0x01  # the server itself holds a buffer that does not match
    server.serve(m, wrong)
    client = counting_client(client_cls, retries=2)
    with pytest.raises(ChecksumError, match=r"version 0: chunks \[7\]"):
        client.fetch(server.address, m)
    assert client.ranges == [(0, m.total_bytes)] + [(7 * CHUNK, CHUNK)] * 2


def test_unserved_version_is_a_clear_error(server, client_cls: type) -> None:
    m0, buf0, _ = version(0)
    server.serve(m0, buf0)
    m7, _, _ = version(7)
    with pytest.raises(RuntimeError, match=r"version 7 not served; have \[0\]"):
        client_cls().fetch(server.address, m7)


def test_manifest_larger_than_served_buffer_is_a_clear_error(server, client_cls: type) -> None:
    m, buf, _ = version(0)
    server.serve(m, buf)
    bigger = m.model_copy(update={"total_bytes": m.total_bytes + 8})
    with pytest.raises(RuntimeError, match="outside"):
        client_cls().fetch(server.address, bigger)


def test_serve_rejects_a_buffer_of_the_wrong_size(server) -> None:
    m, buf, _ = version(0)
    with pytest.raises(ValueError, match="does not match"):
        server.serve(m, buf[:-1])


def test_server_keeps_only_the_last_versions(server, client_cls: type) -> None:
    served = {v: version(v) for v in range(5)}
    for m, buf, _ in served.values():
        server.serve(m, buf)
    assert server.store.versions() == [2, 3, 4]
    client = client_cls()
    for v in (0, 1):
        with pytest.raises(RuntimeError, match=f"version {v} not served; have \\[2, 3, 4\\]"):
            client.fetch(server.address, served[v][0])
    for v in (2, 3, 4):
        m, buf, _ = served[v]
        assert client.fetch(server.address, m).tobytes() == buf.tobytes()


def test_concurrent_fetches(server, client_cls: type) -> None:
    versions = [version(v) for v in (1, 2)]
    for m, buf, _ in versions:
        server.serve(m, buf)
    results: dict[int, bytes] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def pull(i: int) -> None:
        m, _, _ = versions[i % 2]
        try:
            start.wait(timeout=10)
            for _ in range(5):
                results[i] = client_cls(timeout_s=10).fetch(server.address, m).tobytes()
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=pull, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    for i in range(4):
        assert results[i] == versions[i % 2][1].tobytes()


def test_address_uses_advertise_host(transport: str) -> None:
    srv = make_server(transport, port=0, advertise_host="trainer.internal")
    try:
        assert srv.address == f"trainer.internal:{srv.port}"
    finally:
        close_soon(srv)


# -- registry ------------------------------------------------------------------------------------


def test_make_server_and_client_by_name(transport: str) -> None:
    srv = make_server(transport, port=0, keep=1)
    try:
        assert srv.name == transport
        m, buf, _ = version(3)
        srv.serve(m, buf)
        client = make_client(transport)
        assert client.fetch(srv.address, m).tobytes() == buf.tobytes()
        client.close()
    finally:
        close_soon(srv)


@pytest.mark.parametrize("factory", [make_server, make_client])
def test_unknown_transport_lists_valid_names(factory) -> None:
    with pytest.raises(ValueError, match=r"unknown weight transport 'nccl'; valid: \[.*'tcp'.*\]"):
        factory("nccl")


def test_close_stops_serving(transport: str, client_cls: type) -> None:
    srv = make_server(transport, port=0)
    m, buf, _ = version(0)
    srv.serve(m, buf)
    srv.close()
    with pytest.raises(OSError):
        client_cls(timeout_s=2).fetch(srv.address, m)
