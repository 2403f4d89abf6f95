"""What every weight transport shares: manifests with checksums, verification, the store of
served versions, and the server and client interfaces.

A version is one flat byte buffer (every tensor back to back) plus a `Manifest` (name, shape,
dtype, byte offset of each tensor; an xxh3 checksum per chunk and one for the version). The trainer
serves the last few versions; a generator pulls the buffer, verifies every chunk (re-fetching a
corrupted one) and only then loads it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import xxhash

from shared.schema import Manifest, TensorEntry

log = logging.getLogger(__name__)

Buffer = Any  # bytes, memoryview or a contiguous numpy array (numpy's stubs are not `Buffer`)

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


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
    for attempt in range(retries + 1):
        bad = bad_chunks(buf, manifest)
        if not bad:
            return buf
        if attempt == retries:
            break
        log.warning("version %d: %d corrupted chunk(s) %s; re-fetching", manifest.version, len(bad), bad[:8])
        cb = manifest.chunk_bytes
        for i in bad:
            refetch(i * cb, min((i + 1) * cb, manifest.total_bytes))
    raise ChecksumError(f"version {manifest.version}: chunks {bad[:8]} still corrupted after {retries} re-fetches")


def fetch_verified(buf: np.ndarray, manifest: Manifest, fill: Callable[[int, int], None], retries: int,
                   corrupt_hook: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """Fill all of `buf` (`fill(lo, hi)` lands bytes [lo, hi) of the version in it), then verify
    it and re-fetch bad chunks (`verify_and_repair`). `corrupt_hook`: tests inject transit
    corruption between the transfer and the check."""
    fill(0, manifest.total_bytes)
    if corrupt_hook is not None:
        corrupt_hook(buf)
    return verify_and_repair(buf, manifest, fill, retries)


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

    def fetch(self, address: str, manifest: Manifest) -> np.ndarray: ...

    def close(self) -> None: ...
