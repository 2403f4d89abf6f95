"""The host staging of a CUDA trainer's versions (trainer_svc/weights.py `HostStaging`), on CPU
tensors: a buffer is allocated once per size and reused, but never while anything still holds the
bytes it last handed out (a version the server keeps, or a send in flight on one it just dropped);
and a CPU trainer's publish takes no staging copy at all."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.transport import TcpWeightClient, TcpWeightServer, bad_chunks, build_manifest
from shared.transport.base import VersionStore
from trainer_svc import weights
from trainer_svc.weights import HostStaging, publish_weights

CHUNK = 64


def counting() -> tuple[HostStaging, list[int]]:
    """A staging pool over plain CPU tensors (pinning needs a CUDA device), and the sizes it allocated."""
    sizes: list[int] = []

    def alloc(n: int) -> torch.Tensor:
        sizes.append(n)
        return torch.empty(n, dtype=torch.uint8)

    return HostStaging(alloc), sizes


def version_bytes(v: int, n: int = 1000) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(v).integers(0, 256, n, dtype=np.uint8))


def test_one_buffer_when_each_version_is_dropped_before_the_next():
    # ucx: the host copy only feeds the checksum, so one buffer serves every version
    staging, sizes = counting()
    ptrs = set()
    for v in range(1, 6):
        flat = version_bytes(v)
        host = staging.copy(flat)
        assert host.dtype == np.uint8 and host.shape == (1000,) and np.array_equal(host, flat.numpy())
        ptrs.add(host.ctypes.data)
        del host
    assert sizes == [1000] and len(ptrs) == 1


def test_the_versions_a_server_keeps_are_never_overwritten_and_still_fetch():
    # tcp: the host copies are what the server serves; it keeps 3, so 3 + 1 buffers and no more
    keep = 3
    staging, sizes = counting()
    server = TcpWeightServer(keep=keep)
    manifests = {}
    try:
        for v in range(1, 8):
            host = staging.copy(version_bytes(v))
            manifests[v] = build_manifest(v, [("w", [1000], "uint8", 1000)], host, chunk_bytes=CHUNK)
            server.serve(manifests[v], host)
            del host
            for kept in server.store.versions():
                assert bad_chunks(server.store.get(kept), manifests[kept]) == [], f"version {kept} overwritten at {v}"
        assert sizes == [1000] * (keep + 1)
        assert server.store.versions() == [5, 6, 7]
        client = TcpWeightClient(retries=0)
        for v in (5, 6, 7):
            assert np.array_equal(client.fetch(server.address, manifests[v]), version_bytes(v).numpy())
    finally:
        server.close()


def test_a_send_in_flight_on_a_dropped_version_keeps_its_buffer():
    # keep 1: a ring of keep + 1 = 2 buffers would write version 3 over version 1 while its send
    # (a memoryview of a slice, as TcpWeightServer._send holds) is still going out
    staging, sizes = counting()
    store = VersionStore(keep=1)
    for v in (1, 2):
        host = staging.copy(version_bytes(v))
        if v == 1:
            in_flight, ptr1 = host.data[100:900], host.ctypes.data
        store.put(build_manifest(v, [("w", [1000], "uint8", 1000)], host, chunk_bytes=CHUNK), host)
        del host
    assert store.versions() == [2]  # version 1 dropped, its send still in flight
    host3 = staging.copy(version_bytes(3))
    assert len(sizes) == 3 and host3.ctypes.data != ptr1, "version 3 took the buffer version 1 is sent from"
    assert bytes(in_flight) == version_bytes(1).numpy()[100:900].tobytes()
    del in_flight  # the send is over
    store.put(build_manifest(3, [("w", [1000], "uint8", 1000)], host3, chunk_bytes=CHUNK), host3)
    del host3
    host4 = staging.copy(version_bytes(4))  # version 1's buffer is free again: reused, none allocated
    assert len(sizes) == 3 and host4.ctypes.data == ptr1
    assert np.array_equal(host4, version_bytes(4).numpy())


def test_a_buffer_is_reused_only_for_its_own_size():
    staging, sizes = counting()
    a = staging.copy(version_bytes(1, 1000))
    del a
    b = staging.copy(version_bytes(2, 500))
    del b
    staging.copy(version_bytes(3, 1000))
    staging.copy(version_bytes(4, 500))
    assert sizes == [1000, 500] and staging.buffers == 2


class _Announcements:
    """The streams and the ledger publish_weights writes to, recorded."""

    def __init__(self) -> None:
        self.published: list = []

    def record_policy_version(self, *args) -> None:
        pass

    def publish(self, stream, msg) -> None:
        self.published.append(msg)

    def trim_broadcast(self, stream, keep) -> None:
        pass


def test_a_cpu_publish_takes_no_staging_copy(monkeypatch):
    def no_copy(self, flat):
        raise AssertionError("a CPU trainer's weights are already host bytes: no staging copy")

    monkeypatch.setattr(HostStaging, "copy", no_copy)
    state = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    rec = _Announcements()
    server = TcpWeightServer(keep=2)
    try:
        _, checksum = publish_weights(
            torch.nn.Linear(1, 1), 1, server, rec, rec, "job", 2, snapshot=(state, ([1, 2], [0.0]))
        )
        served = server.store.get(1)
        assert isinstance(served, np.ndarray) and served.nbytes == 6 * 4 + 4 * 2
        assert rec.published[0].manifest.checksum == checksum
        assert server not in weights._staging
    finally:
        server.close()


@pytest.mark.parametrize("keep", [1, 2])
def test_buffers_stay_at_keep_plus_one_over_many_versions(keep):
    staging, sizes = counting()
    store = VersionStore(keep=keep)
    for v in range(1, 20):
        host = staging.copy(version_bytes(v, 256))
        store.put(build_manifest(v, [("w", [256], "uint8", 256)], host, chunk_bytes=CHUNK), host)
        del host
    assert len(sizes) == keep + 1
