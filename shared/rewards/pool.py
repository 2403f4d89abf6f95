"""Where sync reward functions run, each call under a time budget: worker processes or threads.

`WorkerPool` (REWARD_WORKERS > 0) spawns `python -m shared.rewards.worker` children that load the
sync leaves of the reward spec and answer one request at a time, msgpack frames over their
stdin/stdout (nothing is pickled: a request is the leaf's index and the samples' plain fields).
A worker that runs past the budget is SIGKILLed with its process group and a fresh one takes its
place before the next request, so a function that hangs, spins or sleeps forever costs one budget
and nothing after it. A worker that dies (a segfault, os._exit) is the sample's error and is
replaced the same way.

`ThreadRunner` (REWARD_WORKERS=0) runs each call in a daemon thread and stops waiting at the
budget. Python cannot kill a thread: a hung call is abandoned, still holding its memory and (if it
spins) a share of the CPU and the GIL until the process exits. That is the trade-off of 0: no
process start-up, no copy of the user's module per worker, and it works where subprocesses are not
allowed; use workers for any function that may hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
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


class _Worker:
    """One child process; used by one thread at a time (the pool's queue hands it out)."""

    def __init__(self, init: bytes, index: int) -> None:
        self.index = index
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shared.rewards.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # stderr: the service's log
            bufsize=0,
            start_new_session=True,  # its own process group: a kill takes its children too
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self._in, False)
        os.set_blocking(self._out, False)
        self._init = init
        self.ready = False

    def handshake(self, deadline: float, what: str = "", budget_s: float = START_TIMEOUT_S) -> None:
        """Send the spec, wait for the worker to load it. Raises RewardLoadError with its error.

        `what`: who loads, for the error (default: this reward worker); `budget_s`: the time the
        deadline allows, for the error."""
        what = what or f"reward worker {self.index}"
        try:
            reply = self.request_raw(self._init, deadline)
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

    def request_raw(self, frame: bytes, deadline: float) -> Any:
        _write_all(self._in, frame, deadline)
        n = int.from_bytes(_read_exactly(self._out, 4, deadline), "big")
        return msgpack.unpackb(_read_exactly(self._out, n, deadline), raw=False)

    def kill(self) -> int | None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # unkillable (D state): leave it, it holds no lock of ours
            code = None
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        return code

    def stop(self) -> None:
        """Ask it to exit (end of its stdin), then make sure."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


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
    w = _Worker(pack_frame({"sys_path": [p for p in sys.path if p], "leaves": [spec]}), 0)
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
    at a time; a call over its budget kills its worker and the next call on that slot starts anew.

    Raises (constructor):
        RewardLoadError: a worker could not load the reward (the worker's own error message).
    """

    def __init__(self, leaves: Sequence[dict[str, Any]], labels: Sequence[str], workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {workers}")
        self._init = pack_frame({"sys_path": [p for p in sys.path if p], "leaves": list(leaves)})
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward-pool")
        # Started from the pool's own threads, which live as long as the pool: a worker's
        # PR_SET_PDEATHSIG fires when the thread that started it exits, and the caller's thread (a
        # job's) may end while the pool is kept for the next job.
        started = list(self._executor.map(lambda i: _Worker(self._init, i), range(workers)))
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            for w in started:
                w.handshake(deadline)
        except BaseException:
            for w in started:
                w.kill()
            raise
        for w in started:
            self._idle.put(w)
        self._labels = list(labels)
        self.workers = workers
        self.restarts = 0

    async def run(self, leaf: int, items: list[RewardInput], timeout_s: float) -> list[RewardResult]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, leaf, items, timeout_s)

    def _call(self, leaf: int, items: list[RewardInput], timeout_s: float) -> list[RewardResult]:
        w = self._idle.get()
        try:
            if w.ready and w.proc.poll() is not None:  # died while idle: replaced before the call
                w.kill()
                w.ready = False
            if not w.ready:  # killed by an earlier call: start its replacement (not on the budget)
                w = _Worker(self._init, w.index)
                self.restarts += 1
                try:
                    w.handshake(time.monotonic() + START_TIMEOUT_S)
                except RewardLoadError as exc:
                    return [error_from(exc, self._labels[leaf])] * len(items)
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
