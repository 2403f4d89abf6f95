"""`python -m shared.rewards.worker`: one reward worker process (spawned by shared.rewards.pool),
or with `--zygote FD` the process that loads the reward once and forks ready workers from it.

Worker protocol, msgpack frames (4-byte big-endian length + body) on stdin/stdout, one request at a
time: first {"sys_path": [...], "leaves": [leaf spec JSON, ...]} -> {"ready": true} or
{"error": "..."}; then {"leaf": i, "items": [RewardInput JSON, ...]} -> {"results": [RewardResult
JSON, ...]}. End of stdin ends the worker. The user's prints go to stderr: stdout carries only frames.

Zygote protocol, the same frames on the Unix socket FD: the same first frame and answer (plus
"threads": the threads the loaded reward left running: forking is only safe with one); then
{"fork": i} carrying two file descriptors (SCM_RIGHTS: the new worker's stdin and stdout) ->
{"pid": n}, a worker already loaded, in a session of its own, that skips the first frame; and
{"kill": pid} -> {"code": its exit status as subprocess gives it, or null}: the zygote SIGKILLs
the worker's process group and reaps it, so a pid is signalled only by its parent, before it is
reaped and could be reused. End of the socket ends the zygote; its workers die with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

import msgpack
from pydantic import TypeAdapter

from shared.rewards.base import RewardInput
from shared.rewards.conventions import RewardCall
from shared.rewards.pool import pack_frame, read_frame
from shared.rewards.python import load_function
from shared.rewards.spec import BuiltinReward, PythonReward, RewardSpec, as_object

REAP_WAIT_S = 10.0  # a killed worker in uninterruptible sleep: its status is given up on after this


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a hung worker reads no EOF).
    Strictly: when the parent thread that started it exits; the pool starts the zygote and its
    spawned workers from its own threads, which live until the pool closes."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _quiet_std_streams() -> None:
    """fd 1 (print, child processes' stdout) goes to stderr and fd 0 reads /dev/null; SIGINT is
    ignored (the service decides when workers stop)."""
    os.dup2(2, 1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _load(init: dict[str, Any]) -> list[RewardCall]:
    sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
    adapter: TypeAdapter[object] = TypeAdapter(RewardSpec)
    leaves: list[RewardCall] = []
    for raw in init["leaves"]:
        spec = as_object(adapter.validate_python(raw))  # type: ignore[arg-type]
        assert isinstance(spec, BuiltinReward | PythonReward), spec
        leaves.append(load_function(spec))
    return leaves


def _load_and_answer(
    init: dict[str, Any], send: Callable[[bytes], object], more: Callable[[], dict[str, Any]] = dict
) -> list[RewardCall] | None:
    """Load the leaves of the first frame and answer it: {"ready": true, **more()} and the leaves,
    or {"error": ...} and None."""
    try:
        leaves = _load(init)
    except Exception as exc:
        send(pack_frame({"error": str(exc)}))
        return None
    send(pack_frame({"ready": True, **more()}))
    return leaves


def _serve(inp: IO[bytes], out: IO[bytes], leaves: list[RewardCall]) -> None:
    while (req := read_frame(inp)) is not None:
        items = [RewardInput.from_json(d) for d in req["items"]]
        results = leaves[req["leaf"]].call_sync(items)
        out.write(pack_frame({"results": [r.as_json() for r in results]}))


def main() -> int:
    # The protocol gets private copies of fds 0 and 1 (not inherited by the user's subprocesses).
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    inp = os.fdopen(os.dup(0), "rb")
    _quiet_std_streams()
    _die_with_parent()
    init = read_frame(inp)
    if init is None:
        return 0
    leaves = _load_and_answer(init, out.write)
    if leaves is None:
        return 1
    _serve(inp, out, leaves)
    return 0


# --- the zygote ----------------------------------------------------------------------------------


def _recv_exactly(ctl: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = ctl.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(ctl: socket.socket) -> tuple[Any, list[int]]:
    """One frame and the descriptors sent with it; (None, []) at the end of the socket."""
    head, fds, _, _ = socket.recv_fds(ctl, 4, 2)
    rest = _recv_exactly(ctl, 4 - len(head)) if head else None
    if not head or rest is None:
        return None, fds
    body = _recv_exactly(ctl, int.from_bytes(head + rest, "big"))
    if body is None:
        return None, fds
    return msgpack.unpackb(body, raw=False), fds


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _worker_after_fork(ctl: socket.socket, fds: list[int], leaves: list[RewardCall]) -> None:
    """The forked child: a worker of its own session with the leaves already loaded. Never returns."""
    code = 0
    try:
        ctl.close()
        os.setsid()  # its own process group: the pool's kill takes its children too
        _die_with_parent()  # with the zygote
        _serve(os.fdopen(fds[0], "rb"), os.fdopen(fds[1], "wb", buffering=0), leaves)
    except SystemExit as exc:  # as the interpreter would end a spawned worker
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


def _kill(pid: int) -> int | None:
    for kill, target in ((os.killpg, pid), (os.kill, pid)):  # its group (the children it started), and
        with contextlib.suppress(ProcessLookupError):  # itself should it not have its session yet
            kill(target, signal.SIGKILL)
    deadline = time.monotonic() + REAP_WAIT_S
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


def zygote(fd: int) -> int:
    ctl = socket.socket(fileno=fd)
    _quiet_std_streams()
    _die_with_parent()
    init, _ = _recv(ctl)
    if init is None:
        return 0
    leaves = _load_and_answer(init, ctl.sendall, lambda: {"threads": _threads()})
    if leaves is None:
        return 1
    while True:
        req, fds = _recv(ctl)
        if req is None:
            return 0
        if "fork" in req:
            pid = os.fork()
            if pid == 0:
                _worker_after_fork(ctl, fds, leaves)
            for f in fds:
                os.close(f)
            ctl.sendall(pack_frame({"pid": pid}))
        else:
            ctl.sendall(pack_frame({"code": _kill(req["kill"])}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        sys.exit(zygote(int(sys.argv[2])))
    sys.exit(main())
