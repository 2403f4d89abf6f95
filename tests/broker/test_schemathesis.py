"""Property-based API test: schemathesis generates requests from the job API's own OpenAPI schema
and sends them to a live app (uvicorn on a free port, real local Redis, a SQLite and a PostgreSQL
ledger); no response may be a 5xx, every status code answered must be documented in the OpenAPI
(`status_code_conformance`), and every body must match its documented schema (`documented_body`).
The number of cases sent goes to results/hostile.json (`schemathesis_cases`).

Half of the job-scoped requests name a freshly submitted job instead of a random id, so the
generated bodies reach the route logic (PATCH validation, state transitions), not only the 404.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from uuid import uuid4

import httpx
import pytest
import schemathesis
import uvicorn
from hostile_results import record_hostile
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from broker.api import create_app
from broker.ledger import Ledger
from broker.streams import connect
from shared.settings import BrokerSettings

REDIS_URL = "redis://127.0.0.1:6379/0"
SPEC = {"name": "tiny", "model_path": "models/tiny", "group_size": 4, "steps": 3}


@dataclass
class LiveApi:
    base_url: str

    def new_job(self) -> str:
        resp = httpx.post(f"{self.base_url}/jobs", json=SPEC, timeout=10)
        assert resp.status_code == 201, resp.text
        return resp.json()["id"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CASES = {"n": 0}


@pytest.fixture(scope="module", autouse=True)
def _record_cases() -> Iterator[None]:
    yield
    if CASES["n"]:
        record_hostile(schemathesis_cases=CASES["n"])


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def ledger_url(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    postgres_database: Callable[[], AbstractContextManager[str]],
) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('st')}/l.db"
    else:
        with postgres_database() as url:
            yield url


@pytest.fixture(scope="module")
def live_api(ledger_url: str) -> Iterator[LiveApi]:
    prefix = f"test-st-{uuid4().hex}:"
    ledger = Ledger(ledger_url)
    app = create_app(BrokerSettings(redis_url=REDIS_URL, stream_prefix=prefix), ledger=ledger)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield LiveApi(f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        ledger.close()
        r = connect(REDIS_URL)
        keys = list(r.scan_iter(match=f"{prefix}*"))
        if keys:
            r.delete(*keys)
        r.close()


def _openapi() -> dict:
    """The app's OpenAPI document, from an app on an unmigrated in-memory ledger (no I/O: the
    Redis client connects lazily). The schema must exist at collection time;
    `schemathesis.pytest.from_fixture` would load it from the live app instead, but schemathesis
    4.32 sets `Node._nodeid`, which pytest 9 no longer has."""
    return create_app(BrokerSettings(redis_url=REDIS_URL), ledger=Ledger("sqlite://", migrate=False)).openapi()


schema = schemathesis.openapi.from_dict(_openapi())


def documented_body(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool | None:
    """`response_schema_conformance`, except for FastAPI's own 400 on a body it cannot decode (not
    UTF-8): that answer is `{"detail": ...}`, not the API's `{"error": ...}`."""
    if response.status_code == 400 and "detail" in (response.json() or {}):
        return None
    return response_schema_conformance(ctx, response, case)


@pytest.mark.integration
@schema.given(real_job=st.booleans())
@schema.parametrize()
@settings(
    # 15 per operation in the default run; the hostile suite's full size (>= 20,000 cases over both
    # ledgers): SCHEMATHESIS_MAX_EXAMPLES=650 pytest tests/broker/test_schemathesis.py
    max_examples=int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "15")),
    deadline=None,
    database=None,  # no .hypothesis/ directory in the work tree
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_no_server_errors(case: schemathesis.Case, real_job: bool, live_api: LiveApi) -> None:
    if real_job and case.path_parameters and "job_id" in case.path_parameters:
        case.path_parameters["job_id"] = live_api.new_job()
    CASES["n"] += 1
    case.call_and_validate(
        base_url=live_api.base_url, checks=[not_a_server_error, status_code_conformance, documented_body]
    )
