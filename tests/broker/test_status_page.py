"""The status page: its routes over TestClient, and the rendered page in a real headless Chromium.

Real Redis (127.0.0.1:6379, a unique key prefix per test) and a SQLite ledger in tmp_path.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image

from broker.api import create_app
from broker.fleet import Beacon
from broker.ledger import Ledger
from broker.streams import JobStreams, connect
from shared.drop_skew import step_metrics
from shared.settings import BrokerSettings

REDIS_URL = "redis://127.0.0.1:6379/0"
CHROMIUM = Path("/usr/bin/chromium")
RW, RO = "rw-status-secret", "ro-status-secret"
TRAIN_BLUE = (0x25, 0x63, 0xEB)  # COLORS.train in broker/static/status.js


def populate(ledger: Ledger, job_id: str = "job-abc123", name: str = "gsm8k-tiny") -> str:
    """A running job with five train steps, two evals, one generator load, a guard trip, four
    scored samples (0.5 generator-seconds each) of which one reward failed (reward error fraction
    0.25), and each step's drop skew: 16 trained samples (10 tokens, rewards 0 and 1) against 16
    dropped over-long (20 tokens, the same rewards), which warns (80 dropped over the job, length
    shift +1.0)."""
    ledger.create_job(job_id, name, {"name": name})
    ledger.set_job_state(job_id, "running")
    ids = [f"{job_id}/g0/{i}" for i in range(4)]
    ledger.record_generated(
        [
            {
                "msg_id": m,
                "job_id": job_id,
                "group_id": f"{job_id}/g0",
                "sample_index": i,
                "prompt_index": 0,
                "generator_id": "gen-0",
                "gen_version_min": 0,
                "num_prompt_tokens": 2,
                "num_completion_tokens": 3,
                "completion": "x",
                "gen_seconds": 0.5,
            }
            for i, m in enumerate(ids)
        ]
    )
    ledger.record_scored_ids([(m, 1.0, "ok", None) for m in ids[:3]] + [(ids[3], 0.0, "error", {"reason": "HTTP 500"})])
    for step in range(1, 6):
        ledger.record_train_step(
            job_id,
            step,
            step,
            {
                "reward/mean": 0.1 * step,
                "off_policy/mean": 0.5 + 0.1 * step,
                "off_policy/max": float(step % 3 + 1),
                "throughput/samples_per_s": 20.0 + step,
                "time/step_s": 1.5,
                "loss": 0.3,
                **step_metrics([(10, 1.0), (10, 0.0)] * 8, {"overlong": [(20, 1.0), (20, 0.0)] * 8}),
            },
        )
        ledger.set_job_step(job_id, step)
    ledger.record_eval(job_id, 2, 1, 2, 0.25, 32)
    ledger.record_eval(job_id, 4, 3, 4, 0.45, 32)
    ledger.record_eval(job_id, 4, 4, 4, 0.5, 32, source="checkpoint")  # the admin worker's
    ledger.record_generator_load(job_id, 5, "gen-0")
    ledger.record_change(
        job_id,
        "trainer collapse guard",
        {  # as trainer_svc/train.py records one
            "reason": "importance-weight ESS 0.03 < 0.05 (reinforce)",
            "kind": "is_blowup",
            "step": 4,
            "action": "keep",
            "note": "no checkpoint to go back to: kept the current policy",
            "rolled_back_to_step": None,
            "discarded_steps": [],
            "lr": 5e-5,
            "max_staleness": 0,
        },
    )
    return job_id


@pytest.fixture
def make_app(tmp_path: Path) -> Iterator[Callable[..., tuple[FastAPI, Ledger, JobStreams]]]:
    """Builds an app on a fresh ledger; returns (app, ledger, streams of job-abc123)."""
    prefix = f"test-{uuid4().hex}:"
    r = connect(REDIS_URL)
    ledgers: list[Ledger] = []

    def make(**settings: Any) -> tuple[FastAPI, Ledger, JobStreams]:
        ledger = Ledger(f"sqlite:///{tmp_path}/ledger-{len(ledgers)}.db")
        ledgers.append(ledger)
        app = create_app(BrokerSettings(redis_url=REDIS_URL, stream_prefix=prefix, **settings), ledger=ledger)
        return app, ledger, JobStreams(r, "job-abc123", prefix=prefix)

    try:
        yield make
    finally:
        for ledger in ledgers:
            ledger.close()
        keys = list(r.scan_iter(match=f"{prefix}*"))
        if keys:
            r.delete(*keys)
        r.close()


@pytest.mark.parametrize("path", ["/", "/status"])
def test_page_is_html_with_its_script(make_app, path: str) -> None:
    app, _, _ = make_app()
    with TestClient(app) as client:
        resp = client.get(path)
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/html")
        assert '<script src="/status/static/status.js"></script>' in resp.text
        js = client.get("/status/static/status.js")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"]
        assert "/status/data/" in js.text and "Authorization" in js.text
        # the queue and the fleet: their tables, fed by GET /queue and GET /fleet
        assert '<table id="queue">' in resp.text and '<table id="fleet">' in resp.text
        assert 'getJSON("/queue")' in js.text and 'getJSON("/fleet")' in js.text
        assert client.get("/status/static/status.css").status_code == 200


def test_page_has_no_external_assets(make_app) -> None:
    app, _, _ = make_app()
    with TestClient(app) as client:
        bodies = [client.get(p).text for p in ("/status", "/status/static/status.js", "/status/static/status.css")]
    for body in bodies:
        assert not re.search(r"https?://", body)


def test_only_known_assets_are_served(make_app) -> None:
    app, _, _ = make_app()
    with TestClient(app) as client:
        for name in ("status.html", "..%2Fapi.py", "nope.js"):
            assert client.get(f"/status/static/{name}").status_code == 404


def test_data_endpoint_returns_the_series(make_app) -> None:
    app, ledger, _ = make_app()
    job_id = populate(ledger)
    ledger.record_train_step(job_id, 6, 6, {"reward/mean": float("nan"), "off_policy/max": "x"})
    with TestClient(app) as client:
        resp = client.get(f"/status/data/{job_id}")
    assert resp.status_code == 200
    body = resp.json()
    assert body["job_id"] == job_id
    steps = body["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[0] == {
        "step": 1,
        "policy_version": 1,
        "reward/mean": pytest.approx(0.1),
        "off_policy/mean": pytest.approx(0.6),
        "off_policy/max": 2.0,
        "throughput/samples_per_s": 21.0,
        "time/step_s": 1.5,
    }
    # Missing, non-finite (stored as null) and non-numeric metrics all come back as null.
    assert steps[5]["reward/mean"] is None and steps[5]["off_policy/max"] is None
    assert steps[5]["time/step_s"] is None
    assert [(e["step"], e["reward_mean"], e["n"], e["source"]) for e in body["evals"]] == [
        (2, 0.25, 32, "pipeline"),
        (4, 0.45, 32, "pipeline"),
        (4, 0.5, 32, "checkpoint"),
    ]
    assert body["evals"][1]["policy_version_min"] == 3
    assert body["guard_trips"] == [
        {
            "step": 4,
            "kind": "is_blowup",
            "action": "keep",
            "text": "step 4: importance-weight ESS 0.03 < 0.05 (reinforce) -> no checkpoint to go back to: kept the "
            "current policy; lr now 5e-05",
        }
    ]


def test_data_endpoint_unknown_job_is_404(make_app) -> None:
    app, _, _ = make_app()
    with TestClient(app) as client:
        resp = client.get("/status/data/nope")
    assert resp.status_code == 404
    assert resp.json() == {"error": "no job 'nope'; GET /jobs lists the known ones"}


def test_with_tokens_page_is_open_but_data_needs_one(make_app) -> None:
    app, ledger, _ = make_app(tokens=RW, read_only_tokens=RO)
    job_id = populate(ledger)
    with TestClient(app) as client:
        assert client.get("/status").status_code == 200
        assert client.get("/status/static/status.js").status_code == 200
        resp = client.get(f"/status/data/{job_id}")
        assert resp.status_code == 401 and "bearer token" in resp.json()["error"]
        bad = client.get(f"/status/data/{job_id}", headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401
        for token in (RW, RO):
            ok = client.get(f"/status/data/{job_id}", headers={"Authorization": f"Bearer {token}"})
            assert ok.status_code == 200 and len(ok.json()["steps"]) == 5


def queue_behind(ledger: Ledger, streams: JobStreams, running: str = "job-abc123") -> Beacon:
    """Two jobs queued behind the running one (the second at a higher priority: it goes first),
    and the fleet's trainer serving the running job, as its beacon says. Close the beacon."""
    ledger.create_job("job-next01", "next-in-line", {"name": "next-in-line", "priority": 5})
    ledger.create_job("job-last02", "last-in-line", {"name": "last-in-line"})
    beacon = Beacon(streams.r, streams.prefix, "trainer", "box-trainer")
    beacon.set("serving", running)
    return beacon


def test_the_page_feeds_show_the_queue_and_the_fleet(make_app) -> None:
    """What the page's queue and fleet tables show, as the page asks for it (a read-only token)."""
    app, ledger, streams = make_app(tokens=RW, read_only_tokens=RO)
    job_id = populate(ledger)
    beacon = queue_behind(ledger, streams, job_id)
    auth = {"Authorization": f"Bearer {RO}"}
    try:
        with TestClient(app) as client:
            queue = client.get("/queue", headers=auth).json()
            fleet = client.get("/fleet", headers=auth).json()
            assert client.get("/queue").status_code == 401  # data, like /jobs: a token
    finally:
        beacon.close()
    assert [(j["id"], j["state"], j["step"], j["reward_error_fraction"]) for j in queue["running"]] == [
        (job_id, "running", 5, 0.25)
    ]
    (warning,) = queue["running"][0]["drop_skew_warnings"]
    assert warning.startswith("dropping biases completion length: the 80 dropped samples average 20 tokens")
    assert [(q["position"], q["id"], q["priority"], q["waiting_for"]) for q in queue["queued"]] == [
        (1, "job-next01", 5, f"job {job_id} to end"),
        (2, "job-last02", 0, "1 job(s) ahead of it"),
    ]
    assert queue["trainers"] == 1
    assert (queue["running"][0]["share"], queue["running"][0]["served_by"]) == (1.0, {"trainer": ["box-trainer"]})
    (trainer,) = fleet["services"]
    assert (trainer["role"], trainer["id"], trainer["state"], trainer["job"]) == (
        "trainer",
        "box-trainer",
        "serving",
        job_id,
    )


# -- the real page in a real browser ------------------------------------------------------------


@pytest.fixture
def served(make_app) -> Iterator[tuple[str, str]]:
    """The API (tokens on) served by uvicorn on a free port; yields (base URL, job id)."""
    app, ledger, streams = make_app(tokens=RW, read_only_tokens=RO)
    job_id = populate(ledger)
    streams.heartbeat("gen-0", {"version": 5})
    beacon = queue_behind(ledger, streams, job_id)
    # a generator serving it beside another job, as the fleet's multi-job beacon says (jobs, load)
    now = time.time()
    load = {
        job_id: {"share": 1.0, "seconds": 12.5, "tokens": 480},
        "job-other9": {"share": 2.0, "seconds": 3.0, "tokens": 96},
    }
    entry = {
        "role": "generator",
        "id": "box-gen",
        "host": "box",
        "pid": 2,
        "job": job_id,
        "jobs": [job_id, "job-other9"],
    }
    streams.r.hset(
        f"{streams.prefix}fleet",
        "generator:box-gen",
        # ts a minute ahead: fresh (fleet_members' STALE_S) for the test without a thread beating it
        json.dumps({**entry, "load": load, "state": "serving", "since": now, "jobs_served": 0, "ts": now + 60}),
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # handed to uvicorn: no race for the port
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start within 10 s"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", job_id
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        beacon.close()


def chromium(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{uuid4().hex[:8]}"
    cmd = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--window-size=1200,900",
        "--virtual-time-budget=5000",
        *args,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.integration
def test_page_renders_in_chromium(served: tuple[str, str], tmp_path: Path) -> None:
    assert CHROMIUM.exists(), "install Debian's chromium: scripts/services.sh does"
    base, job_id = served
    # A read-only token in the URL is forwarded by the page's JS as `Authorization: Bearer`.
    url = f"{base}/status?job={job_id}&token={RO}"

    dump = chromium(tmp_path, url, "--dump-dom")
    assert dump.returncode == 0, dump.stderr[-2000:]
    dom = dump.stdout
    assert f'<code id="job-id">{job_id}</code>' in dom
    assert '<span id="job-name">gsm8k-tiny</span>' in dom
    assert re.search(r'<div id="error" class="error" hidden="?"?>', dom), "the page shows an error"
    assert "gen-0" in dom  # the generators table, heartbeat from Redis
    assert re.search(r"<dt>trained</dt>|<dt>reward/mean</dt>", dom)
    assert "collapse guard tripped 1 time</strong>" in dom and "kept the current policy; lr now 5e-05</li>" in dom
    # the queue: the running job, then each queued one with its place and what it waits for
    queue = dom[dom.index('<table id="queue">') : dom.index('id="no-queue"')]
    assert queue.index(job_id) < queue.index("job-next01") < queue.index("job-last02")
    assert "<td>#1</td>" in queue and f"waiting for job {job_id} to end" in queue
    assert "step 5, share 1</div>" in queue  # the running job's spec names no steps (no N/0) nor a share (1)
    assert "served by generator box-gen; trainer box-trainer</div>" in queue
    assert '<div class="why bad">reward errors 25 %</div>' in queue
    assert '<span id="job-reward-errors" class="bad">reward errors 25 %</span>' in dom
    assert "<dt>error</dt><dd>1</dd>" in dom and "<dt>ok</dt><dd>3</dd>" in dom  # rewards by status
    # what dropping skewed: the header, the warning above the charts, the table by side and reason
    assert '<div class="why bad">dropping biases completion length</div>' in queue
    assert '<span id="job-drop-skew" class="bad">dropped 80, shift length +1.00, reward +0.00</span>' in dom
    assert "<li>dropping biases completion length: the 80 dropped samples average 20 tokens" in dom
    assert re.search(r'<div id="drop-warn" class="warn">', dom)
    assert "<tr><td>trained</td><td>80</td><td>10 (10–10)</td><td>0.5 (0–1)</td></tr>" in dom
    assert "<tr><td>· overlong</td><td>80</td><td>20 (20–20)</td><td>0.5 (0–1)</td></tr>" in dom
    assert "waiting for 1 job(s) ahead of it" in queue and "priority 5" in queue
    fleet = dom[dom.index('<table id="fleet">') : dom.index('id="no-fleet"')]
    assert "box-trainer" in fleet and "serving" in fleet and job_id in fleet
    assert "(share 1, 12.5 s, 480 tok)" in fleet and "job-other9" in fleet and "(share 2, 3 s, 96 tok)" in fleet
    assert "<dt>generator-seconds</dt><dd>2</dd>" in dom and "<dt>completion tokens</dt><dd>12</dd>" in dom

    shot = tmp_path / "shot.png"
    run = chromium(tmp_path, url, f"--screenshot={shot}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert shot.exists() and shot.stat().st_size > 10_000
    img = np.asarray(Image.open(shot).convert("RGB"))
    assert img.shape[:2] == (900, 1200)
    colours = np.unique(img.reshape(-1, 3), axis=0)
    assert len(colours) > 50, f"a near-blank screenshot: {len(colours)} colours"
    # The reward chart drew its train series (its legend swatch is this exact colour).
    assert (np.abs(img.astype(int) - TRAIN_BLUE).max(axis=-1) <= 2).sum() >= 40
