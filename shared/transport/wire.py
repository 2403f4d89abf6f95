"""The control channel every weight transport speaks: length-prefixed msgpack frames over TCP,
and the threaded server that accepts those connections. No pickle: frames are msgpack maps."""

from __future__ import annotations

import socket
import socketserver
import struct
import threading
from collections.abc import Callable

import msgpack

_LEN = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 20


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; raises ConnectionError if the peer closes first."""
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        view = view[n:]


def send_msg(sock: socket.socket, obj: dict) -> None:
    """Send one frame: a little-endian u32 length, then `obj` as msgpack."""
    body = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_msg(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> dict:
    """Receive one frame (`send_msg`).

    Raises:
        ConnectionError: the peer closed, the frame is over `limit` bytes, or it is not a map.
    """
    hdr = bytearray(_LEN.size)
    recv_exact(sock, memoryview(hdr))
    (n,) = _LEN.unpack(hdr)
    if n > limit:
        raise ConnectionError(f"header of {n} bytes exceeds {limit}")
    body = bytearray(n)
    recv_exact(sock, memoryview(body))
    obj = msgpack.unpackb(bytes(body), raw=False)
    if not isinstance(obj, dict):
        raise ConnectionError("malformed header")
    return obj


def split_address(address: str) -> tuple[str, int]:
    """`host:port` -> (host, port)."""
    host, port = address.rsplit(":", 1)
    return host, int(port)


class ControlServer:
    """A TCP server that calls `handle(sock)` for each connection, in a thread of its own; serves
    from a daemon thread named `name` until `close`. `address` is `host:port` as clients reach
    it (`advertise_host` in place of the bind host, e.g. behind 0.0.0.0)."""

    def __init__(
        self,
        host: str,
        port: int,
        handle: Callable[[socket.socket], None],
        *,
        name: str,
        advertise_host: str | None = None,
    ):
        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._srv = Server((host, port), Handler)
        self.port: int = self._srv.server_address[1]
        self.address = f"{advertise_host or host}:{self.port}"
        # close() waits for the serving loop's next poll: a short interval keeps a trainer of the
        # fleet from waiting half a second (the default) between one job and the next
        self._thread = threading.Thread(
            target=self._srv.serve_forever, kwargs={"poll_interval": 0.05}, name=name, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()
