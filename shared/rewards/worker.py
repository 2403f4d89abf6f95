"""`python -m shared.rewards.worker`: one reward worker process (spawned by shared.rewards.pool).

Protocol, msgpack frames (4-byte big-endian length + body) on stdin/stdout, one request at a time:
first {"sys_path": [...], "leaves": [leaf spec JSON, ...]} -> {"ready": true} or {"error": "..."};
then {"leaf": i, "items": [RewardInput JSON, ...]} -> {"results": [RewardResult JSON, ...]}.
End of stdin ends the worker. The user's prints go to stderr: stdout carries only frames.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

from pydantic import TypeAdapter

from shared.rewards.base import RewardInput
from shared.rewards.conventions import RewardCall
from shared.rewards.pool import pack_frame, read_frame
from shared.rewards.python import load_function
from shared.rewards.spec import BuiltinReward, PythonReward, RewardSpec, as_object


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the reward service dies (a hung worker reads no EOF).
    Strictly: when the service thread that spawned it exits; the pool spawns from its own
    threads, which live until the pool closes."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main() -> int:
    # The protocol gets private copies of fds 0 and 1 (not inherited by the user's subprocesses);
    # fd 1 (print, child processes' stdout) then goes to stderr and fd 0 reads /dev/null.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    inp = os.fdopen(os.dup(0), "rb")
    os.dup2(2, 1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service decides when workers stop
    _die_with_parent()
    init = read_frame(inp)
    if init is None:
        return 0
    sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
    adapter: TypeAdapter[object] = TypeAdapter(RewardSpec)
    leaves: list[RewardCall] = []
    try:
        for raw in init["leaves"]:
            spec = as_object(adapter.validate_python(raw))  # type: ignore[arg-type]
            assert isinstance(spec, BuiltinReward | PythonReward), spec
            leaves.append(load_function(spec))
    except Exception as exc:
        out.write(pack_frame({"error": str(exc)}))
        return 1
    out.write(pack_frame({"ready": True}))
    while (req := read_frame(inp)) is not None:
        items = [RewardInput.from_json(d) for d in req["items"]]
        results = leaves[req["leaf"]].call_sync(items)
        out.write(pack_frame({"results": [r.as_json() for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
