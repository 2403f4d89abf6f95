"""The `tcp` weight transport (the fallback): one socket per fetch, bytes straight after each reply.

Request: {version, offset, length}; reply: {ok, nbytes} and then `nbytes` raw bytes, or
{ok: False, error}.
"""

from __future__ import annotations

import socket

import numpy as np

from shared.schema import Manifest
from shared.transport.base import RequestRefused, VersionStore, fetch_verified
from shared.transport.wire import ControlServer, recv_exact, recv_msg, send_msg, split_address


class TcpWeightServer:
    """A threaded socket server for the last `keep` versions."""

    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, keep: int = 3, advertise_host: str | None = None):
        self.store = VersionStore(keep)
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
            sock.sendall(buf.data[off : off + length])

    def close(self) -> None:
        self._control.close()


class TcpWeightClient:
    """Pulls a version over one socket, verifies each chunk, re-fetches corrupted chunks."""

    def __init__(self, retries: int = 3, timeout_s: float = 60.0):
        self.retries = retries
        self.timeout_s = timeout_s

    def _fetch_range(self, sock: socket.socket, version: int, out: memoryview, offset: int) -> None:
        send_msg(sock, {"version": version, "offset": offset, "length": len(out)})
        hdr = recv_msg(sock)
        if not hdr.get("ok"):
            raise RuntimeError(f"weight server refused: {hdr.get('error')}")
        recv_exact(sock, out)

    def fetch(self, address: str, manifest: Manifest, *, corrupt_hook=None) -> np.ndarray:
        buf = np.empty(manifest.total_bytes, dtype=np.uint8)
        view = buf.data
        with socket.create_connection(split_address(address), timeout=self.timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return fetch_verified(buf, manifest, lambda lo, hi: self._fetch_range(sock, manifest.version, view[lo:hi], lo),
                                  self.retries, corrupt_hook)

    def close(self) -> None:
        pass
