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
    Uplink,
    VersionStore,
    fetch_verified,
    receive_buffer,
)
from shared.transport.wire import ControlServer, recv_exact, recv_msg, send_msg, split_address


class TcpWeightServer:
    """A threaded socket server for the last `keep` versions. `sent` counts the payload bytes it
    has sent; `uplink_bytes_per_s` emulates a slower uplink (benchmarks only, `Uplink`)."""

    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, keep: int = 3, advertise_host: str | None = None,
                 uplink_bytes_per_s: float | None = None):
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
            send_msg(sock, {"ok": True, "nbytes": length})
            data = buf.data[off : off + length]
            if self.uplink is None:
                sock.sendall(data)
            else:
                for lo in range(0, length, Uplink.SLICE):
                    piece = data[lo : lo + Uplink.SLICE]
                    self.uplink.take(len(piece))
                    sock.sendall(piece)
            self.sent.add(length)

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
    ) -> np.ndarray:
        """The version, verified chunk by chunk while it arrives (`fetch_verified`), in `out`
        (reused, e.g. across a generator's swaps) or a fresh buffer."""
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
            )

    def close(self) -> None:
        pass
