"""Where sync reward functions run, each call under a time budget: worker processes or threads.

`WorkerPool` (REWARD_WORKERS > 0) runs worker processes (shared.rewards.worker) that load the
sync leaves of the reward spec and answer one request at a time, msgpack frames over pipes
(nothing is pickled: a request is the leaf's index and the samples' plain fields). The pool's
zygote loads the reward once and forks them. A worker that runs past the budget is SIGKILLed
with its process group and a fresh fork takes its place before the next request, so a function
that hangs, spins or sleeps forever costs one budget and a fork, nothing after it. A worker that
dies (a segfault, os._exit) is the sample's error and is replaced the same way.

`ThreadRunner` (REWARD_WORKERS=0) runs each call in a daemon thread and stops waiting at the
budget. Python cannot kill a thread: a hung call is abandoned, still holding its memory and (if it
spins) a share of the CPU and the GIL until the process exits. That is the trade-off of 0: no
process start-up, no copy of the user's module per worker, and it works where subprocesses are not
allowed; use workers for any function that may hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import queue
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import msgpack

from shared.rewards.base import (
    RewardInput,
    RewardLoadError,
    RewardResult,
    error_from,
    failed,
)
from shared.rewards.conventions import RewardCall

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a worker imports the user's module: bounded, but generous on a busy box
THREADS = 8  # calls in flight with REWARD_WORKERS=0 (threads help sandboxed and I/O-bound rewards)


# --- frames: 4-byte big-endian length + msgpack --------------------------------------------------


def pack_frame(obj: Any) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    return len(data).to_bytes(4, "big") + data


def read_frame(stream: IO[bytes]) -> Any:
    """One frame from a blocking stream; None at end of file."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    n = int.from_bytes(head, "big")
    body = stream.read(n)
    if len(body) < n:
        return None
    return msgpack.unpackb(body, raw=False)


def _wait(fd: int, events: int, deadline: float) -> None:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, events)
        while not sel.select(max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError


def _write_all(fd: int, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        _wait(fd, selectors.EVENT_WRITE, deadline)
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        _wait(fd, selectors.EVENT_READ, deadline)
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


# --- processes ---------------------------------------------------------------------------------


def _kill(proc: subprocess.Popen[bytes]) -> int | None:
    """SIGKILL a child we spawned, with its process group (it is not reaped yet: its pid is still
    its own); its exit status."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # unkillable (D state): leave it, it holds no lock of ours
        return None


class _Worker:
    """One child process the pool speaks frames to; used by one thread at a time (the pool's queue
    hands it out). Spawned (`spawn`: a fresh interpreter that loads the reward at `handshake`) or
    forked by the pool's `_Zygote`, loaded already.

    `end` SIGKILLs it with its process group and gives its exit status; `files` are the pool's
    ends of its channel, the one it reads its requests from first."""

    def __init__(
        self,
        index: int,
        pid: int,
        fds: tuple[int, int],
        end: Callable[[], int | None],
        files: Sequence[IO[bytes] | socket.socket],
        init: bytes = b"",
    ) -> None:
        self.index, self.pid = index, pid
        self._in, self._out = fds
        os.set_blocking(self._in, False)
        os.set_blocking(self._out, False)
        self._end, self._files = end, files
        self._init = init
        self.ready = not init

    @classmethod
    def spawn(cls, init: bytes, index: int) -> _Worker:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shared.rewards.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # stderr: the service's log
            bufsize=0,
            start_new_session=True,  # its own process group: a kill takes its children too
        )
        assert proc.stdin is not None and proc.stdout is not None
        fds = (proc.stdin.fileno(), proc.stdout.fileno())
        return cls(index, proc.pid, fds, functools.partial(_kill, proc), [proc.stdin, proc.stdout], init)

    def handshake(self, deadline: float, what: str = "", budget_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        """Send the spec, wait for the worker to load it; its answer. Raises RewardLoadError with its
        error.

        `what`: who loads, for the error (default: this reward worker); `budget_s`: the time the
        deadline allows, for the error."""
        what = what or f"reward worker {self.index}"
        try:
            reply: dict[str, Any] = self.request_raw(self._init, deadline)
        except TimeoutError:
            self.kill()
            raise RewardLoadError(f"{what} did not load the reward within {budget_s:g} s") from None
        except (EOFError, BrokenPipeError):
            code = self.kill()
            raise RewardLoadError(
                f"{what} ended while loading the reward ({exit_text(code)}); see its stderr"
            ) from None
        if "error" in reply:
            self.kill()
            raise RewardLoadError(reply["error"])
        self.ready = True
        return reply

    def request_raw(self, frame: bytes, deadline: float) -> Any:
        _write_all(self._in, frame, deadline)
        return self.read_reply(deadline)

    def read_reply(self, deadline: float) -> Any:
        n = int.from_bytes(_read_exactly(self._out, 4, deadline), "big")
        return msgpack.unpackb(_read_exactly(self._out, n, deadline), raw=False)

    def alive(self) -> bool:
        """Idle and nothing to read: it lives (a dead worker's end of the channel reads end of file)."""
        with selectors.DefaultSelector() as sel:
            sel.register(self._out, selectors.EVENT_READ)
            return not sel.select(0)

    def kill(self) -> int | None:
        """SIGKILL it with its process group; its exit status (None: none came)."""
        code = self._end()
        for f in self._files:
            f.close()
        return code

    def stop(self) -> None:
        """Ask it to exit (end of its requests), give it 2 s, then make sure."""
        with contextlib.suppress(OSError, TimeoutError):
            self._files[0].close()
            _wait(self._out, selectors.EVENT_READ, time.monotonic() + 2)  # its end of file
        self.kill()


class _Zygote:
    """A process that loads the reward once and forks workers that are ready to score
    (shared.rewards.worker `zygote`): a worker killed at its budget is replaced by a fork, a few
    milliseconds, rather than a fresh interpreter importing the reward modules and the user's
    plug-in again (a third of a CPU-second before the plug-in's own imports, which math-verify's
    sympy makes seconds). Forking is only safe from one thread: a plug-in whose import leaves
    threads running gets spawned workers instead (`start` returns None).

    Forked workers share what the plug-in built at import (copy-on-write): a connection opened at
    import time would be shared by all of them, as with any pre-forking server."""

    FORK_TIMEOUT_S = 30.0

    def __init__(self, init: bytes) -> None:
        mine, theirs = socket.socketpair()
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shared.rewards.worker", "--zygote", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stderr=None,
                start_new_session=True,
            )
        self._sock = mine
        # One request at a time on the socket, from any pool thread; and none once it is closed: its
        # descriptor's number may then belong to another file of this process.
        self._lock = threading.Lock()
        self._closed = False
        end = functools.partial(_kill, self.proc)
        self._channel = _Worker(-1, self.proc.pid, (mine.fileno(), mine.fileno()), end, [mine], init)

    @classmethod
    def start(cls, init: bytes) -> _Zygote | None:
        """A zygote with the reward loaded. Raises RewardLoadError as a worker's handshake does."""
        z = cls(init)
        reply = z._channel.handshake(time.monotonic() + START_TIMEOUT_S, "the reward's zygote")
        if reply.get("threads", 1) > 1:
            log.info("the reward's import left %d threads: its workers are spawned, not forked", reply["threads"])
            z.close()
            return None
        return z

    def fork(self, index: int) -> _Worker:
        """A new worker, loaded. Raises OSError, TimeoutError or EOFError when the zygote fails."""
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        try:
            with self._lock:
                if self._closed:
                    raise OSError("the zygote is closed")
                frame = pack_frame({"fork": index})
                if socket.send_fds(self._sock, [frame], [to_r, from_w]) != len(frame):
                    raise OSError("the fork request was cut short")
                pid = int(self._channel.read_reply(time.monotonic() + self.FORK_TIMEOUT_S)["pid"])
        except BaseException:
            os.close(to_w)
            os.close(from_r)
            raise
        finally:
            os.close(to_r)
            os.close(from_w)
        files = [os.fdopen(to_w, "wb", buffering=0), os.fdopen(from_r, "rb", buffering=0)]
        return _Worker(index, pid, (to_w, from_r), functools.partial(self.kill, pid), files)

    def kill(self, pid: int) -> int | None:
        """SIGKILL a worker it forked, with its group, by the zygote (its parent, which alone knows
        the pid is not reused); its exit status, None when the zygote is gone (and so is the
        worker: PR_SET_PDEATHSIG)."""
        try:
            with self._lock:
                if self._closed:
                    return None
                return self._channel.request_raw(pack_frame({"kill": pid}), time.monotonic() + self.FORK_TIMEOUT_S)[
                    "code"
                ]
        except (OSError, TimeoutError, EOFError, KeyError):
            return None

    def close(self) -> None:
        """End it (end of its socket); its workers die with it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            _kill(self.proc)


def exit_text(code: int | None) -> str:
    """How a child ended, for people: "exit code 0", "killed by SIGSEGV"."""
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def probe_import(spec: dict[str, Any], label: str, timeout_s: float) -> None:
    """Load the reward leaf `spec` (a Python plug-in's JSON) in a child process first, as a
    worker does, and discard it: an import that raises, calls sys.exit, kills the interpreter
    (a segfault, os._exit) or runs past `timeout_s` costs that child, never the caller.

    Raises:
        RewardLoadError: naming the plug-in and how its import failed.
    """
    w = _Worker.spawn(pack_frame({"sys_path": [p for p in sys.path if p], "leaves": [spec]}), 0)
    what = f"the import of {label} (in a child process; REWARD_IMPORT_TIMEOUT_S)"
    try:
        w.handshake(time.monotonic() + timeout_s, what, timeout_s)  # kills the child when it fails
    except RewardLoadError:
        raise
    except BaseException:
        w.kill()
        raise
    w.stop()


class WorkerPool:
    """`workers` processes serving the sync leaves `leaves` (their specs as JSON), one request each
    at a time; a call over its budget kills its worker and the next call on that slot starts anew,
    forked from the pool's zygote (`_Zygote`) where it can be.

    Raises (constructor):
        RewardLoadError: a worker could not load the reward (the worker's own error message).
    """

    def __init__(self, leaves: Sequence[dict[str, Any]], labels: Sequence[str], workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {workers}")
        self._init = pack_frame({"sys_path": [p for p in sys.path if p], "leaves": list(leaves)})
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward-pool")
        self._labels = list(labels)
        self.workers = workers
        self.restarts = 0
        # Started from the pool's own threads, which live as long as the pool: PR_SET_PDEATHSIG
        # fires when the thread that started a process exits, and the caller's thread (a job's)
        # may end while the pool is kept for the next job.
        self._zygote = self._executor.submit(_Zygote.start, self._init).result()
        starts = [self._executor.submit(self._new_worker, i) for i in range(workers)]
        started = [f.result() for f in starts if f.exception() is None]
        if len(started) < workers:
            for w in started:
                w.kill()
            self._close_zygote()
            raise next(exc for f in starts if (exc := f.exception()) is not None)
        for w in started:
            self._idle.put(w)

    def _new_worker(self, index: int) -> _Worker:
        """A loaded worker: forked from the zygote, or spawned where there is none (any more)."""
        if (z := self._zygote) is not None:
            try:
                return z.fork(index)
            except (OSError, TimeoutError, EOFError, KeyError, ValueError) as exc:
                log.warning("the reward's zygote failed (%s): its workers are spawned from now on", exc)
                self._close_zygote()
        w = _Worker.spawn(self._init, index)
        w.handshake(time.monotonic() + START_TIMEOUT_S)
        return w

    def _close_zygote(self) -> None:
        z, self._zygote = self._zygote, None
        if z is not None:
            z.close()

    async def run(self, leaf: int, items: list[RewardInput], timeout_s: float) -> list[RewardResult]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, leaf, items, timeout_s)

    def _call(self, leaf: int, items: list[RewardInput], timeout_s: float) -> list[RewardResult]:
        w = self._idle.get()
        try:
            if w.ready and not w.alive():  # died while idle: replaced before the call
                w.kill()
                w.ready = False
            if not w.ready:  # killed by an earlier call: start its replacement (not on the budget)
                try:
                    w = self._new_worker(w.index)
                except RewardLoadError as exc:
                    return [error_from(exc, self._labels[leaf])] * len(items)
                self.restarts += 1
            try:
                frame = pack_frame({"leaf": leaf, "items": [it.as_json(ids=True) for it in items]})
            except (TypeError, ValueError) as exc:  # metadata msgpack cannot carry
                return [error_from(exc, f"{self._labels[leaf]}: the sample does not encode for the worker")] * len(
                    items
                )
            try:
                reply = w.request_raw(frame, time.monotonic() + timeout_s)
            except TimeoutError:
                w.kill()
                w.ready = False
                log.warning(
                    "reward worker %d over the %g s budget: killed, replaced before its next call", w.index, timeout_s
                )
                return [
                    failed(
                        "timeout",
                        f"{self._labels[leaf]}: over the time budget of {timeout_s:g} s (timeout_s); "
                        "the reward worker was killed and replaced",
                    )
                ] * len(items)
            except (EOFError, BrokenPipeError):
                code = w.kill()
                w.ready = False
                return [
                    failed(
                        "error",
                        f"{self._labels[leaf]}: the reward worker died (exit code {code}) "
                        "while scoring; it is replaced",
                    )
                ] * len(items)
            return [RewardResult.from_json(r) for r in reply["results"]]
        finally:
            self._idle.put(w)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        while not self._idle.empty():
            w = self._idle.get_nowait()
            if w.ready:
                w.stop()
        self._close_zygote()


# --- threads -----------------------------------------------------------------------------------


class ThreadRunner:
    """Each call in a daemon thread; a call over the budget is abandoned (see the module docstring)."""

    def __init__(self, leaves: Sequence[RewardCall], concurrency: int = THREADS) -> None:
        self._leaves = list(leaves)
        self._slots = asyncio.Semaphore(concurrency)
        self.abandoned = 0

    async def run(self, leaf: int, items: list[RewardInput], timeout_s: float) -> list[RewardResult]:
        fn = self._leaves[leaf]
        async with self._slots:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[list[RewardResult]] = loop.create_future()

            def settle(res: list[RewardResult]) -> None:
                if not fut.done():
                    fut.set_result(res)

            def work() -> None:
                try:
                    res = fn.call_sync(items)
                except BaseException as exc:  # SystemExit in user code: the sample's error, not a lost future
                    res = [error_from(exc, fn.label)] * len(items)
                with contextlib.suppress(RuntimeError):  # a closed loop: the caller gave up long ago
                    loop.call_soon_threadsafe(settle, res)

            threading.Thread(target=work, name=f"reward-{fn.label}", daemon=True).start()
            try:
                return await asyncio.wait_for(fut, timeout_s)
            except asyncio.TimeoutError:
                self.abandoned += 1
                return [
                    failed(
                        "timeout",
                        f"{fn.label}: over the time budget of {timeout_s:g} s (timeout_s); "
                        "its thread was abandoned (REWARD_WORKERS=0 cannot stop it)",
                    )
                ] * len(items)

    def close(self) -> None:
        return None
