"""A reward scorer kept from one job to the next (reward_svc Scorers) is built in the first job's
thread. Its worker processes ask for SIGKILL when their parent goes (PR_SET_PDEATHSIG), which Linux
sends when the *thread* that started them exits: once that job's thread ended, the next job's first
call found its worker dead and lost that batch's rewards. The pool now starts its workers from its
own threads (and replaces a worker found dead before a call)."""

from __future__ import annotations

import sys
import threading

import pytest

from shared.rewards import build_scorer
from shared.rewards.base import RewardInput

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def test_a_scorer_built_in_a_thread_that_ended_still_scores() -> None:
    built = {}
    t = threading.Thread(target=lambda: built.setdefault("s", build_scorer("exact_match", workers=1)))
    t.start()
    t.join()
    scorer = built["s"]
    try:
        got = scorer.score_sync([RewardInput(prompt="1+1=", completion="2", answer="2")])
        assert got[0].ok and got[0].reward == 1.0, got
    finally:
        scorer.close()
