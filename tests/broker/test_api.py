"""The job API over HTTP (FastAPI TestClient), with the real local Redis and a SQLite ledger."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any
from uuid import uuid4

import pytest
from fastapi.testclient import TestClient
from redis import Redis

from broker.api import create_app
from broker.api.models import QueueView
from broker.fleet import queue_view
from broker.ledger import Ledger
from broker.streams import CONTROL, JobStreams, connect
from shared.drop_skew import step_metrics
from shared.schema import Control
from shared.settings import BrokerSettings
from tests.broker.test_ledger import HEAD  # the migrations' head

REDIS_URL = "redis://127.0.0.1:6379/0"
SPEC = {"name": "tiny", "model_path": "models/tiny", "group_size": 4, "steps": 3}
ZERO_USAGE = {"generator_seconds": 0.0, "samples": 0, "prompt_tokens": 0, "completion_tokens": 0}


class Api:
    def __init__(self, client: TestClient, ledger: Ledger, redis: Redis, prefix: str):
        self.client, self.ledger, self.redis, self.prefix = client, ledger, redis, prefix

    def streams(self, job_id: str) -> JobStreams:
        return JobStreams(self.redis, job_id, prefix=self.prefix)

    def controls(self, job_id: str) -> list[Control]:
        _, msgs = self.streams(job_id).read_broadcast(CONTROL, "0", Control)
        return msgs  # type: ignore[return-value]

    def submit(self, spec: dict[str, Any] | None = None) -> str:
        resp = self.client.post("/jobs", json=spec or SPEC)
        assert resp.status_code == 201, resp.text
        return resp.json()["id"]


@pytest.fixture
def api(tmp_path) -> Iterator[Api]:
    prefix = f"test-{uuid4().hex}:"
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    settings = BrokerSettings(redis_url=REDIS_URL, stream_prefix=prefix)
    r = connect(REDIS_URL)
    try:
        with TestClient(create_app(settings, ledger=ledger)) as client:
            yield Api(client, ledger, r, prefix)
    finally:
        ledger.close()
        keys = list(r.scan_iter(match=f"{prefix}*"))
        if keys:
            r.delete(*keys)
        r.close()


def test_health(api: Api) -> None:
    resp = api.client.get("/health")
    assert resp.status_code == 200
    assert resp.json() == {"ok": True, "redis": True, "ledger_revision": HEAD}


def test_submit_valid_job(api: Api) -> None:
    resp = api.client.post("/jobs", json=SPEC)
    assert resp.status_code == 201
    body = resp.json()
    assert set(body) == {"id", "state", "position", "spec"}
    assert body["state"] == "queued" and body["position"] >= 1
    assert isinstance(body["id"], str) and len(body["id"]) >= 8
    assert body["spec"]["group_size"] == 4
    assert body["spec"]["algorithm"]["loss"] == "aipo"  # defaults filled in
    job = api.ledger.get_job(body["id"])
    assert job is not None
    assert (job["name"], job["state"], job["spec"]) == ("tiny", "queued", body["spec"])


def test_each_submission_gets_its_own_id(api: Api) -> None:
    assert len({api.submit() for _ in range(3)}) == 3


def test_a_client_may_choose_the_job_id_once(api: Api) -> None:
    # what the launcher does: its services start with JOB_ID before the API is up to take the job
    resp = api.client.post("/jobs", json=SPEC, params={"job_id": "0123456789ab"})
    assert resp.status_code == 201 and resp.json()["id"] == "0123456789ab"
    assert api.ledger.get_job("0123456789ab")["name"] == "tiny"
    again = api.client.post("/jobs", json={**SPEC, "name": "other"}, params={"job_id": "0123456789ab"})
    assert again.status_code == 409 and "already exists" in again.text
    assert api.ledger.get_job("0123456789ab")["name"] == "tiny"  # the first one stands
    bad = api.client.post("/jobs", json=SPEC, params={"job_id": "../x"})
    assert bad.status_code == 422


@pytest.mark.parametrize(
    ("spec", "field", "hint"),
    [
        ({**SPEC, "lerning_rate": 0.1}, "lerning_rate", "unknown field"),
        ({k: v for k, v in SPEC.items() if k != "model_path"}, "model_path", "required"),
        ({**SPEC, "group_size": 1}, "group_size", "greater than or equal to 2"),
        ({**SPEC, "mode": "bogus"}, "mode", "'async' or 'sync'"),
        ({**SPEC, "algorithm": {"lr": 0}}, "algorithm.lr", "greater than 0"),
        ({**SPEC, "task": {"name": "gsm8k"}}, "task", "task.path is required"),
        ({**SPEC, "tracking": {"sinks": ["comet"]}}, "tracking.sinks.0", "'tensorboard', 'mlflow' or 'wandb'"),
        ({**SPEC, "share": 0}, "share", "greater than 0"),
        ({**SPEC, "share": -1}, "share", "greater than 0"),
        ({**SPEC, "share": 1001}, "share", "less than or equal to 1000"),
    ],
)
def test_invalid_spec_is_422_naming_the_field(api: Api, spec: dict, field: str, hint: str) -> None:
    resp = api.client.post("/jobs", json=spec)
    assert resp.status_code == 422
    body = resp.json()
    assert set(body) == {"error", "fields"}
    assert isinstance(body["error"], str)
    assert body["error"].startswith("invalid job spec")
    assert f"{field}:" in body["error"] and hint in body["error"]
    assert [f["field"] for f in body["fields"]] == [field]
    assert hint in body["fields"][0]["message"]
    assert api.ledger.list_jobs() == []  # nothing stored


def test_several_invalid_fields_are_all_listed(api: Api) -> None:
    resp = api.client.post("/jobs", json={"group_size": 1, "mode": "bogus", "typo": True})
    assert resp.status_code == 422
    assert {f["field"] for f in resp.json()["fields"]} == {
        "model_path",
        "group_size",
        "mode",
        "typo",
    }


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b""])
def test_malformed_body_is_422_json(api: Api, content: bytes) -> None:
    resp = api.client.post("/jobs", content=content, headers={"content-type": "application/json"})
    assert resp.status_code == 422
    body = resp.json()
    assert isinstance(body["error"], str) and body["error"]
    assert isinstance(body["fields"], list)


def test_list_jobs(api: Api) -> None:
    assert api.client.get("/jobs").json() == []
    first = api.submit()
    second = api.submit({**SPEC, "name": "second"})
    jobs = api.client.get("/jobs").json()
    assert {j["id"] for j in jobs} == {first, second}
    assert [j["id"] for j in jobs] == [second, first]  # newest first
    assert set(jobs[0]) == {"id", "name", "state", "priority", "step", "created_at", "updated_at"}
    assert jobs[0]["name"] == "second" and jobs[0]["state"] == "queued" and jobs[0]["step"] == 0
    assert [j["id"] for j in api.client.get("/jobs", params={"limit": 1}).json()] == [second]


def test_job_status(api: Api) -> None:
    job_id = api.submit()
    resp = api.client.get(f"/jobs/{job_id}")
    assert resp.status_code == 200
    body = resp.json()
    assert body == {
        "id": job_id,
        "name": "tiny",
        "state": "queued",
        "step": 0,
        "error": None,
        "created_at": body["created_at"],
        "started_at": None,  # no trainer has started it yet
        "spec": body["spec"],
        "last_metrics": None,
        "evals": [],
        "samples": {},
        "staleness": {},
        "reward_errors": {"by_status": {}, "fraction": None},  # nothing scored yet
        "drop_skew": {
            "trained": {"count": 0, "length": None, "reward": None},
            "dropped": {"count": 0, "length": None, "reward": None},
            "by_reason": {},
            "shift": {"length": None, "reward": None},
            "warnings": [],
        },
        "generators": {},
        "usage": {
            **ZERO_USAGE,
            "by_generator": {},
            "by_kind": {"train": ZERO_USAGE, "eval": ZERO_USAGE},
            "adapters": 0,
        },
    }
    assert body["spec"]["model_path"] == "models/tiny"
    assert body["spec"]["share"] == 1.0  # the default, stored with the spec


def test_job_status_reports_usage(api: Api) -> None:
    job_id = api.submit()
    base = {"job_id": job_id, "sample_index": 0, "prompt_index": 0, "gen_version_min": 0, "completion": "x"}
    api.ledger.record_generated(
        [
            {
                **base,
                "msg_id": "a",
                "group_id": "g",
                "generator_id": "gen-0",
                "num_prompt_tokens": 4,
                "num_completion_tokens": 6,
                "adapter": "job/v1#1",
                "gen_seconds": 0.5,
            },
            {
                **base,
                "msg_id": "b",
                "group_id": "g",
                "generator_id": "gen-1",
                "num_prompt_tokens": 4,
                "num_completion_tokens": 2,
                "adapter": "job/v1#1",
                "gen_seconds": 0.25,
            },
            {
                **base,
                "msg_id": "c",
                "group_id": "e",
                "generator_id": "gen-1",
                "num_prompt_tokens": 3,
                "num_completion_tokens": 1,
                "kind": "eval",
                "eval_set": "held_out",
                "gen_seconds": 0.125,
            },
        ]
    )
    usage = api.client.get(f"/jobs/{job_id}").json()["usage"]
    # 0.5 + 0.25 + 0.125 s; prompts 4 + 4 + 3; completions 6 + 2 + 1; one adapter
    assert usage == {
        "generator_seconds": 0.875,
        "samples": 3,
        "prompt_tokens": 11,
        "completion_tokens": 9,
        "by_generator": {
            "gen-0": {"seconds": 0.5, "samples": 1, "completion_tokens": 6},
            "gen-1": {"seconds": 0.375, "samples": 2, "completion_tokens": 3},
        },
        "by_kind": {
            "train": {"generator_seconds": 0.75, "samples": 2, "prompt_tokens": 8, "completion_tokens": 8},
            "eval": {"generator_seconds": 0.125, "samples": 1, "prompt_tokens": 3, "completion_tokens": 1},
        },
        "adapters": 1,
    }


def test_job_status_reports_progress_and_generators(api: Api) -> None:
    job_id = api.submit()
    api.ledger.set_job_state(job_id, "running")
    api.ledger.set_job_step(job_id, 2)
    api.ledger.record_train_step(job_id, 1, 1, {"loss": 0.5})
    api.ledger.record_train_step(job_id, 2, 2, {"loss": 0.25})
    api.ledger.record_generator_load(job_id, 1, "gen-0")
    api.ledger.record_generator_load(job_id, 2, "gen-0")
    api.streams(job_id).heartbeat("gen-0", {"version": 2})
    api.streams(job_id).heartbeat("gen-1", {"version": 1})
    body = api.client.get(f"/jobs/{job_id}").json()
    assert (body["state"], body["step"]) == ("running", 2)
    assert body["last_metrics"] == {"loss": 0.25}
    gens = body["generators"]
    assert set(gens) == {"gen-0", "gen-1"}
    assert gens["gen-0"]["versions_loaded"] == [1, 2]
    assert gens["gen-0"]["heartbeat"]["version"] == 2
    assert gens["gen-1"]["versions_loaded"] == [] and gens["gen-1"]["heartbeat"]["version"] == 1


def test_job_status_shows_what_dropping_skewed(api: Api) -> None:
    """Two steps' drop_skew metrics as the trainer writes them: the job's summary weighs them by
    their counts, and warns past the spec's drop_skew.max_shift once enough samples were dropped."""
    job_id = api.submit({**SPEC, "drop_skew": {"max_shift": 0.5, "min_dropped": 4}})
    trained = [(10, 1.0), (10, 0.0)] * 2
    api.ledger.record_train_step(job_id, 1, 1, {"loss": 0.5, **step_metrics(trained, {"overlong": [(16, 0.0)]})})
    api.ledger.record_train_step(job_id, 2, 2, step_metrics(trained, {"overlong": [(16, 0.0)] * 3}))
    skew = api.client.get(f"/jobs/{job_id}").json()["drop_skew"]
    assert skew["trained"]["count"] == 8 and skew["trained"]["reward"]["mean"] == 0.5
    assert skew["dropped"] == skew["by_reason"]["overlong"]
    assert skew["dropped"]["count"] == 4 and skew["dropped"]["length"]["mean"] == 16.0
    assert set(skew["by_reason"]) == {"overlong"}
    # trained lengths all 10: scale 10, (16 - 10) / 10 = 0.6 > 0.5; rewards [0, 0, 1, 1]: p10 0, p50 0.5,
    # p90 1, scale max(0.5, 1 - 0) = 1; the dropped all 0: -0.5 / 1, within
    assert skew["shift"]["length"] == {"mean": pytest.approx(0.6), "quantile": pytest.approx(0.6)}
    assert skew["shift"]["reward"] == {"mean": pytest.approx(-0.5), "quantile": pytest.approx(-0.5)}
    (warning,) = skew["warnings"]
    assert warning.startswith("dropping biases completion length: the 4 dropped samples average 16 tokens")
    assert "drop_skew.max_shift 0.5" in warning
    queue = api.client.get("/queue").json()
    assert queue["running"] == []  # queued: no running view yet
    api.ledger.set_job_state(job_id, "running")
    (running,) = api.client.get("/queue").json()["running"]
    assert running["drop_skew_warnings"] == [warning]


@pytest.mark.parametrize(("method", "path"), [("get", "/jobs/nope"), ("post", "/jobs/nope/stop")])
def test_unknown_job_is_404_json(api: Api, method: str, path: str) -> None:
    resp = getattr(api.client, method)(path)
    assert resp.status_code == 404
    assert resp.json() == {"error": "no job 'nope'; GET /jobs lists the known ones"}


def test_stop_publishes_a_control_message(api: Api) -> None:
    job_id = api.submit()
    other = api.submit()
    api.ledger.set_job_state(job_id, "running")  # a trainer took it
    resp = api.client.post(f"/jobs/{job_id}/stop")
    assert resp.status_code == 202
    assert resp.json() == {"id": job_id, "state": "stopping"}
    (msg,) = api.controls(job_id)
    assert isinstance(msg, Control)
    assert (msg.command, msg.job_id, msg.policy_version) == ("stop", job_id, 0)
    assert api.controls(other) == []  # only the stopped job's stream
    assert api.client.get(f"/jobs/{job_id}").json()["state"] == "stopping"
    assert api.ledger.get_job(other)["state"] == "queued"


def test_a_queued_job_stopped_or_cancelled_never_starts_and_cannot_be_paused(api: Api) -> None:
    stopped, cancelled, kept = api.submit(), api.submit(), api.submit()
    assert api.client.post(f"/jobs/{stopped}/stop").json() == {"id": stopped, "state": "stopped"}
    assert api.controls(stopped) == []  # nothing serves it: nothing to tell
    assert api.client.post(f"/jobs/{cancelled}/cancel").json() == {"id": cancelled, "state": "cancelled"}
    resp = api.client.post(f"/jobs/{kept}/pause")
    assert resp.status_code == 409 and "queued" in resp.json()["error"]
    assert [j["id"] for j in api.ledger.queue()] == [kept]
    assert api.ledger.claim_next()["id"] == kept  # type: ignore[index]
    assert api.ledger.claim_next() is None


def test_queue_shows_each_jobs_place_and_what_it_waits_for(api: Api) -> None:
    first = api.submit()
    urgent = api.client.post("/jobs", json={**SPEC, "priority": 10}).json()["id"]
    last = api.submit()
    body = api.client.get("/queue").json()
    assert [(q["id"], q["position"]) for q in body["queued"]] == [(urgent, 1), (first, 2), (last, 3)]
    # no trainer is up (no beacon in the fleet's hash): every queued job says so
    assert body["trainers"] == 0 and body["running"] == []
    assert all("no trainer is up" in q["waiting_for"] for q in body["queued"])
    assert api.client.get("/fleet").json() == {"services": []}


def _member(role: str, sid: str, job: str | None, **extra: Any) -> dict[str, Any]:
    """A beacon entry as broker.fleet.Beacon writes it (before or after it listed `jobs`)."""
    entry = {"role": role, "id": sid, "host": "box", "pid": 1, "job": job, "state": "serving" if job else "idle"}
    return {**entry, "since": time.time(), "jobs_served": 0, "ts": time.time(), **extra}


def test_queue_view_gives_each_running_job_its_share_and_who_serves_it(api: Api) -> None:
    a = api.client.post("/jobs", json={**SPEC, "share": 4}).json()["id"]
    b = api.submit()
    api.ledger.create_job("oldspec0001", "old", {"name": "old"})  # a spec stored before `share`: 1.0
    for job_id in (a, b, "oldspec0001"):
        api.ledger.set_job_state(job_id, "running")
    queued = api.submit()
    members = [
        _member("generator", "g0", a, jobs=[a, b]),
        _member("generator", "g1", b, jobs=[b]),
        _member("generator", "g2", None, jobs=[]),  # idle
        _member("reward", "r0", a, jobs=[a, b, a]),  # a repeat counts once
        _member("trainer", "t0", a, jobs=[a]),
        _member("trainer", "t1", b),  # an entry from before `jobs`: its `job`
    ]
    view = queue_view(api.ledger, members)
    running = {j["id"]: (j["share"], j["served_by"]) for j in view["running"]}
    assert running == {
        a: (4.0, {"generator": ["g0"], "reward": ["r0"], "trainer": ["t0"]}),
        b: (1.0, {"generator": ["g0", "g1"], "reward": ["r0"], "trainer": ["t1"]}),
        "oldspec0001": (1.0, {}),
    }
    assert [q["id"] for q in view["queued"]] == [queued]
    QueueView.model_validate(view)

    # the same through the API, from the fleet's hash
    for m in members:
        api.redis.hset(f"{api.prefix}fleet", f"{m['role']}:{m['id']}", json.dumps(m))
    load = {a: {"share": 4.0, "seconds": 1.5, "tokens": 300}, b: {"share": 1.0, "seconds": 0.5, "tokens": 80}}
    api.redis.hset(f"{api.prefix}fleet", "generator:g0", json.dumps({**members[0], "load": load}))
    body = api.client.get("/queue").json()
    assert {j["id"]: j["served_by"] for j in body["running"]}[b] == running[b][1]
    assert {j["id"]: j["share"] for j in body["running"]}[a] == 4.0
    services = {s["id"]: s for s in api.client.get("/fleet").json()["services"]}
    assert (services["g0"]["jobs"], services["g0"]["load"]) == ([a, b], load)
    assert (services["t1"]["job"], services["t1"]["jobs"], services["t1"]["load"]) == (b, [], {})  # old entry


@pytest.mark.parametrize("state", ["finished", "stopped", "failed", "cancelled"])
def test_stopping_a_finished_job_is_409(api: Api, state: str) -> None:
    job_id = api.submit()
    api.ledger.set_job_state(job_id, state)
    resp = api.client.post(f"/jobs/{job_id}/stop")
    assert resp.status_code == 409
    assert state in resp.json()["error"]
    assert api.controls(job_id) == []
    assert api.ledger.get_job(job_id)["state"] == state
