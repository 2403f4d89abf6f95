"""What every weight transport shares: manifests with checksums, verification, the store of
served versions, and the server and client interfaces.

A version is one flat byte buffer (every tensor back to back) plus a `Manifest` (name, shape,
dtype, byte offset of each tensor; an xxh3 checksum per chunk and one for the version). The trainer
serves the last few versions; a generator pulls the buffer, verifies every chunk as soon as it has
landed (while later ones are still arriving; a corrupted chunk is re-fetched alone) and only then
loads it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import xxhash

from shared.schema import Manifest, TensorEntry

log = logging.getLogger(__name__)

Buffer = Any  # bytes, memoryview or a contiguous numpy array (numpy's stubs are not `Buffer`)

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
# A fetch lands (and reports) its bytes in pieces of this size, so hashing can follow the transfer.
DEFAULT_PIECE_BYTES = 16 * 1024 * 1024


class ChecksumError(RuntimeError):
    """A fetched buffer that does not match its manifest after retries."""


class RequestRefused(Exception):
    """A range request a server cannot answer (version not served, range outside the buffer);
    the message is the reason sent to the client."""


def chunk_checksums(buf: Buffer, chunk_bytes: int) -> list[str]:
    mv = memoryview(buf).cast("B")
    return [xxhash.xxh3_64_hexdigest(mv[i : i + chunk_bytes]) for i in range(0, len(mv), chunk_bytes)]


def version_checksum(chunks: Sequence[str]) -> str:
    return xxhash.xxh3_64_hexdigest("".join(chunks).encode())


def build_manifest(
    version: int,
    entries: Sequence[tuple[str, Sequence[int], str, int]],
    buf: Buffer,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Manifest:
    """entries: (name, shape, dtype name, nbytes) in buffer order; offsets are assigned contiguously."""
    tensors, off = [], 0
    for name, shape, dtype, nbytes in entries:
        tensors.append(TensorEntry(name=name, shape=list(shape), dtype=dtype, offset=off, nbytes=nbytes))
        off += nbytes
    total = memoryview(buf).nbytes
    if off != total:
        raise ValueError(f"tensor sizes add up to {off} bytes but the buffer holds {total}")
    chunks = chunk_checksums(buf, chunk_bytes)
    return Manifest(
        version=version,
        tensors=tensors,
        total_bytes=total,
        chunk_bytes=chunk_bytes,
        chunk_checksums=chunks,
        checksum=version_checksum(chunks),
    )


def bad_chunks(buf: Buffer, manifest: Manifest) -> list[int]:
    """Indices of chunks whose checksum does not match the manifest."""
    got = chunk_checksums(buf, manifest.chunk_bytes)
    if len(got) != len(manifest.chunk_checksums):
        return list(range(len(manifest.chunk_checksums)))
    return [i for i, (a, b) in enumerate(zip(got, manifest.chunk_checksums, strict=True)) if a != b]


def verify_and_repair(
    buf: np.ndarray, manifest: Manifest, refetch: Callable[[int, int], None], retries: int
) -> np.ndarray:
    """Check every chunk of a fetched buffer; re-fetch only the bad byte ranges [lo, hi) with
    `refetch`, up to `retries` rounds. Returns the verified buffer or raises ChecksumError."""
    return _repair(buf, manifest, refetch, bad_chunks(buf, manifest), retries)


def _repair(
    buf: Buffer,
    manifest: Manifest,
    refetch: Callable[[int, int], None],
    bad: list[int],
    retries: int,
    on_ok: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Re-fetch the chunks in `bad` and re-check only those, up to `retries` rounds (`on_ok(i)`:
    called for each chunk once it matches)."""
    cb, want = manifest.chunk_bytes, manifest.chunk_checksums
    mv = memoryview(buf).cast("B")
    for _ in range(retries):
        if not bad:
            return buf
        log.warning("version %d: %d corrupted chunk(s) %s; re-fetching", manifest.version, len(bad), bad[:8])
        for i in bad:
            refetch(i * cb, min((i + 1) * cb, manifest.total_bytes))
        still = [i for i in bad if xxhash.xxh3_64_hexdigest(mv[i * cb : (i + 1) * cb]) != want[i]]
        if on_ok is not None:
            for i in sorted(set(bad) - set(still)):
                on_ok(i)
        bad = still
    if not bad:
        return buf
    raise ChecksumError(f"version {manifest.version}: chunks {bad[:8]} still corrupted after {retries} re-fetches")


def receive_buffer(manifest: Manifest, out: np.ndarray | None = None) -> np.ndarray:
    """`out` checked to fit the version, or a fresh buffer (a reused one skips the page faults of
    touching new memory: at 1 GB those cost about as much as the transfer itself)."""
    if out is None:
        return np.empty(manifest.total_bytes, dtype=np.uint8)
    if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or out.nbytes != manifest.total_bytes:
        raise ValueError(f"destination must be a contiguous uint8 array of {manifest.total_bytes} bytes")
    return out


def hash_threads() -> int:
    """Threads that hash a fetch's chunks: the cores this process may use, less one for the
    transfer itself (UCX's progress thread or the socket reads), at least 1, at most 4."""
    return max(1, min(4, len(os.sched_getaffinity(0)) - 1))


Fill = Callable[[int, int], Iterable[int]]
"""`fill(lo, hi)` lands bytes [lo, hi) of a version at the same offsets of the buffer, yielding the
offset below which every byte has landed, increasing, as the transfer goes (the last one is hi)."""


def fetch_verified(
    buf: Buffer,
    manifest: Manifest,
    fill: Fill,
    retries: int,
    corrupt_hook: Callable[[np.ndarray, int, int], None] | None = None,
    on_ok: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Fill all of `buf` while hashing threads (`hash_threads`) check each chunk as soon as it has
    landed (the hash overlaps the rest of the transfer), then re-fetch the bad chunks only, up to
    `retries` rounds. Returns `buf` once every chunk matches the manifest; raises ChecksumError otherwise.

    `corrupt_hook(buf, lo, hi)`: tests inject transit corruption into each span [lo, hi) of the
    first pass as it lands, before any of its chunks is hashed.
    `on_ok(i)`: called (from a hashing thread) as soon as chunk i matches the manifest; a relay
    passes on a version's verified chunks while the rest still arrive (`Streaming`).
    """
    cb, total, want = manifest.chunk_bytes, manifest.total_bytes, manifest.chunk_checksums
    if len(want) != -(-total // cb):
        raise ChecksumError(f"version {manifest.version}: {len(want)} chunk checksums for {total} bytes")
    mv = memoryview(buf).cast("B")

    def corrupted(i: int) -> bool:
        # xxhash (4.x) releases the GIL while it hashes, so this overlaps the transfer
        bad = xxhash.xxh3_64_hexdigest(mv[i * cb : (i + 1) * cb]) != want[i]
        if not bad and on_ok is not None:
            on_ok(i)
        return bad

    with ThreadPoolExecutor(hash_threads(), thread_name_prefix="verify") as hasher:
        checks: list[Future[bool]] = []  # one per chunk, in chunk order
        landed_before = 0
        try:
            for landed in fill(0, total):
                if corrupt_hook is not None:
                    corrupt_hook(buf, landed_before, landed)
                landed_before = landed
                ready = len(want) if landed >= total else landed // cb
                checks += [hasher.submit(corrupted, i) for i in range(len(checks), ready)]
        except BaseException:
            for f in checks:
                f.cancel()
            raise
        bad = [i for i, f in enumerate(checks) if f.result()]
    hashed = len(checks)
    if hashed < len(want):
        raise ChecksumError(f"version {manifest.version}: the transfer ended at byte {landed_before} of {total}")

    def refetch(lo: int, hi: int) -> None:
        for _ in fill(lo, hi):
            pass

    return _repair(buf, manifest, refetch, bad, retries, on_ok)


class Streaming:
    """A version a relay is still fetching, served as far as it has verified: its buffer, and the
    prefix of chunks that matched the manifest so far. A server sends a range of it piece by piece,
    each piece only once every byte of it verified (`wait_verified`), so bytes that did not verify
    are never passed on; a fetch that fails `abort`s it and cuts off whoever is reading it."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.buf = np.empty(manifest.total_bytes, dtype=np.uint8)
        self.nbytes = manifest.total_bytes
        self._ok = bytearray(len(manifest.chunk_checksums))
        self._prefix = 0  # chunks verified contiguously from the start
        self._aborted = False
        self._cond = threading.Condition()

    def mark(self, i: int) -> None:
        """Chunk i matched the manifest (`fetch_verified`'s `on_ok`)."""
        with self._cond:
            self._ok[i] = 1
            while self._prefix < len(self._ok) and self._ok[self._prefix]:
                self._prefix += 1
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def verified_bytes(self) -> int:
        with self._cond:
            return min(self._prefix * self.manifest.chunk_bytes, self.nbytes)

    def wait_verified(self, hi: int, timeout_s: float) -> None:
        """Block until bytes [0, hi) have verified.

        Raises:
            ConnectionError: the fetch was aborted, or nothing verified for `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while min(self._prefix * self.manifest.chunk_bytes, self.nbytes) < hi:
                left = deadline - time.monotonic()
                if self._aborted or left <= 0:
                    raise ConnectionError(
                        f"version {self.manifest.version}: "
                        f"{'fetch aborted' if self._aborted else 'no progress'} at byte "
                        f"{self._prefix * self.manifest.chunk_bytes}"
                    )
                self._cond.wait(left)


class Uplink:
    """An emulated uplink: at most `rate` bytes/s leave a server through it, shared fairly by all its
    connections (a virtual-time token bucket). For benchmarks that model a network where each
    node's uplink is the constraint (loopback is as fast as memory); never on by default."""

    SLICE = 256 * 1024  # bytes sent per grant: connections interleave at this grain
    BURST = 4 * SLICE  # credit a late sender may catch up on (a sleep that overshot wastes no link time)

    def __init__(self, rate: float):
        if rate <= 0:
            raise ValueError(f"uplink rate must be > 0 bytes/s, got {rate}")
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link has sent everything granted so far

    def take(self, n: int) -> None:
        """Block until `n` more bytes may leave."""
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now - self.BURST / self.rate) + n / self.rate
            wait = self._free_at - now  # the bytes are out once the earlier grants and their own time are
        if wait > 0:
            time.sleep(wait)


class EgressCounter:
    """Bytes a server has sent, thread-safe (a server's egress per version is a difference of two reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n


class VersionStore:
    """The last `keep` versions' buffers a server holds, by version number; thread-safe."""

    def __init__(self, keep: int):
        self.keep = keep
        self._lock = threading.Lock()
        self._bufs: OrderedDict[int, Any] = OrderedDict()

    def put(self, manifest: Manifest, buf: Any) -> None:
        """Hold `buf` as `manifest`'s version, dropping the oldest beyond `keep`.

        Raises:
            ValueError: the buffer's size is not the manifest's.
        """
        if buf.nbytes != manifest.total_bytes:
            raise ValueError("buffer size does not match the manifest")
        with self._lock:
            self._bufs[manifest.version] = buf
            while len(self._bufs) > self.keep:
                self._bufs.popitem(last=False)

    def drop(self, version: int) -> None:
        """Serve `version` no more (a relay whose fetch of it failed)."""
        with self._lock:
            self._bufs.pop(version, None)

    def get(self, version: int) -> Any | None:
        with self._lock:
            return self._bufs.get(version)

    def versions(self) -> list[int]:
        with self._lock:
            return list(self._bufs)

    def lookup(self, req: dict) -> tuple[Any, int, int]:
        """The buffer and the range (offset, length) a request {version, offset, length} asks for.

        Raises:
            RequestRefused: the version is not held, or the range is outside its buffer.
        """
        buf = self.get(int(req.get("version", -1)))
        if buf is None:
            raise RequestRefused(f"version {req.get('version')} not served; have {self.versions()}")
        off, length = int(req.get("offset", 0)), int(req.get("length", buf.nbytes))
        if off < 0 or length < 0 or off + length > buf.nbytes:
            raise RequestRefused(f"range {off}+{length} outside {buf.nbytes} bytes")
        return buf, off, length


class WeightServer(Protocol):
    """Trainer side: serve the last few versions' buffers."""

    name: str
    address: str

    def serve(self, manifest: Manifest, buf: np.ndarray) -> None: ...

    def close(self) -> None: ...


class WeightClient(Protocol):
    """Generator side: pull one version into a verified buffer."""

    def fetch(
        self,
        address: str,
        manifest: Manifest,
        *,
        out: np.ndarray | None = None,
        on_ok: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """The verified version, in `out` when given (a buffer reused across fetches); `on_ok(i)`
        as soon as chunk i matched the manifest (a relay passes it on then)."""
        ...

    def close(self) -> None: ...
