"""The `tcp` weight transport (the fallback): one socket per fetch, bytes straight after each reply.

Request: {version, offset, length}; reply: {ok, nbytes} and then `nbytes` raw bytes, or
{ok: False, error}.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import numpy as np

from shared.schema import Manifest
from shared.transport.base import (
    DEFAULT_PIECE_BYTES,
    EgressCounter,
    RequestRefused,
    Streaming,
    Uplink,
    VersionStore,
    fetch_verified,
    receive_buffer,
)
from shared.transport.wire import ControlServer, recv_exact, recv_msg, send_msg, split_address

STREAM_WAIT_S = 60.0  # a relayed version that verifies nothing more for this long is dropped


class TcpWeightServer:
    """A threaded socket server for the last `keep` versions. `sent` counts the payload bytes it
    has sent; `uplink_bytes_per_s` emulates a slower uplink (benchmarks only, `Uplink`)."""

    name = "tcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        keep: int = 3,
        advertise_host: str | None = None,
        uplink_bytes_per_s: float | None = None,
    ):
        self.store = VersionStore(keep)
        self.sent = EgressCounter()
        self.uplink = None if uplink_bytes_per_s is None else Uplink(uplink_bytes_per_s)
        self._control = ControlServer(host, port, self._handle, name="weight-server", advertise_host=advertise_host)
        self.port, self.address = self._control.port, self._control.address

    def serve(self, manifest: Manifest, buf: np.ndarray) -> None:
        self.store.put(manifest, buf)

    def _handle(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                req = recv_msg(sock)
            except (ConnectionError, OSError):
                return
            try:
                buf, off, length = self.store.lookup(req)
            except RequestRefused as exc:
                send_msg(sock, {"ok": False, "error": str(exc)})
                continue
            try:
                send_msg(sock, {"ok": True, "nbytes": length})
                self._send(sock, buf, off, length)
            except (ConnectionError, OSError):  # the client hung up, or a relayed fetch was aborted
                return
            self.sent.add(length)

    def _send(self, sock: socket.socket, buf, off: int, length: int) -> None:
        """Bytes [off, off + length) of `buf`: at once, or piece by piece through the emulated
        uplink, or (a version still arriving, `Streaming`) each piece once it has verified."""
        streaming = buf if isinstance(buf, Streaming) else None
        data = (streaming.buf if streaming is not None else buf).data[off : off + length]
        if self.uplink is None and streaming is None:
            sock.sendall(data)
            return
        for lo in range(0, length, Uplink.SLICE):
            piece = data[lo : lo + Uplink.SLICE]
            if streaming is not None:
                streaming.wait_verified(off + lo + len(piece), STREAM_WAIT_S)
            if self.uplink is not None:
                self.uplink.take(len(piece))
            sock.sendall(piece)

    def close(self) -> None:
        self._control.close()


class TcpWeightClient:
    """Pulls a version over one socket, verifies each chunk, re-fetches corrupted chunks."""

    def __init__(self, retries: int = 3, timeout_s: float = 60.0, piece_bytes: int = DEFAULT_PIECE_BYTES):
        self.retries = retries
        self.timeout_s = timeout_s
        self.piece_bytes = piece_bytes

    def _fetch_range(self, sock: socket.socket, version: int, out: memoryview, offset: int) -> Iterator[int]:
        """Fill `out` with bytes [offset, offset + len(out)), yielding `offset + n` as each piece
        of the first n bytes has landed."""
        send_msg(sock, {"version": version, "offset": offset, "length": len(out)})
        hdr = recv_msg(sock)
        if not hdr.get("ok"):
            raise RuntimeError(f"weight server refused: {hdr.get('error')}")
        for lo in range(0, len(out), self.piece_bytes):
            hi = min(lo + self.piece_bytes, len(out))
            recv_exact(sock, out[lo:hi])
            yield offset + hi

    def fetch(
        self,
        address: str,
        manifest: Manifest,
        *,
        out: np.ndarray | None = None,
        corrupt_hook: Callable[[np.ndarray, int, int], None] | None = None,
        on_ok: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """The version, verified chunk by chunk while it arrives (`fetch_verified`; `on_ok(i)`
        as chunk i matches), in `out` (reused, e.g. across a generator's swaps) or a fresh buffer."""
        buf = receive_buffer(manifest, out)
        view = buf.data
        with socket.create_connection(split_address(address), timeout=self.timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return fetch_verified(
                buf,
                manifest,
                lambda lo, hi: self._fetch_range(sock, manifest.version, view[lo:hi], lo),
                self.retries,
                corrupt_hook,
                on_ok,
            )

    def close(self) -> None:
        pass
