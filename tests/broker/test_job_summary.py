"""A job's summary (broker/job_summary.py): GET /jobs/{id}/summary, and the CLI's rendering of it
(asyncrl/report.py), against the real local Redis and a SQLite ledger."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest
from fastapi.testclient import TestClient
from rich.console import Console

from asyncrl.report import plot, show_summary
from broker.api import create_app
from broker.guard_report import GUARD_ACTOR
from broker.ledger import Ledger
from broker.streams import connect
from shared.settings import BrokerSettings

REDIS_URL = "redis://127.0.0.1:6379/0"


def _steps(ledger: Ledger, job_id: str) -> None:
    """Four steps; step 3's reward was not finite (the ledger keeps null) and step 4 has no staleness."""
    for step, reward in ((1, 0.25), (2, 0.5), (3, float("nan")), (4, 0.75)):
        metrics = {
            "reward/mean": reward,
            "time/step_s": 2.0,
            "samples": 64.0,
            "tokens": 512.0,
            "off_policy/mean": 0.5,
            "off_policy/max": 1.0,
            "off_policy/dropped": float(step == 2),
        }
        if step == 4:
            del metrics["off_policy/mean"], metrics["off_policy/max"]
        ledger.record_train_step(job_id, step, step, metrics, job_step=True)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[tuple[TestClient, Ledger]]:
    prefix = f"test-{uuid4().hex}:"
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    with TestClient(create_app(BrokerSettings(redis_url=REDIS_URL, stream_prefix=prefix), ledger=ledger)) as c:
        yield c, ledger
    ledger.close()
    r = connect(REDIS_URL)
    keys = list(r.scan_iter(match=f"{prefix}*"))
    if keys:
        r.delete(*keys)


def test_summary_answers_what_the_job_did(client, tmp_path: Path) -> None:
    c, ledger = client
    ledger.create_job("j1", "demo", {"name": "demo", "steps": 4})
    ledger.set_job_state("j1", "finished")
    _steps(ledger, "j1")
    ledger.record_eval("j1", 0, 0, 0, 0.125, 16)
    ledger.record_eval("j1", 4, 4, 4, 0.5, 16)
    ledger.record_eval("j1", 4, 4, 4, 0.9, 16, name="other")
    ledger.record_change(
        "j1",
        GUARD_ACTOR,
        {
            "reason": "loss is nan",
            "kind": "non_finite",
            "step": 3,
            "note": "kept the current policy",
            "discarded_steps": [],
            "lr": 5e-5,
        },
    )
    resp = c.get("/jobs/j1/summary")
    assert resp.status_code == 200, resp.text
    s = resp.json()
    assert (s["job_id"], s["state"], s["steps"]) == ("j1", "finished", 4)
    assert s["reward_per_step"] == [0.25, 0.5, None, 0.75]  # JSON has no NaN
    assert s["per_step"][3] == {
        "step": 4,
        "reward/mean": 0.75,
        "off_policy/mean": None,
        "off_policy/max": None,
        "off_policy/dropped": 0.0,
    }
    assert s["held_out"] == [[0, 0.125], [4, 0.5]]  # the first evaluation set
    assert set(s["eval_sets"]) == {"held_out", "other"}
    # steady state: steps 2-4, 3 x 64 samples in 3 x 2 s
    assert s["samples_per_s"] == pytest.approx(32.0) and s["mean_step_s"] == pytest.approx(2.0)
    assert s["guard_trips"] == ["step 3: loss is nan -> kept the current policy; lr now 5e-05"]
    assert c.get("/jobs/nope/summary").status_code == 404

    console = Console(record=True, width=200)
    show_summary(s, 12.0, console)
    text = console.export_text()
    assert "job j1: reward and staleness per block of steps" in text
    row = next(ln for ln in text.splitlines() if "3-3" in ln)
    assert "-" in row.split("│")[2]  # the NaN reward shows as a dash, not as nan
    assert "held-out reward: 0.12 (step 0) -> 0.50 (step 4)" in text
    assert "collapse guard tripped 1 time(s)" in text and "wall time 12 s" in text
    out = plot(s, tmp_path / "summary.png")
    assert out.stat().st_size > 10_000


def test_a_job_without_steps_has_an_empty_summary(client) -> None:
    c, ledger = client
    ledger.create_job("j2", "queued", {"name": "queued"})
    s = c.get("/jobs/j2/summary").json()
    assert (s["state"], s["steps"], s["per_step"], s["held_out"], s["samples_per_s"]) == ("queued", 0, [], [], 0.0)
    assert s["swap_latency_s_median"] is None
