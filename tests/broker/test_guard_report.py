"""Collapse-guard trips as shown to the user (broker/guard_report.py, the demo summary)."""

from asyncrl.demo import summarize
from broker.guard_report import GUARD_ACTOR, describe, guard_trips
from broker.ledger import Ledger


def test_guard_trips_are_the_guards_change_records():
    changes = [
        {"actor": "api", "changes": {"lr": 1e-4}, "created_at": "t0"},
        {"actor": GUARD_ACTOR, "changes": {"kind": "is_blowup", "step": 3}, "created_at": "t1"},
    ]
    assert guard_trips(changes) == [{"kind": "is_blowup", "step": 3, "at": "t1"}]


def test_describe_says_what_the_trip_did():
    kept = {
        "reason": "reward collapse: ...",
        "step": 12,
        "note": "no checkpoint to go back to: kept the current policy",
        "rolled_back_to_step": None,
        "discarded_steps": [],
        "lr": 5e-5,
    }
    assert (
        describe(kept)
        == "step 12: reward collapse: ... -> no checkpoint to go back to: kept the current policy; lr now 5e-05"
    )
    # a record from before the guard wrote a note: a roll-back to 0 was the initial model
    old = {
        "reason": "importance weight max 148 > 100",
        "step": 143,
        "rolled_back_to_step": 0,
        "discarded_steps": list(range(1, 143)),
        "lr": 1e-4,
    }
    assert describe(old) == (
        "step 143: importance weight max 148 > 100 -> restarted from the initial model; "
        "steps 1-142 discarded; lr now 0.0001"
    )
    assert "rolled back to the checkpoint of step 8; step 9 discarded" in describe(
        {"reason": "r", "step": 10, "rolled_back_to_step": 8, "discarded_steps": [9]}
    )


def test_demo_summary_lists_every_trip(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.create_job("j", "demo", {"name": "demo"})
    for step in (1, 2):
        ledger.record_train_step(
            "j",
            step,
            step,
            {
                "reward/mean": 0.3,
                "time/step_s": 1.0,
                "samples": 64.0,
                "tokens": 256.0,
                "off_policy/mean": 1.0,
                "off_policy/max": 1.0,
                "off_policy/dropped": 0.0,
                "guard/trips": float(step - 1),
            },
        )
    assert summarize(ledger, "j", tmp_path, 10.0)["guard_trips"] == []
    ledger.record_change(
        "j",
        GUARD_ACTOR,
        {
            "reason": "loss is nan",
            "kind": "non_finite",
            "step": 2,
            "note": "rolled back to the checkpoint of step 1",
            "rolled_back_to_step": 1,
            "discarded_steps": [],
            "lr": 5e-5,
        },
    )
    summary = summarize(ledger, "j", tmp_path, 10.0)
    assert summary["guard_trips"] == ["step 2: loss is nan -> rolled back to the checkpoint of step 1; lr now 5e-05"]
    ledger.close()
