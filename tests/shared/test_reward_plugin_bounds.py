"""A reward plug-in cannot take the reward service down (issue 31, item 3): its named components are
bounded, its import runs in a child process first (an exit, a crash or a hang there is a
RewardLoadError naming it), and an `async def` that blocks costs its time budget and its own event
loop, never the caller's."""

from __future__ import annotations

import asyncio
import textwrap
import threading
import time

import pytest

from shared.rewards import RewardInput, RewardLoadError, build_scorer
from shared.rewards.base import MAX_COMPONENT_NAME, MAX_COMPONENTS, RewardLimits, coerce
from shared.rewards.pool import exit_text, probe_import

pytestmark = pytest.mark.hostile


def test_components_are_bounded_in_number_and_name_length() -> None:
    assert coerce({f"c{i}": 1.0 for i in range(MAX_COMPONENTS)}).reward == MAX_COMPONENTS
    wide = coerce({f"c{i}": 1.0 for i in range(200_000)})
    assert wide.status == "error" and wide.reason == "returned a dict of 200000 named components; at most 256"
    long = coerce({"x" * (MAX_COMPONENT_NAME + 1): 1.0})
    assert long.status == "error" and "component name of 257 characters" in long.reason
    assert len(coerce({"x" * 10_000: "y" * 10_000}).reason) < 600  # a bad entry is quoted, not copied


def test_a_sum_over_the_component_bound_is_the_samples_error(tmp_path) -> None:
    path = tmp_path / "halves.py"
    path.write_text("def score(completion, answer):\n    return {f'c{i}': 1.0 for i in range(200)}\n")
    terms = [{"name": n, "reward": f"{path}:score"} for n in ("a", "b")]  # 2 x (1 + 200) components
    with build_scorer({"kind": "sum", "terms": terms}) as scorer:
        (r,) = scorer.score_sync([RewardInput("p", "c", "a")])
    assert r.status == "error" and "402 named components; at most 256" in r.reason


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("import sys\nsys.exit(3)\n", "it called sys.exit(3)"),
        ("raise SystemExit\n", "it called sys.exit(None)"),
        ("import os\nos._exit(0)\n", "ended while loading the reward (exit code 0)"),
        ("import ctypes\nctypes.string_at(0)\n", "ended while loading the reward (killed by SIGSEGV)"),
        ("while True:\n    pass\n", "did not load the reward within 2 s"),
    ],
)
def test_an_import_that_exits_crashes_or_hangs_is_a_load_error(tmp_path, source, says) -> None:
    path = tmp_path / "bad_import.py"
    path.write_text(source + "\ndef score(completion, answer):\n    return 1.0\n")
    hangs = "within" in says  # the others end as soon as the child does: a generous limit costs nothing
    t0 = time.monotonic()
    with pytest.raises(RewardLoadError) as err:
        build_scorer(f"{path}:score", limits=RewardLimits(import_timeout_s=2.0 if hangs else 60.0))
    assert says in str(err.value) and str(path) in str(err.value)
    assert time.monotonic() - t0 < 15


def test_a_plugin_that_imports_is_probed_and_then_loaded(tmp_path) -> None:
    path = tmp_path / "fine.py"
    path.write_text("def score(completion, answer):\n    return 2.0\n")
    probe_import({"kind": "python", "function": f"{path}:score"}, "fine", 30)
    with build_scorer(f"{path}:score") as scorer:
        assert scorer.score_sync([RewardInput("p", "c", "a")])[0].reward == 2.0
    assert (exit_text(0), exit_text(-9), exit_text(None)) == ("exit code 0", "killed by SIGKILL", "no exit status")


BLOCKING = textwrap.dedent(
    """
    import asyncio, threading, time

    LOOPS = set()

    async def score(completion, answer):
        LOOPS.add(threading.get_ident())
        if completion == "block":
            time.sleep(4)  # a blocking call inside an async def
        await asyncio.sleep(0.01)
        return 1.0
    """
)


def test_an_async_reward_that_blocks_costs_its_budget_not_the_callers_loop(tmp_path) -> None:
    path = tmp_path / "blocking.py"
    path.write_text(BLOCKING)
    with build_scorer({"kind": "python", "function": f"{path}:score", "timeout_s": 1.0}) as scorer:
        ticks: list[float] = []

        async def batch() -> list:
            async def tick() -> None:  # the caller's loop keeps running while the reward blocks
                while True:
                    ticks.append(time.monotonic())
                    await asyncio.sleep(0.05)

            ticker = asyncio.ensure_future(tick())
            try:
                return await scorer.score([RewardInput("p", c, "a") for c in ("a", "block", "b")])
            finally:
                ticker.cancel()

        t0 = time.monotonic()
        loop = asyncio.new_event_loop()
        try:
            results = loop.run_until_complete(batch())
            took = time.monotonic() - t0
            assert [r.status for r in results][1] == "timeout" and took < 3.5
            assert "it blocked its event loop, which is abandoned and replaced" in results[1].reason
            assert max(b - a for a, b in zip(ticks, ticks[1:], strict=False)) < 0.5  # never stalled
            t0 = time.monotonic()
            again = loop.run_until_complete(scorer.score([RewardInput("p", c, "a") for c in ("c", "d")]))
            assert [r.reward for r in again] == [1.0, 1.0] and time.monotonic() - t0 < 1.0  # a fresh loop
        finally:
            loop.close()
    assert threading.get_ident() not in __import__("sys").modules[_module_name(path)].LOOPS


def _module_name(path) -> str:
    import sys

    (name,) = [n for n, m in sys.modules.items() if getattr(m, "__file__", None) == str(path)]
    return name
