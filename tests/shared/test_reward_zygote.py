"""Reward workers are forked from one process that imported the plug-in once (shared.rewards.pool
`_Zygote`): a worker killed at its time budget is replaced by a fork, not by a new interpreter that
imports everything again; a plug-in whose import leaves threads running gets spawned workers; a
zygote that dies leaves the pool spawning them."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from shared.rewards import RewardInput, build_scorer

pytestmark = pytest.mark.hostile

PLUGIN = """
import os, threading, time

with open({log!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")
if {threads}:
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()


def score(completion, answer):
    if completion == "hang":
        time.sleep(600)
    if completion == "pid":
        return float(os.getpid())
    return 1.0
"""


def _plugin(tmp_path, threads: bool = False) -> tuple[dict, object]:
    log = tmp_path / "imports.txt"
    path = tmp_path / f"counted_{int(threads)}.py"
    path.write_text(PLUGIN.format(log=str(log), threads=threads))
    return {"kind": "python", "function": f"{path}:score", "timeout_s": 1.0}, log


def _imports(log) -> int:
    """How many child processes have imported the plug-in so far (the file is cleared by the caller;
    the test's own process imports it once, to check it, and keeps it)."""
    return len([p for p in log.read_text().split() if int(p) != os.getpid()]) if log.exists() else 0


def _item(completion: str) -> RewardInput:
    return RewardInput("p", completion, "a")


def _imports_of_a_pool_with_one_worker(spec, log) -> int:
    with build_scorer(spec, workers=1) as scorer:
        assert scorer.score_sync([_item("ok")])[0].reward == 1.0
    n = _imports(log)
    log.unlink()
    return n


def test_workers_are_forked_from_one_import_and_a_hung_one_is_replaced_by_a_fork(tmp_path) -> None:
    spec, log = _plugin(tmp_path)
    per_pool = _imports_of_a_pool_with_one_worker(spec, log)
    with build_scorer(spec, workers=3) as scorer:
        assert _imports(log) == per_pool  # three workers import no more than one did
        zygote = scorer.runner._zygote.proc.pid  # type: ignore[attr-defined]
        first = scorer.score_sync([_item("hang"), _item("pid"), _item("ok")])
        assert [r.status for r in first] == ["timeout", "ok", "ok"]
        assert "the reward worker was killed and replaced" in first[0].reason
        again = scorer.score_sync([_item("pid")] * 3)  # the killed worker's slot is served again
        assert [r.status for r in again] == ["ok"] * 3
        assert scorer.runner.restarts == 1  # type: ignore[attr-defined]
        assert _imports(log) == per_pool  # its replacement imported nothing
        pids = {int(r.reward) for r in (*first[1:2], *again)}
        assert {psutil.Process(p).ppid() for p in pids} == {zygote}
    time.sleep(0.2)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in (*pids, zygote))


def test_a_plugin_whose_import_leaves_threads_running_gets_spawned_workers(tmp_path) -> None:
    spec, log = _plugin(tmp_path, threads=True)
    per_pool = _imports_of_a_pool_with_one_worker(spec, log)
    with build_scorer(spec, workers=2) as scorer:
        assert scorer.runner._zygote is None  # type: ignore[attr-defined]
        assert _imports(log) == per_pool + 1  # each worker imports the plug-in itself
        assert [r.status for r in scorer.score_sync([_item("hang"), _item("ok")])] == ["timeout", "ok"]
        assert [r.reward for r in scorer.score_sync([_item("ok")] * 2)] == [1.0, 1.0]
        assert scorer.runner.restarts == 1 and _imports(log) == per_pool + 2  # type: ignore[attr-defined]


def test_a_zygote_that_dies_leaves_the_pool_spawning_workers(tmp_path) -> None:
    spec, _ = _plugin(tmp_path)
    with build_scorer(spec, workers=2) as scorer:
        pids = {int(r.reward) for r in scorer.score_sync([_item("pid")] * 2)}
        zygote = scorer.runner._zygote.proc  # type: ignore[attr-defined]
        os.kill(zygote.pid, signal.SIGKILL)
        zygote.wait()
        deadline = time.monotonic() + 30  # its workers die with it (PR_SET_PDEATHSIG)
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
            assert time.monotonic() < deadline, "the zygote's workers outlived it"
            time.sleep(0.05)
        after = scorer.score_sync([_item("pid")] * 2)
        assert [r.status for r in after] == ["ok", "ok"] and not pids & {int(r.reward) for r in after}
        assert scorer.runner._zygote is None  # type: ignore[attr-defined]
        assert [r.status for r in scorer.score_sync([_item("hang"), _item("ok")])] == ["timeout", "ok"]
        assert [r.reward for r in scorer.score_sync([_item("ok")] * 2)] == [1.0, 1.0]
