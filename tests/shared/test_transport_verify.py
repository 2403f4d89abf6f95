"""`fetch_verified` on hand-made buffers: chunks hashed while later pieces still arrive, corrupted
chunks (middle, the short last one) re-fetched alone, ChecksumError when a re-fetch never helps.

The `fill` here copies from a source array piece by piece: it stands in for a transport on
purpose (tests/shared/test_transport.py runs the same path over real TCP and UCX)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from shared.transport import ChecksumError, build_manifest
from shared.transport import base as transport_base
from shared.transport.base import fetch_verified

CHUNK = 100
PIECE = 250  # not a multiple of CHUNK: a chunk can straddle two pieces
NBYTES = 1037  # 11 chunks, the last one 37 bytes


class Source:
    """A version's bytes served piece by piece into the receiver's buffer; records every range
    asked for and can hand out wrong bytes for some ranges (a corrupting link)."""

    def __init__(self, data: np.ndarray, buf: np.ndarray):
        self.data, self.buf = data, buf
        self.ranges: list[tuple[int, int]] = []
        self.bad_bytes: dict[int, int] = {}  # offset -> how many more times it arrives flipped

    def fill(self, lo: int, hi: int) -> Iterator[int]:
        self.ranges.append((lo, hi))
        for p in range(lo, hi, PIECE):
            q = min(p + PIECE, hi)
            self.buf[p:q] = self.data[p:q]
            for off, n in self.bad_bytes.items():
                if p <= off < q and n > 0:
                    self.buf[off] ^= 0x5A
                    self.bad_bytes[off] = n - 1
            yield q


def setup(nbytes: int = NBYTES) -> tuple[np.ndarray, np.ndarray, Source]:
    data = np.random.default_rng(nbytes).integers(0, 256, size=nbytes, dtype=np.uint8)
    buf = np.zeros(nbytes, dtype=np.uint8)
    return data, buf, Source(data, buf)


def manifest(data: np.ndarray):
    return build_manifest(1, [("w", [data.nbytes], "uint8", data.nbytes)], data, chunk_bytes=CHUNK)


def test_clean_transfer_is_one_range_and_returns_the_buffer() -> None:
    data, buf, src = setup()
    out = fetch_verified(buf, manifest(data), src.fill, retries=2)
    assert out is buf and np.array_equal(buf, data)
    assert src.ranges == [(0, NBYTES)]


def test_chunks_are_hashed_while_later_pieces_are_still_arriving(monkeypatch) -> None:
    """The fill holds back its last piece until the hashing thread has checked a chunk."""
    hashed = threading.Event()

    class Spy:
        @staticmethod
        def xxh3_64_hexdigest(b) -> str:
            hashed.set()
            return xxhash.xxh3_64_hexdigest(b)

    data, buf, src = setup()
    m = manifest(data)
    monkeypatch.setattr(transport_base, "xxhash", Spy)
    seen_before_last: list[bool] = []

    def fill(lo: int, hi: int) -> Iterator[int]:
        for landed in src.fill(lo, hi):
            if landed == hi:
                seen_before_last.append(hashed.wait(timeout=10))
            yield landed

    fetch_verified(buf, m, fill, retries=0)
    assert seen_before_last == [True]
    assert np.array_equal(buf, data)


@pytest.mark.parametrize(
    ("offset", "chunk"),
    [(5 * CHUNK + 17, 5), (2 * CHUNK + 99, 2), (NBYTES - 1, 10), (PIECE, 2)],
    ids=["middle", "chunk-end", "short-last-chunk", "piece-boundary"],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_a_chunk_corrupted_in_transit_is_refetched_alone(offset: int, chunk: int, threads: int, monkeypatch) -> None:
    monkeypatch.setattr(transport_base, "hash_threads", lambda: threads)
    data, buf, src = setup()
    src.bad_bytes[offset] = 1  # wrong on the first pass only
    fetch_verified(buf, manifest(data), src.fill, retries=3)
    assert np.array_equal(buf, data)
    assert src.ranges == [(0, NBYTES), (chunk * CHUNK, min((chunk + 1) * CHUNK, NBYTES))]


def test_corrupt_hook_sees_each_span_before_it_is_hashed() -> None:
    data, buf, src = setup()
    spans: list[tuple[int, int]] = []

    def hook(b: np.ndarray, lo: int, hi: int) -> None:
        spans.append((lo, hi))
        if lo <= 3 * CHUNK < hi:
            b[3 * CHUNK] ^= 1

    fetch_verified(buf, manifest(data), src.fill, retries=1, corrupt_hook=hook)
    assert spans == [(0, 250), (250, 500), (500, 750), (750, 1000), (1000, NBYTES)]
    assert src.ranges == [(0, NBYTES), (300, 400)]  # the hook ran on the first pass only
    assert np.array_equal(buf, data)


def test_a_refetch_that_is_corrupted_again_is_retried() -> None:
    data, buf, src = setup()
    src.bad_bytes[4 * CHUNK + 1] = 2  # first pass and first re-fetch both wrong
    fetch_verified(buf, manifest(data), src.fill, retries=2)
    assert np.array_equal(buf, data)
    assert src.ranges == [(0, NBYTES), (400, 500), (400, 500)]


@pytest.mark.parametrize("threads", [1, 3])
def test_corruption_that_never_clears_raises_after_the_retries(threads: int, monkeypatch) -> None:
    monkeypatch.setattr(transport_base, "hash_threads", lambda: threads)
    data, buf, src = setup()
    src.bad_bytes[7 * CHUNK] = 10**6
    src.bad_bytes[NBYTES - 2] = 10**6
    with pytest.raises(ChecksumError, match=r"version 1: chunks \[7, 10\] still corrupted after 2 re-fetches"):
        fetch_verified(buf, manifest(data), src.fill, retries=2)
    assert src.ranges == [(0, NBYTES)] + [(700, 800), (1000, NBYTES)] * 2


def test_a_transfer_error_propagates() -> None:
    data, buf, src = setup()

    def fill(lo: int, hi: int) -> Iterator[int]:
        yield from src.fill(lo, lo + PIECE)
        raise ConnectionError("peer closed the connection mid-transfer")

    with pytest.raises(ConnectionError, match="mid-transfer"):
        fetch_verified(buf, manifest(data), fill, retries=3)


def test_a_manifest_whose_chunk_count_does_not_fit_the_size_is_refused() -> None:
    data, buf, src = setup()
    m = manifest(data)
    wrong = m.model_copy(update={"chunk_checksums": m.chunk_checksums[:-1]})
    with pytest.raises(ChecksumError, match="10 chunk checksums for 1037 bytes"):
        fetch_verified(buf, wrong, src.fill, retries=3)
    assert src.ranges == []


def test_hash_threads_leave_a_core_to_the_transfer(monkeypatch) -> None:
    for cores, threads in [(1, 1), (2, 1), (3, 2), (16, 4)]:
        monkeypatch.setattr(transport_base.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert transport_base.hash_threads() == threads


def test_exact_multiple_of_the_chunk_size_and_empty_versions() -> None:
    data, buf, src = setup(10 * CHUNK)
    fetch_verified(buf, manifest(data), src.fill, retries=0)
    assert np.array_equal(buf, data)
    data, buf, src = setup(0)
    assert fetch_verified(buf, manifest(data), src.fill, retries=0).nbytes == 0


def test_xxhash_releases_the_gil_while_hashing() -> None:
    """The hashing thread overlaps the transfer only if the hash lets other Python threads run:
    a thread sleeping 1 ms at a time keeps ticking through one long hash call."""
    data = np.ones(256 * 1024 * 1024, dtype=np.uint8)
    xxhash.xxh3_64_hexdigest(data)  # fault the pages in first
    ticks: list[float] = []
    hashing, done = threading.Event(), threading.Event()

    def ticker() -> None:
        hashing.wait()
        while not done.is_set():
            threading.Event().wait(0.001)
            ticks.append(1)

    t = threading.Thread(target=ticker)
    t.start()
    hashing.set()
    threading.Event().wait(0.002)
    n0 = len(ticks)
    xxhash.xxh3_64_hexdigest(memoryview(data))
    n1 = len(ticks)
    done.set()
    t.join()
    assert n1 - n0 >= 3  # a GIL held through the call would allow at most one tick to finish
