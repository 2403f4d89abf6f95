"""Bearer-token auth and Prometheus metrics of the job API (TestClient, real Redis, SQLite ledger)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from asyncrl import cli
from broker.api import configured_tokens, create_app, load_token_file
from broker.ledger import Ledger
from broker.streams import connect
from shared.settings import BrokerSettings

REDIS_URL = "redis://127.0.0.1:6379/0"
SPEC = {"name": "tiny", "model_path": "models/tiny", "group_size": 4, "steps": 3}
RW, RO = "rw-secret-1", "ro-secret-1"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Api:
    def __init__(self, client: TestClient, ledger: Ledger):
        self.client, self.ledger = client, ledger

    def submit(self, token: str | None = RW) -> str:
        resp = self.client.post("/jobs", json=SPEC, headers=bearer(token) if token else {})
        assert resp.status_code == 201, resp.text
        return resp.json()["id"]


@pytest.fixture
def make_api(tmp_path: Path) -> Iterator[Callable[..., Api]]:
    """Build an app from BrokerSettings keyword arguments (tokens, read_only_tokens, token_file)."""
    prefix = f"test-{uuid4().hex}:"
    ledgers: list[Ledger] = []
    clients: list[TestClient] = []

    def make(**settings: Any) -> Api:
        ledger = Ledger(f"sqlite:///{tmp_path}/ledger-{len(ledgers)}.db")
        ledgers.append(ledger)
        app = create_app(BrokerSettings(redis_url=REDIS_URL, stream_prefix=prefix, **settings), ledger=ledger)
        client = TestClient(app)
        clients.append(client.__enter__())
        return Api(client, ledger)

    r = connect(REDIS_URL)
    try:
        yield make
    finally:
        for client in clients:
            client.__exit__(None, None, None)
        for ledger in ledgers:
            ledger.close()
        keys = list(r.scan_iter(match=f"{prefix}*"))
        if keys:
            r.delete(*keys)
        r.close()


@pytest.fixture
def api(make_api: Callable[..., Api]) -> Api:
    return make_api(tokens=f"{RW}, rw-secret-2", read_only_tokens=RO)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Parse Prometheus text into {(sample name, labels): value}."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# --- authentication -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [("get", "/jobs"), ("get", "/jobs/x"), ("post", "/jobs"), ("post", "/jobs/x/stop")],
)
def test_no_token_is_401_with_challenge(api: Api, method: str, path: str) -> None:
    resp = api.client.request(method.upper(), path, json=SPEC if path == "/jobs" else None)
    assert resp.status_code == 401
    assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert resp.json() == {"error": "missing bearer token; send `Authorization: Bearer <token>`"}
    assert api.ledger.list_jobs() == []


@pytest.mark.parametrize(
    "header",
    [
        "Bearer wrong",
        f"Bearer {RW}x",
        f"Bearer {RW[:-1]}",  # a prefix of a real token
        f"Bearer {RO.upper()}",
        "Bearer tök",  # non-ASCII must be a 401, not a 500
    ],
)
def test_wrong_token_is_401(api: Api, header: str) -> None:
    resp = api.client.get("/jobs", headers={"Authorization": header.encode()})
    assert resp.status_code == 401
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert resp.json() == {"error": "invalid bearer token"}


@pytest.mark.parametrize("header", [f"Basic {RW}", RW, "Bearer"])
def test_other_schemes_are_401(api: Api, header: str) -> None:
    resp = api.client.get("/jobs", headers={"Authorization": header})
    assert resp.status_code == 401
    assert resp.headers["WWW-Authenticate"] == "Bearer"


def test_read_only_token_can_read_but_not_write(api: Api) -> None:
    job_id = api.submit(RW)
    listed = api.client.get("/jobs", headers=bearer(RO))
    assert listed.status_code == 200 and [j["id"] for j in listed.json()] == [job_id]
    shown = api.client.get(f"/jobs/{job_id}", headers=bearer(RO))
    assert shown.status_code == 200 and shown.json()["state"] == "queued"

    resp = api.client.post("/jobs", json=SPEC, headers=bearer(RO))
    assert resp.status_code == 403
    assert resp.json() == {"error": "this token is read-only; POST /jobs needs a read-write token"}
    resp = api.client.post(f"/jobs/{job_id}/stop", headers=bearer(RO))
    assert resp.status_code == 403
    assert "read-only" in resp.json()["error"]
    assert [j["id"] for j in api.ledger.list_jobs()] == [job_id]
    assert api.ledger.get_job(job_id)["state"] == "queued"  # type: ignore[index]


@pytest.mark.parametrize("token", [RW, "rw-secret-2"])
def test_read_write_token_can_do_everything(api: Api, token: str) -> None:
    job_id = api.submit(token)
    assert api.client.get("/jobs", headers=bearer(token)).status_code == 200
    assert api.client.get(f"/jobs/{job_id}", headers=bearer(token)).status_code == 200
    api.ledger.set_job_state(job_id, "running")  # a trainer took it
    resp = api.client.post(f"/jobs/{job_id}/stop", headers=bearer(token))
    assert resp.status_code == 202 and resp.json() == {"id": job_id, "state": "stopping"}


def test_auth_comes_before_body_validation(api: Api) -> None:
    # An anonymous caller learns nothing about the spec format (a 401, not a 422).
    assert api.client.post("/jobs", json={"typo": 1}).status_code == 401
    assert api.client.post("/jobs", json={"typo": 1}, headers=bearer(RO)).status_code == 403
    assert api.client.post("/jobs", json={"typo": 1}, headers=bearer(RW)).status_code == 422


def test_health_and_metrics_are_open(api: Api) -> None:
    assert api.client.get("/health").status_code == 200
    assert api.client.get("/metrics").status_code == 200


def test_openapi_declares_bearer_on_job_routes_only(api: Api) -> None:
    spec = api.client.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path, ops in spec["paths"].items():
        for op in ops.values():
            protected = path.startswith(("/jobs", "/tasks/", "/queue", "/fleet"))
            expected = [{"HTTPBearer": []}] if protected else None
            assert op.get("security") == expected, (path, op)


def test_without_tokens_every_endpoint_is_open(make_api: Callable[..., Api], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="broker.api"):
        api = make_api()
    assert [r.message for r in caplog.records if "no bearer token configured" in r.message]
    job_id = api.submit(token=None)
    assert api.client.get("/jobs").status_code == 200
    assert api.client.get(f"/jobs/{job_id}").status_code == 200
    # A stray header is ignored while auth is off.
    assert api.client.get("/jobs", headers=bearer("anything")).status_code == 200
    assert api.client.post(f"/jobs/{job_id}/stop").status_code == 202


def test_tokens_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BROKER_TOKENS", "tok-a, tok-b,,")
    monkeypatch.setenv("BROKER_READ_ONLY_TOKENS", "tok-c")
    settings = BrokerSettings()
    assert (settings.tokens, settings.read_only_tokens) == (("tok-a", "tok-b"), ("tok-c",))
    assert "tok-" not in repr(settings)  # tokens stay out of logs and tracebacks


def test_token_with_whitespace_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot contain whitespace"):
        BrokerSettings(tokens="one two")


# --- token file -----------------------------------------------------------------------------------

TOKEN_FILE = """\
# operators
file-rw-1
file-rw-2   rw   # explicit role, trailing comment

  file-ro-1 ro
#file-commented-out
file#hash
"""


def test_token_file_parsing(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(TOKEN_FILE)
    assert load_token_file(path) == [
        ("file-rw-1", "rw"),
        ("file-rw-2", "rw"),
        ("file-ro-1", "ro"),
        ("file#hash", "rw"),
    ]


@pytest.mark.parametrize(
    ("line", "hint"),
    [("tok admin", "the word after the token must be `ro`"), ("tok ro extra", "got 3 words")],
)
def test_token_file_bad_line_names_the_line(tmp_path: Path, line: str, hint: str) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"good\n\n{line}\n")
    with pytest.raises(ValueError, match=f"tokens:3: .*{hint}") as err:
        load_token_file(path)
    assert "admin" not in str(err.value)


def test_empty_token_file_is_an_error_not_an_open_api(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# nobody yet\n\n")
    with pytest.raises(ValueError, match="has no token"):
        configured_tokens(BrokerSettings(token_file=path))


def test_a_token_cannot_have_both_roles(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("shared ro\n")
    with pytest.raises(ValueError, match="both read-write and read-only"):
        configured_tokens(BrokerSettings(tokens="shared", token_file=path))


def test_token_file_roles_are_enforced(make_api: Callable[..., Api], tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(TOKEN_FILE)
    api = make_api(token_file=path, tokens="env-rw")
    job_id = api.submit("file-rw-2")
    api.submit("env-rw")
    assert api.client.get(f"/jobs/{job_id}", headers=bearer("file-ro-1")).status_code == 200
    assert api.client.post(f"/jobs/{job_id}/stop", headers=bearer("file-ro-1")).status_code == 403
    assert api.client.get("/jobs", headers=bearer("file-commented-out")).status_code == 401
    assert api.client.post(f"/jobs/{job_id}/stop", headers=bearer("file-rw-1")).status_code == 202


# --- metrics --------------------------------------------------------------------------------------


def test_metrics_count_requests_by_route_and_status(api: Api) -> None:
    job_id = api.submit(RW)
    api.client.get(f"/jobs/{job_id}", headers=bearer(RO))
    api.client.get("/jobs/nope", headers=bearer(RO))
    api.client.get("/jobs")
    api.client.get(f"/not-a-route/{uuid4().hex}")
    resp = api.client.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    got = samples(resp.text)

    def count(method: str, route: str, status: str) -> float:
        key = frozenset({"method": method, "route": route, "status": status}.items())
        return got.get(("asyncrl_http_requests_total", key), 0.0)

    assert count("POST", "/jobs", "201") == 1
    assert count("GET", "/jobs/{job_id}", "200") == 1  # the template, not the job id
    assert count("GET", "/jobs/{job_id}", "404") == 1
    assert count("GET", "/jobs", "401") == 1
    assert count("GET", "<unmatched>", "404") == 1
    latency = frozenset({"method": "POST", "route": "/jobs"}.items())
    assert got[("asyncrl_http_request_duration_seconds_count", latency)] == 1


def test_metrics_job_gauges(api: Api) -> None:
    running, submitted, finished = api.submit(), api.submit(), api.submit()
    api.ledger.record_train_step(running, 1, 1, {"reward/mean": 0.5, "off_policy/mean": 1.0})
    api.ledger.set_job_state(running, "running")
    api.ledger.record_train_step(finished, 3, 3, {"reward/mean": 0.9, "off_policy/mean": 0.0})
    api.ledger.set_job_state(finished, "finished")
    got = samples(api.client.get("/metrics").text)

    def gauge(name: str, job_id: str, **labels: str) -> float | None:
        return got.get((name, frozenset({"job_id": job_id, **labels}.items())))

    assert gauge("asyncrl_job_step", running) == 1
    assert gauge("asyncrl_job_reward_mean", running) == 0.5
    assert gauge("asyncrl_job_staleness_mean", running) == 1.0
    assert gauge("asyncrl_job_step", submitted) == 0
    assert gauge("asyncrl_job_reward_mean", submitted) is None  # no train step yet
    assert all(finished not in dict(labels).values() for _, labels in got)  # terminal jobs left out


def test_metrics_sample_counts(api: Api) -> None:
    job_id = api.submit()
    rows = [
        {
            "msg_id": f"m{i}",
            "job_id": job_id,
            "group_id": "g0",
            "sample_index": i,
            "prompt_index": 0,
            "generator_id": "gen-0",
            "gen_version_min": 0,
            "num_prompt_tokens": 1,
            "num_completion_tokens": 1,
            "completion": "c",
        }
        for i in range(3)
    ]
    assert api.ledger.record_generated(rows) == 3
    api.ledger.record_scored([("m0", 1.0)])
    got = samples(api.client.get("/metrics").text)
    counts = {dict(labels)["status"]: v for (name, labels), v in got.items() if name == "asyncrl_samples"}
    assert counts == api.ledger.status_counts(job_id) == {"generated": 2, "scored": 1}


def test_apps_in_one_process_keep_their_own_metrics(make_api: Callable[..., Api]) -> None:
    first, second = make_api(), make_api()
    first.submit(token=None)
    key = (
        "asyncrl_http_requests_total",
        frozenset({"method": "POST", "route": "/jobs", "status": "201"}.items()),
    )
    assert samples(first.client.get("/metrics").text)[key] == 1
    assert key not in samples(second.client.get("/metrics").text)


# --- CLI ------------------------------------------------------------------------------------------


def test_cli_sends_the_token(api: Api, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # httpx is pointed at the TestClient on purpose: this checks the header the CLI sends.
    def relay(method: str) -> Callable[..., Any]:
        def call(url: str, **kwargs: Any) -> Any:
            kwargs.pop("timeout", None)
            return api.client.request(method, url.removeprefix("http://api"), **kwargs)

        return call

    monkeypatch.setattr(cli, "httpx", SimpleNamespace(get=relay("GET"), post=relay("POST")))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    runner = CliRunner()
    base = ["--api", "http://api"]

    denied = runner.invoke(cli.app, ["submit", str(spec), *base])
    assert denied.exit_code == 1 and "missing bearer token" in denied.output
    submitted = runner.invoke(cli.app, ["submit", str(spec), *base, "--token", RW, "--json"])
    assert submitted.exit_code == 0, submitted.output
    job_id = json.loads(submitted.output)["id"]
    again = runner.invoke(cli.app, ["submit", str(spec), *base, "--token", RW])
    assert (
        again.exit_code == 0 and "queued, position 2 in the queue; status page http://api/status?job=" in again.output
    )
    shown = runner.invoke(cli.app, ["status", job_id, *base], env={"ASYNCRL_TOKEN": RO})
    assert shown.exit_code == 0 and json.loads(shown.output)["id"] == job_id
    refused = runner.invoke(cli.app, ["stop", job_id, *base], env={"ASYNCRL_TOKEN": RO})
    assert refused.exit_code == 1 and "read-only" in refused.output
    stopped = runner.invoke(cli.app, ["stop", job_id, *base, "--token", RW], env={"ASYNCRL_TOKEN": RO})
    assert stopped.exit_code == 0 and json.loads(stopped.output)["state"] == "stopped"  # queued: stopped at once
