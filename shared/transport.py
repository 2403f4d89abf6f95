"""Weight transfer trainer -> generators: manifests with checksums, and transports behind one interface.

A version is one flat byte buffer (every tensor back to back) plus a `Manifest` (name, shape,
dtype, byte offset of each tensor; an xxh3 checksum per chunk and one for the version). The trainer
serves the last few versions; a generator pulls the buffer, verifies every chunk (re-fetching a
corrupted one) and only then loads it.

Transports: `tcp` (a plain socket server; the fallback). The UCX transport registers here too.
No pickle anywhere: requests and headers are msgpack, payloads are raw bytes.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from importlib import import_module
from typing import Any, Protocol

import msgpack
import numpy as np
import xxhash

from shared.schema import Manifest, TensorEntry

log = logging.getLogger(__name__)

Buffer = Any  # bytes, memoryview or a contiguous numpy array (numpy's stubs are not `Buffer`)

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
_LEN = struct.Struct("<I")


class ChecksumError(RuntimeError):
    """A fetched buffer that does not match its manifest after retries."""


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


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        view = view[n:]


def _send_msg(sock: socket.socket, obj: dict) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_msg(sock: socket.socket, limit: int = 1 << 20) -> dict:
    hdr = bytearray(_LEN.size)
    _recv_exact(sock, memoryview(hdr))
    (n,) = _LEN.unpack(hdr)
    if n > limit:
        raise ConnectionError(f"header of {n} bytes exceeds {limit}")
    body = bytearray(n)
    _recv_exact(sock, memoryview(body))
    obj = msgpack.unpackb(bytes(body), raw=False)
    if not isinstance(obj, dict):
        raise ConnectionError("malformed header")
    return obj


class _Store:
    """The last `keep` versions' buffers, by version number."""

    def __init__(self, keep: int):
        self.keep = keep
        self._lock = threading.Lock()
        self._bufs: OrderedDict[int, np.ndarray] = OrderedDict()

    def put(self, version: int, buf: np.ndarray) -> None:
        with self._lock:
            self._bufs[version] = buf
            while len(self._bufs) > self.keep:
                self._bufs.popitem(last=False)

    def get(self, version: int) -> np.ndarray | None:
        with self._lock:
            return self._bufs.get(version)

    def versions(self) -> list[int]:
        with self._lock:
            return list(self._bufs)


class TcpWeightServer:
    """A threaded socket server. Request: {version, offset, length}; reply: {ok, nbytes|error} + bytes."""

    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, keep: int = 3, advertise_host: str | None = None):
        self.store = _Store(keep)
        store = self.store

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while True:
                    try:
                        req = _recv_msg(sock)
                    except (ConnectionError, OSError):
                        return
                    buf = store.get(int(req.get("version", -1)))
                    if buf is None:
                        _send_msg(sock, {"ok": False, "error": f"version {req.get('version')} not served; have {store.versions()}"})
                        continue
                    off, length = int(req.get("offset", 0)), int(req.get("length", buf.nbytes))
                    if off < 0 or length < 0 or off + length > buf.nbytes:
                        _send_msg(sock, {"ok": False, "error": f"range {off}+{length} outside {buf.nbytes} bytes"})
                        continue
                    _send_msg(sock, {"ok": True, "nbytes": length})
                    sock.sendall(buf.data[off : off + length])

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._srv = Server((host, port), Handler)
        self.port = self._srv.server_address[1]
        self.address = f"{advertise_host or host}:{self.port}"
        self._thread = threading.Thread(target=self._srv.serve_forever, name="weight-server", daemon=True)
        self._thread.start()

    def serve(self, manifest: Manifest, buf: np.ndarray) -> None:
        if buf.nbytes != manifest.total_bytes:
            raise ValueError("buffer size does not match the manifest")
        self.store.put(manifest.version, buf)

    def close(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()


class TcpWeightClient:
    """Pulls a version over one socket, verifies each chunk, re-fetches corrupted chunks."""

    def __init__(self, retries: int = 3, timeout_s: float = 60.0):
        self.retries = retries
        self.timeout_s = timeout_s

    def _fetch_range(self, sock: socket.socket, version: int, out: memoryview, offset: int) -> None:
        _send_msg(sock, {"version": version, "offset": offset, "length": len(out)})
        hdr = _recv_msg(sock)
        if not hdr.get("ok"):
            raise RuntimeError(f"weight server refused: {hdr.get('error')}")
        _recv_exact(sock, out)

    def fetch(self, address: str, manifest: Manifest, *, corrupt_hook=None) -> np.ndarray:
        host, port = address.rsplit(":", 1)
        buf = np.empty(manifest.total_bytes, dtype=np.uint8)
        view = buf.data
        with socket.create_connection((host, int(port)), timeout=self.timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._fetch_range(sock, manifest.version, view, 0)
            if corrupt_hook is not None:  # tests inject transit corruption here
                corrupt_hook(buf)
            return verify_and_repair(
                buf, manifest, lambda lo, hi: self._fetch_range(sock, manifest.version, view[lo:hi], lo), self.retries
            )

    def close(self) -> None:
        pass


TRANSPORTS: dict[str, tuple[Any, Any]] = {
    "tcp": (TcpWeightServer, TcpWeightClient),
    # imported on first use (it loads ucxx): `shared` stays importable without ucxx
    "ucx": (
        lambda **kw: import_module("shared.transport_ucx").UcxWeightServer(**kw),
        lambda **kw: import_module("shared.transport_ucx").UcxWeightClient(**kw),
    ),
}


def _transport(name: str) -> tuple[type, type]:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight transport '{name}'; valid: {sorted(TRANSPORTS)}")
    return TRANSPORTS[name]


def make_server(name: str, **kwargs) -> WeightServer:
    return _transport(name)[0](**kwargs)


def make_client(name: str) -> WeightClient:
    return _transport(name)[1]()
