"""A multi-turn environment with a slow tool, for tests/chaos/test_chaos_episodes.py.

A job spec names it by file path (`.../tests/chaos/slow_env.py:SlowTool`), as a user's environment
is named: the generator imports this file, so it must not import the tests' own modules.

Every episode plays `turns` model turns; each `step` (the tool) sleeps `sleep_s`, so a batch of
episodes takes seconds and a SIGKILL lands mid-episode. Each step appends a `begin` line to
`marker` before its sleep and an `end` line after it:

    begin <pid> <episode> <prompt_index> <turn index> <unix time>

A `begin` with no `end` from a process that was SIGKILLed is a tool call the kill interrupted: the
episode had played `turn index + 1` model turns and was not over.
"""

from __future__ import annotations

import os
import time
import uuid

from shared.environments.base import StepResult


class SlowTool:
    def __init__(self, sleep_s: float = 0.3, turns: int = 4, marker: str = ""):
        self.sleep_s, self.turns, self.marker = float(sleep_s), int(turns), marker
        self.episode = uuid.uuid4().hex[:12]
        self.prompt_index = -1

    def start(self, row):
        self.prompt_index = int(row.get("prompt_index", -1))
        return row["prompt"]

    def step(self, turn):
        self._mark("begin", turn.index)
        time.sleep(self.sleep_s)
        self._mark("end", turn.index)
        # a short reply: the tiny test model's tokenizer is one token per character
        return StepResult(text=f"{turn.index}:{len(turn.ids)}", role="tool", done=turn.index + 1 >= self.turns)

    def _mark(self, what: str, index: int) -> None:
        if not self.marker:
            return
        line = f"{what} {os.getpid()} {self.episode} {self.prompt_index} {index} {time.time():.3f}\n"
        fd = os.open(self.marker, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one write with O_APPEND: lines of concurrent steps never interleave
        finally:
            os.close(fd)
