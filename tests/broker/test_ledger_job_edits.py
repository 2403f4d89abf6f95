"""`Ledger.edit_job`: a job's row held for a read-decide-write change, on each backend: a concurrent
state move waits for it and then sees its result; an edit that raises changes nothing."""

from __future__ import annotations

import threading
import time

import pytest

from broker.fleet import LIVE_STATES


def test_an_edit_holds_the_row_until_it_ends(ledger) -> None:
    ledger.create_job("j", "n", {"a": 1}, state="running")
    with ledger.edit_job("absent") as none:
        assert none is None
    started, moved = threading.Event(), []

    def trainer_ends_the_job() -> None:  # as trainer_svc ends a job: a conditional move
        started.set()
        moved.append(ledger.move_job("j", LIVE_STATES, "finished"))

    t = threading.Thread(target=trainer_ends_the_job)
    with ledger.edit_job("j") as edit:
        assert edit.job["state"] == "running"
        t.start()
        started.wait(5)
        time.sleep(0.3)
        assert t.is_alive(), "the move did not wait for the edit"
        edit.set(state="cancelled")
        edit.record_change("me", {"command": "cancel"})
    t.join(30)
    assert moved == [False]  # it saw the cancel, and a cancelled job is not live
    assert ledger.get_job("j")["state"] == "cancelled"
    assert [c["changes"] for c in ledger.job_changes("j")] == [{"command": "cancel"}]


def test_an_edit_that_raises_changes_nothing(ledger) -> None:
    ledger.create_job("j", "n", {"a": 1}, state="running")
    with pytest.raises(RuntimeError), ledger.edit_job("j") as edit:
        edit.set(spec={"a": 2}, state="paused")
        edit.record_change("me", {"command": "pause"})
        raise RuntimeError("the publish failed")
    job = ledger.get_job("j")
    assert (job["spec"], job["state"], ledger.job_changes("j")) == ({"a": 1}, "running", [])
    with pytest.raises(ValueError, match="job state"), ledger.edit_job("j") as edit:
        edit.set(state="nonsense")
