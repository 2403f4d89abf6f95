"""The collapse guard's trips as the user sees them (demo summary, `asyncrl status`, status page).

The trainer records every trip in the job's change log (`Ledger.record_change` with actor
GUARD_ACTOR; `GET /jobs/{id}/changes`); this module only reads those records. No I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

GUARD_ACTOR = "trainer collapse guard"  # the actor trainer_svc/train.py records trips under


def guard_trips(changes: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The guard's trips among a job's change records (`Ledger.job_changes`, or the JSON of
    `GET /jobs/{id}/changes`), oldest first: each record's `changes` plus `at` (its time)."""
    return [{**(c.get("changes") or {}), "at": c.get("created_at")} for c in changes if c.get("actor") == GUARD_ACTOR]


def describe(trip: Mapping[str, Any]) -> str:
    """One line for a trip: where, why, and what it did to the policy and the lr."""
    note = trip.get("note")
    if note is None:  # a record from before the guard said what it did
        back = trip.get("rolled_back_to_step")
        note = "restarted from the initial model" if back == 0 else f"rolled back to the checkpoint of step {back}"
    line = f"step {trip.get('step', '?')}: {trip.get('reason', trip.get('kind', 'trip'))} -> {note}"
    if trip.get("discarded_steps"):
        d = trip["discarded_steps"]
        line += f"; steps {d[0]}-{d[-1]} discarded" if len(d) > 1 else f"; step {d[0]} discarded"
    if trip.get("lr") is not None:
        line += f"; lr now {trip['lr']:.3g}"
    return line
