"""The `ucx` weight transport (ucxx): the trainer pushes a version straight into the generator's buffer.

Wire protocol. A small TCP control channel (`address` is its `host:port`, like the `tcp`
transport's) carries msgpack frames; the bytes go over UCX tag messages:

    client -> server  {"worker": <client UCX worker address>}      once per connection
    server -> client  {"ok": True}                                 endpoint to the client is made
    client -> server  {"version", "offset", "length", "tag", "piece"}
    server -> client  {"ok": True, "nbytes"} | {"ok": False, "error"}
    server => client  ceil(length / piece) UCX tag messages, tag + i, all in flight at once
    server -> client  {"ok": True} once every send completed | {"ok": False, "error"}

The data flows server -> client, so it is the *client's* worker address that is exchanged out of
band (on the control channel), and the server makes an endpoint from it with error handling off:
that is what lets UCX use shared memory / CMA zero-copy between two processes on one box (listener
endpoints need error handling on, which forces `tcp/lo`; measured in results/transfer.md).
Between hosts UCX picks TCP (the PyPI libucx has no RDMA), with 512k segments (3x over defaults).

Each process has one UCX context + worker, progressed by ucxx's own C++ thread (no asyncio, no
GIL held while bytes move), so the API is synchronous and safe to call from a vLLM worker process
or from several threads at once. Requests are waited on by polling `completed` with a short
backoff; the client polls its piece receives in order, reporting each landed piece (so the
verification hashes it while later pieces arrive), and watches the control socket for the server's
report of a failed send.

Buffers are passed to UCX as they are: numpy arrays via `__array_interface__`, CUDA tensors via
`__cuda_array_interface__` (a server may serve a CUDA uint8 tensor; `fetch_into` may land in one).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from shared.schema import Manifest
from shared.transport.base import (
    DEFAULT_PIECE_BYTES,
    Buffer,
    EgressCounter,
    RequestRefused,
    Streaming,
    VersionStore,
    fetch_verified,
    receive_buffer,
)
from shared.transport.wire import ControlServer, recv_msg, send_msg, split_address

log = logging.getLogger(__name__)

_TAG_BITS = 24  # low tag bits number the pieces of one request; the rest is a per-process counter
_MAX_POLL_S = 2e-4
_PEER_CHECK_S = 0.02
# The progress thread sleeps in epoll; the timeout is only a safety net against a missed wake-up.
# ucxx's own 1 ms costs ~2% of a core per idle process here; 10 ms, a tenth of that.
_EPOLL_TIMEOUT_MS = 10

# UCX options we set unless the environment already does (UCX_<name> wins). UCX_TLS stays at its
# default ("all"): on one box that includes sysv/posix + cma, on a GPU box cuda_copy/cuda_ipc.
_UCX_DEFAULTS = {
    "TCP_TX_SEG_SIZE": "512k",
    "TCP_RX_SEG_SIZE": "512k",
    # ucxx sets UCX_MEMTYPE_CACHE=n on import, which UCX 1.21 reports as unused on every start.
    "WARN_UNUSED_ENV_VARS": "n",
}


def ucx_options() -> dict[str, str]:
    """The UCX config this module passes to its context: defaults the environment doesn't override."""
    return {k: v for k, v in _UCX_DEFAULTS.items() if f"UCX_{k}" not in os.environ}


def _current_cuda_device() -> int | None:
    """The caller's CUDA device if this process already uses CUDA through torch, else None.

    Never imports torch or initialises CUDA itself (`shared` stays light and CPU-safe).
    """
    torch: Any = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:  # a broken CUDA setup only means: no CUDA context for the progress thread
        return None
    return None


def _bind_cuda_device(device: int | None) -> None:
    """Progress-thread start hook: UCX's CUDA transports need a current context in that thread."""
    if device is not None:
        from ucxx._cuda_context import ensure_cuda_context

        ensure_cuda_context(device)


class _UcxWorker:
    """This process's UCX context and worker, progressed by a C++ thread (blocking epoll mode)."""

    def __init__(self) -> None:
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array

        self.api, self.Array, self.pid = ucx_api, Array, os.getpid()
        self.context = ucx_api.UCXContext(ucx_options(), feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        # Delayed submission: requests posted from any Python thread are handed to the progress
        # thread, so only that thread touches the UCP worker.
        self.worker = ucx_api.UCXWorker(self.context, enable_delayed_submission=True)
        self.worker.set_progress_thread_start_callback(_bind_cuda_device, cb_args=(_current_cuda_device(),))
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=_EPOLL_TIMEOUT_MS)
        self.address = bytes(self.worker.address)
        self._requests = itertools.count(1)
        self._stopped = False

    def new_tag(self) -> int:
        """A tag base no other request in this process uses; pieces add their index."""
        return next(self._requests) << _TAG_BITS

    def endpoint(self, worker_address: bytes) -> Any:
        addr = self.api.UCXAddress.create_from_buffer(worker_address)
        return self.worker.create_endpoint_from_worker_address(addr, False)

    def send(self, ep: Any, buf: Any, tag: int) -> tuple[Any, Any]:
        arr = self.Array(buf)  # returned with the request: the buffer must outlive the transfer
        return ep.tag_send(arr, self.api.UCXXTag(tag)), arr

    def recv(self, buf: Any, tag: int) -> tuple[Any, Any]:
        arr = self.Array(buf)
        return self.worker.tag_recv(arr, self.api.UCXXTag(tag)), arr

    def stop(self) -> None:
        if not self._stopped and os.getpid() == self.pid:
            self._stopped = True
            self.worker.stop_progress_thread()


_worker: _UcxWorker | None = None
_worker_lock = threading.Lock()


def get_worker() -> _UcxWorker:
    """This process's UCX worker, made on first use (and again in a forked child)."""
    global _worker
    with _worker_lock:
        if _worker is None or _worker.pid != os.getpid():
            _worker = _UcxWorker()
            atexit.register(_worker.stop)
        return _worker


def _wait(pending: list[tuple[Any, Any]], timeout_s: float, what: str, peer: socket.socket | None = None) -> None:
    """Block until every request completes; raise the first UCX error, or TimeoutError, or
    ConnectionError as soon as `peer` (the control socket) hangs up: with endpoint error handling
    off, UCX itself never reports a vanished peer."""
    start = time.monotonic()
    delay, checked = 1e-5, start
    for req, _buf in pending:
        while not req.completed:
            now = time.monotonic()
            if now - start > timeout_s:
                raise TimeoutError(f"{what}: UCX transfer not done after {timeout_s:.0f} s")
            if peer is not None and now - checked > _PEER_CHECK_S:
                checked = now
                if _hung_up(peer):
                    raise ConnectionError(f"{what}: the client hung up mid-transfer")
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_S)
        req.check_error()


def _hung_up(sock: socket.socket) -> bool:
    """True once the peer closed `sock` (readable with nothing to read); never blocks."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _check_done(msg: dict) -> None:
    if not msg.get("ok"):
        raise RuntimeError(f"weight server failed mid-transfer: {msg.get('error')}")


def _pieces(length: int, piece: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + piece, length)) for lo in range(0, length, piece)]


class UcxWeightServer:
    """Serves the last `keep` versions: a TCP control channel, bytes pushed over UCX endpoints.

    `serve` takes any contiguous 1-D uint8 buffer that ucxx accepts: a numpy array, or a CUDA
    tensor (`__cuda_array_interface__`). `timeout_s` bounds one range's sends (a client that
    vanished mid-transfer, with endpoint error handling off, is only noticed this way).
    """

    name = "ucx"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        keep: int = 3,
        advertise_host: str | None = None,
        timeout_s: float = 120.0,
    ):
        self.store = VersionStore(keep)
        self.sent = EgressCounter()  # payload bytes sent
        self.timeout_s = timeout_s
        self.ucx = get_worker()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._control = ControlServer(host, port, self._handle, name="ucx-weight-server", advertise_host=advertise_host)
        self.port, self.address = self._control.port, self._control.address

    def serve(self, manifest: Manifest, buf: np.ndarray) -> None:
        self.store.put(manifest, buf)

    def _handle(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._conns_lock:
            self._conns.add(sock)
        ep = None
        try:
            hello = recv_msg(sock)
            worker_address = hello.get("worker")
            if not isinstance(worker_address, bytes):
                send_msg(sock, {"ok": False, "error": "expected {'worker': <UCX worker address>}"})
                return
            ep = self.ucx.endpoint(worker_address)
            send_msg(sock, {"ok": True})
            while True:
                self._serve_range(sock, ep, recv_msg(sock))
        except (ConnectionError, OSError):
            return  # the client hung up, close() shut the socket, or a failed transfer (logged)
        except Exception:  # the per-connection boundary: log, drop this client, keep serving
            log.exception("ucx weight server: dropping the connection")
        finally:
            with self._conns_lock:
                self._conns.discard(sock)
            if ep is not None:
                ep.close_blocking(period=10**9, max_attempts=1)

    def _serve_range(self, sock: socket.socket, ep: Any, req: dict) -> None:
        try:
            buf, off, length = self.store.lookup(req)
        except RequestRefused as exc:
            send_msg(sock, {"ok": False, "error": str(exc)})
            return
        if isinstance(buf, Streaming):  # a version a relay still fetches: send the range once verified
            buf.wait_verified(off + length, self.timeout_s)
            buf = buf.buf
        tag, piece = int(req.get("tag", 0)), int(req.get("piece", DEFAULT_PIECE_BYTES))
        if piece <= 0 or -(-length // piece) >= 1 << _TAG_BITS:
            send_msg(sock, {"ok": False, "error": f"piece size {piece} invalid for {length} bytes"})
            return
        send_msg(sock, {"ok": True, "nbytes": length})
        pending = [
            self.ucx.send(ep, buf[off + lo : off + hi], tag + i) for i, (lo, hi) in enumerate(_pieces(length, piece))
        ]
        try:
            _wait(pending, self.timeout_s, f"version {req.get('version')} range {off}+{length}", sock)
        except Exception as exc:
            log.warning("ucx weight server: %s: %s; dropping the connection", type(exc).__name__, exc)
            send_msg(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            raise
        self.sent.add(length)
        send_msg(sock, {"ok": True})

    def close(self) -> None:
        self._control.close()
        with self._conns_lock:
            conns = list(self._conns)
        for sock in conns:  # wakes each handler, which then closes its endpoint
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class UcxWeightClient:
    """Pulls a version over UCX into a fresh buffer, verifies each chunk, re-fetches bad chunks.

    `timeout_s` bounds each control-channel step, including waiting for one range's transfer.
    `piece_bytes` is the size of the tag messages a range is cut into (all in flight at once).
    """

    def __init__(self, retries: int = 3, timeout_s: float = 60.0, piece_bytes: int = DEFAULT_PIECE_BYTES):
        self.retries = retries
        self.timeout_s = timeout_s
        self.piece_bytes = piece_bytes

    def _connect(self, address: str) -> socket.socket:
        ucx = get_worker()
        sock = socket.create_connection(split_address(address), timeout=self.timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_msg(sock, {"worker": ucx.address})
            hello = recv_msg(sock)
            if not hello.get("ok"):
                raise RuntimeError(f"weight server refused: {hello.get('error')}")
        except BaseException:
            sock.close()
            raise
        return sock

    def _fetch_range(self, sock: socket.socket, version: int, out: Buffer, offset: int) -> Iterator[int]:
        """Fill `out` (host or CUDA memory, 1-D uint8) with bytes [offset, offset + len(out)),
        yielding `offset + n` as soon as the first n bytes have landed, piece by piece."""
        ucx = get_worker()
        tag = ucx.new_tag()
        what = f"version {version} range {offset}+{len(out)}"
        send_msg(
            sock,
            {
                "version": version,
                "offset": offset,
                "length": len(out),
                "tag": tag,
                "piece": self.piece_bytes,
            },
        )
        hdr = recv_msg(sock)
        if not hdr.get("ok"):
            raise RuntimeError(f"weight server refused: {hdr.get('error')}")
        pieces = _pieces(len(out), self.piece_bytes)
        pending = [ucx.recv(out[lo:hi], tag + i) for i, (lo, hi) in enumerate(pieces)]
        done = False
        deadline = time.monotonic() + self.timeout_s
        for (req, _arr), (_lo, hi) in zip(pending, pieces, strict=True):
            delay = 1e-5
            while not req.completed:
                # the server reports a failed send on the control socket; the receive would hang
                if not done and select.select([sock], [], [], 0)[0]:
                    _check_done(recv_msg(sock))
                    done = True
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: UCX transfer not done after {self.timeout_s:.0f} s")
                time.sleep(delay)
                delay = min(delay * 2, _MAX_POLL_S)
            req.check_error()
            yield offset + hi
        if not done:
            _check_done(recv_msg(sock))

    def fetch_into(self, address: str, manifest: Manifest, out: Buffer) -> None:
        """Raw transfer of the whole version into `out` (e.g. a CUDA uint8 tensor); no verification."""
        if out.nbytes != manifest.total_bytes:
            raise ValueError("destination size does not match the manifest")
        with self._connect(address) as sock:
            for _ in self._fetch_range(sock, manifest.version, out, 0):
                pass

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
        with self._connect(address) as sock:
            return fetch_verified(
                buf,
                manifest,
                lambda lo, hi: self._fetch_range(sock, manifest.version, buf[lo:hi], lo),
                self.retries,
                corrupt_hook,
                on_ok,
            )

    def close(self) -> None:
        pass  # connections live for one fetch; the process's UCX worker stops at exit
