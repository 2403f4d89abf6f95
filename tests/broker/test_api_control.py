"""Live control of a job over HTTP: pause, resume, cancel, PATCH live knobs, the audit log."""

from __future__ import annotations

from collections.abc import Iterator
from uuid import uuid4

import pytest
from fastapi.testclient import TestClient

from broker.api import create_app
from broker.ledger import Ledger
from broker.streams import CONTROL, JobStreams, connect
from shared.jobspec import JobSpec
from shared.schema import Control
from shared.settings import BrokerSettings

REDIS_URL = "redis://127.0.0.1:6379/0"
SPEC = {"name": "tiny", "model_path": "models/tiny", "group_size": 4, "steps": 3, "max_staleness": 1}
RW, RO = "rw-secret-token", "ro-secret-token"


@pytest.fixture
def client(tmp_path) -> Iterator[tuple[TestClient, Ledger, JobStreams]]:
    prefix = f"test-{uuid4().hex}:"
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    settings = BrokerSettings(redis_url=REDIS_URL, stream_prefix=prefix, tokens=RW, read_only_tokens=RO)
    r = connect(REDIS_URL)
    try:
        with TestClient(create_app(settings, ledger=ledger), headers={"Authorization": f"Bearer {RW}"}) as c:
            yield c, ledger, JobStreams(r, "x", prefix=prefix)
    finally:
        keys = list(r.scan_iter(match=f"{prefix}*"))
        if keys:
            r.delete(*keys)


def _controls(streams: JobStreams, job_id: str) -> list[Control]:
    s = JobStreams(streams.r, job_id, prefix=streams.prefix)
    return s.read_broadcast(CONTROL, "0", Control)[1]


def _job(c: TestClient) -> str:
    """A submitted job that a trainer of the fleet took (running): the one live commands are for."""
    r = c.post("/jobs", json=SPEC)
    assert r.status_code == 201, r.text
    c.app.state.api.ledger.set_job_state(r.json()["id"], "running")  # type: ignore[attr-defined]
    return r.json()["id"]


def test_pause_resume_cancel_publish_commands_and_move_the_state(client):
    c, ledger, streams = client
    job = _job(c)
    assert c.post(f"/jobs/{job}/resume").status_code == 409  # not paused
    assert c.post(f"/jobs/{job}/pause").json()["state"] == "paused"
    assert c.post(f"/jobs/{job}/pause").status_code == 409  # already paused
    assert c.get(f"/jobs/{job}").json()["state"] == "paused"
    assert c.post(f"/jobs/{job}/resume").json()["state"] == "running"
    assert c.post(f"/jobs/{job}/cancel").json()["state"] == "cancelled"
    r = c.post(f"/jobs/{job}/pause")
    assert r.status_code == 409 and "cancelled" in r.json()["error"]
    assert [m.command for m in _controls(streams, job)] == ["pause", "resume", "cancel"]
    assert c.post("/jobs/nope/pause").status_code == 404


def test_patch_validates_updates_the_spec_and_broadcasts(client):
    c, ledger, streams = client
    job = _job(c)
    body = {"lr": 1e-5, "temperature": 0.7, "top_k": 20, "max_staleness": 2, "generation_batch": 4}
    r = c.patch(f"/jobs/{job}", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["changed"] == body
    spec = JobSpec.model_validate(ledger.get_job(job)["spec"])
    assert (
        spec.algorithm.lr,
        spec.sampling.temperature,
        spec.sampling.top_k,
        spec.max_staleness,
        spec.generation_batch,
    ) == (1e-5, 0.7, 20, 2, 4)
    (msg,) = _controls(streams, job)
    assert msg.command == "set" and msg.settings == {
        "lr": 1e-5,
        "temperature": 0.7,
        "top_k": 20,
        "max_staleness": 2,
        "generation_batch": 4,
    }
    # bad values name the field; an empty patch or an unknown knob is refused; nothing is published
    bad = ({"lr": -1}, "lr"), ({"top_p": 2}, "top_p"), ({"top_k": -1}, "top_k"), ({"group_size": 2}, "group_size")
    for body, field in bad:
        r = c.patch(f"/jobs/{job}", json=body)
        assert r.status_code == 422 and field in r.json()["error"], r.text
    assert c.patch(f"/jobs/{job}", json={}).status_code == 422
    assert len(_controls(streams, job)) == 1


def test_changes_are_audited_with_the_actor_and_read_only_tokens_cannot_change(client):
    c, ledger, streams = client
    job = _job(c)
    c.patch(f"/jobs/{job}", json={"lr": 3e-4})
    c.post(f"/jobs/{job}/pause")
    ro = {"Authorization": f"Bearer {RO}"}
    assert c.patch(f"/jobs/{job}", json={"lr": 1e-3}, headers=ro).status_code == 403
    assert c.post(f"/jobs/{job}/resume", headers=ro).status_code == 403
    log = c.get(f"/jobs/{job}/changes", headers=ro).json()
    assert [e["changes"] for e in log] == [{"command": "set", "settings": {"lr": 3e-4}}, {"command": "pause"}]
    assert all(e["actor"].startswith("rw token ") and RW not in e["actor"] for e in log)


def test_a_stopping_job_cannot_be_paused_and_an_ended_one_refuses_every_change(client):
    c, ledger, streams = client
    job = _job(c)
    assert c.post(f"/jobs/{job}/stop").json()["state"] == "stopping"
    r = c.post(f"/jobs/{job}/pause")
    assert r.status_code == 409 and "stopping" in r.json()["error"]
    r = c.patch(f"/jobs/{job}", json={"lr": 1e-4})  # its services no longer take a change: none is stored
    assert r.status_code == 409 and "stopping" in r.json()["error"]
    assert ledger.move_job(job, ("stopping",), "stopped")  # the trainer's end
    for method, path, body in (("post", "pause", None), ("post", "resume", None), ("post", "cancel", None)):
        r = getattr(c, method)(f"/jobs/{job}/{path}", json=body)
        assert r.status_code == 409 and "already stopped" in r.json()["error"], path
    assert c.patch(f"/jobs/{job}", json={"lr": 1e-3}).status_code == 409
    assert ledger.get_job(job)["state"] == "stopped"
    assert [m.command for m in _controls(streams, job)] == ["stop"]


def test_a_change_that_cannot_be_published_changes_nothing(client):
    from broker.api.deps import request_redis

    c, ledger, streams = client
    job = _job(c)
    before = ledger.get_job(job)
    api = c.app.state.api  # type: ignore[attr-defined]
    api.redis, up = request_redis("redis://127.0.0.1:1/0"), api.redis  # nothing listens on port 1
    try:
        assert c.post(f"/jobs/{job}/pause").status_code == 503
        assert c.patch(f"/jobs/{job}", json={"lr": 0.5}).status_code == 503
    finally:
        api.redis = up
    after = ledger.get_job(job)
    assert (after["state"], after["spec"]) == (before["state"], before["spec"]) == ("running", before["spec"])
    assert ledger.job_changes(job) == [] and _controls(streams, job) == []
