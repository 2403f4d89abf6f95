"""Hostile input at the job API (issue 13, parts 3 and 4): poisoned job specs, oversized and
anonymous bodies, NUL bytes, Redis and ledger outages, log forging.

The API runs as a real `python -m broker` subprocess (uvicorn, the real local Redis, a SQLite or
PostgreSQL ledger), so its memory is the server's own, read from /proc/<pid>/status (VmHWM: the
peak since start, so a spike between two readings still counts). Every answer is counted; at the
end the module records `server_errors` (5xx seen: must be 0) and the servers' peak RSS in
results/hostile.json (tests/hostile_results.py).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import psutil
import psycopg
import pytest
from hostile_results import record_hostile
from sqlalchemy.engine import make_url

from broker.fleet import Fleet
from broker.ledger import Ledger
from broker.streams import connect
from shared.entry import JobOver, run_service
from shared.metrics import serve_metrics
from shared.settings import RewardSettings, TrainerSettings
from tests.broker.test_ledger import HEAD  # the migrations' head

pytestmark = [pytest.mark.hostile, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
RW, RO = "hostile-rw-token", "hostile-ro-token"
SPEC = {"name": "tiny", "model_path": "models/tiny", "group_size": 4, "steps": 3}
MIB = 1 << 20


@dataclass
class Seen:
    """Every answer the module's servers gave: (method, route template, status), and the 503s
    of servers whose Redis or ledger a test took away (those are the right answer)."""

    answers: list[tuple[str, str, int]] = field(default_factory=list)
    outage_503s: int = 0
    peak_rss_mib: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def server_errors(self) -> int:
        return sum(1 for *_, status in self.answers if status >= 500) - self.outage_503s


SEEN = Seen()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


@dataclass
class Server:
    """A `python -m broker` process and what it logged (stdout and stderr, uvicorn's access log
    included)."""

    proc: subprocess.Popen
    port: int
    ledger_url: str
    log_path: Path
    outage: bool = False  # set while its Redis or ledger is down on purpose: 503 is expected

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def hwm_mib(self) -> float:
        return _status_kib(self.proc.pid, "VmHWM") / 1024

    def rss_mib(self) -> float:
        return _status_kib(self.proc.pid, "VmRSS") / 1024

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def call(
        self,
        method: str,
        template: str,
        *,
        path: str | None = None,
        token: str | None = RW,
        timeout: float = 30,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request; `path` (default: `template`) may hold percent-escapes, sent as they are."""
        headers = dict(kwargs.pop("headers", {}))
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        resp = httpx.request(method, self.base_url + (path or template), headers=headers, timeout=timeout, **kwargs)
        SEEN.answers.append((method, template, resp.status_code))
        SEEN.outage_503s += self.outage and resp.status_code == 503
        return resp

    def submit(self, spec: dict[str, Any] | None = None) -> str:
        resp = self.call("POST", "/jobs", json=spec or SPEC)
        assert resp.status_code == 201, resp.text
        return resp.json()["id"]


@contextmanager
def broker_server(tmp: Path, ledger_url: str, **env: str) -> Iterator[Server]:
    """A job API on a free port, with read-write token RW and read-only token RO."""
    port = _free_port()
    prefix = f"test-hostile-{uuid4().hex}:"
    log_path = tmp / f"broker-{port}.log"
    full_env = {
        **os.environ,
        "BROKER_PORT": str(port),
        "DATABASE_URL": ledger_url,
        "REDIS_URL": REDIS_URL,
        "STREAM_PREFIX": prefix,
        "BROKER_TOKENS": RW,
        "BROKER_READ_ONLY_TOKENS": RO,
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "broker"], cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT
        )
    server = Server(proc, port, ledger_url, log_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the API exited {proc.returncode}:\n{server.log()[-3000:]}"
            assert time.monotonic() < deadline, f"the API did not answer:\n{server.log()[-3000:]}"
            try:
                httpx.get(f"{server.base_url}/health", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        yield server
    finally:
        if proc.poll() is None:
            SEEN.peak_rss_mib = max(SEEN.peak_rss_mib, server.hwm_mib())
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        r = connect(REDIS_URL)
        keys = list(r.scan_iter(match=f"{prefix}*"))
        if keys:
            r.delete(*keys)
        r.close()


@pytest.fixture(scope="module", autouse=True)
def _record() -> Iterator[None]:
    yield
    record_hostile(
        server_errors=SEEN.server_errors,
        api_peak_rss_mib=round(SEEN.peak_rss_mib, 1),
        api_answers=len(SEEN.answers),
        api_outage_503s=SEEN.outage_503s,
        **SEEN.figures,
    )


@pytest.fixture(scope="module")
def sqlite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("hostile-sqlite")
    with broker_server(tmp, f"sqlite:///{tmp}/ledger.db") as server:
        yield server


@pytest.fixture(scope="module")
def pg_server(
    tmp_path_factory: pytest.TempPathFactory, postgres_database: Callable[[], AbstractContextManager[str]]
) -> Iterator[Server]:
    with postgres_database() as url, broker_server(tmp_path_factory.mktemp("hostile-pg"), url) as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest) -> Server:
    """The module's API on each ledger backend."""
    return request.getfixturevalue("sqlite_server" if request.param == "sqlite" else "pg_server")


# -- job specs that cannot poison a job ----------------------------------------------------------

# Raw JSON: Python's json module reads NaN, Infinity and 1e309 (as inf), as FastAPI does.
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e309"]
FLOAT_FIELDS = [
    ("algorithm", "max_grad_norm"),
    ("algorithm", "lr"),
    ("guard", "max_is"),
    ("guard", "min_best_reward"),
    ("adaptive_staleness", "threshold"),
    ("sampling", "temperature"),
]


@pytest.mark.parametrize("literal", NON_FINITE)
@pytest.mark.parametrize(("section", "name"), FLOAT_FIELDS)
def test_non_finite_numbers_are_422_naming_the_field(
    sqlite_server: Server, literal: str, section: str, name: str
) -> None:
    body = json.dumps(SPEC)[:-1] + f', "{section}": {{"{name}": {literal}}}}}'
    resp = sqlite_server.call("POST", "/jobs", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert f"{section}.{name}" in [f["field"] for f in resp.json()["fields"]], resp.text


@pytest.mark.parametrize(
    ("where", "value", "field_name"),
    [
        ("top", {"chat_template_kwargs": {"x": "NaN"}}, "chat_template_kwargs.x"),
        ("top", {"eval_sets": [{"name": "e", "pass_threshold": "Infinity"}]}, "eval_sets.0.pass_threshold"),
        (
            "top",
            {"reward": {"kind": "sum", "terms": [{"name": "a", "weight": "1e309", "reward": "exact_match"}]}},
            "reward.terms.0.weight",
        ),
        ("top", {"reward": {"kind": "python", "function": "m:f", "kwargs": {"scale": "NaN"}}}, "reward.kwargs"),
        ("top", {"task": {"name": "dataset", "path": "d.jsonl", "test_fraction": "NaN"}}, "task.test_fraction"),
    ],
)
def test_non_finite_numbers_anywhere_in_the_spec_are_422(
    sqlite_server: Server, where: str, value: dict, field_name: str
) -> None:
    # The quoted literals become bare JSON tokens (NaN, Infinity, 1e309).
    text = json.dumps({**SPEC, **value})
    for literal in NON_FINITE:
        text = text.replace(f'"{literal}"', literal)
    resp = sqlite_server.call("POST", "/jobs", content=text, headers={"content-type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert any(f["field"].startswith(field_name) for f in resp.json()["fields"]), resp.text


@pytest.mark.parametrize(
    ("value", "field_name"),
    [
        ({"seed": 2**32}, "seed"),
        ({"eval_every": 10**12}, "eval_every"),
        ({"algorithm": {"micro_batch_size": 10**12}}, "algorithm.micro_batch_size"),
        ({"sampling": {"stop_token_ids": [2**40]}}, "sampling.stop_token_ids.0"),
        ({"name": "x" * 201}, "name"),
        ({"model_path": "m" * 5000}, "model_path"),
        ({"sampling": {"stop": ["s" * 2000]}}, "sampling.stop.0"),
        (
            {"reward": {"kind": "http", "url": "http://h/s", "headers": {"X-A": "b\r\nInjected: 1"}}},
            "reward.headers.X-A",
        ),
        ({"task": {"name": "dataset", "path": "data\x1b[2J.jsonl"}}, "task.path"),
    ],
)
def test_unbounded_numbers_long_strings_and_control_characters_are_422(
    sqlite_server: Server, value: dict, field_name: str
) -> None:
    resp = sqlite_server.call("POST", "/jobs", json={**SPEC, **value})
    assert resp.status_code == 422, resp.text
    assert any(f["field"].startswith(field_name) for f in resp.json()["fields"]), resp.text


@pytest.mark.parametrize(
    ("value", "field_name"),
    [
        ({"steps": True}, "steps"),
        ({"steps": "3"}, "steps"),
        ({"group_size": "4"}, "group_size"),
        ({"reward": {"kind": "python", "function": "m:f", "kwargs": {"s": "\ud800"}}}, "reward.kwargs.s"),
        ({"environment": {"name": "tools", "kwargs": {"s": "\udfff"}}}, "environment.kwargs.s"),
        ({"chat_template_kwargs": {"k\ud800": 1}}, "chat_template_kwargs.k\\ud800"),
        ({"task": {"system_prompt": "a\x1b[2Jb"}}, "task.system_prompt"),
    ],
)
def test_loose_types_lone_surrogates_and_control_characters_are_422_and_nothing_is_stored(
    sqlite_server: Server, value: dict, field_name: str
) -> None:
    """Issue 31: a lone surrogate in reward kwargs used to be stored, then POST answered 500 and every
    GET of the job 500 for ever. The body is sent as ASCII JSON (`\\ud800` escapes), as a client
    would."""
    before = sqlite_server.call("GET", "/jobs").json()
    body = json.dumps({**SPEC, **value})
    resp = sqlite_server.call("POST", "/jobs", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert [f["field"] for f in resp.json()["fields"]] == [field_name], resp.text
    assert sqlite_server.call("GET", "/jobs").json() == before  # nothing stored
    job_id = sqlite_server.submit()
    patch = json.dumps({"lr": 1e-4, "k\ud800": 1})
    resp = sqlite_server.call(
        "PATCH", "/jobs/{job_id}", path=f"/jobs/{job_id}", content=patch, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 422, resp.text
    assert sqlite_server.call("GET", "/jobs/{job_id}", path=f"/jobs/{job_id}").status_code == 200


def test_what_is_stored_validates_again(sqlite_server: Server) -> None:
    from shared.jobspec import JobSpec

    job_id = sqlite_server.submit({**SPEC, "chat_template_kwargs": {"enable_thinking": False, "t": 0.5}})
    with Ledger(sqlite_server.ledger_url, migrate=False) as ledger:
        stored = ledger.get_job(job_id)["spec"]
    assert JobSpec.model_validate(stored).model_dump(mode="json") == stored


def _poisoned_spec() -> dict[str, Any]:
    """What the API used to store for `"algorithm": {"lr": NaN}`: the NaN as null."""
    return {**SPEC, "algorithm": {"lr": None}}


def test_a_fleet_service_skips_an_unrunnable_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("REDIS_URL", REDIS_URL)
    monkeypatch.setenv("STREAM_PREFIX", f"t-{uuid4().hex[:8]}:")
    monkeypatch.delenv("JOB_ID", raising=False)
    with Ledger(url) as ledger:
        ledger.create_job("poisoned", "evil\n2026-01-01 00:00:00 INFO FORGED", _poisoned_spec())
        time.sleep(0.01)  # first in, first out by created_at: the poisoned job is the queue's head
        ledger.create_job("good", "good", SPEC)
    fleet = Fleet(TrainerSettings(), "trainer", "t0")
    try:
        with caplog.at_level(logging.ERROR, logger="broker.runtime"):
            assert fleet._next()["id"] == "good"
        bad = fleet.ledger.get_job("poisoned")
        assert bad["state"] == "failed"
        assert "algorithm.lr" in bad["error"] and "does not validate" in bad["error"]
        assert fleet.ledger.get_job("good")["state"] == "running"  # claimed from the queue
    finally:
        fleet.close()
    (record,) = [r for r in caplog.records if "poisoned" in r.getMessage()]
    assert "\n" not in record.getMessage() and "evil\\n2026" in record.getMessage()  # not a forged line


def test_a_service_whose_job_no_longer_validates_fails_it_and_exits_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    with Ledger(url) as ledger:
        ledger.create_job("poisoned", "p", _poisoned_spec(), state="running")
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("REDIS_URL", REDIS_URL)
    monkeypatch.setenv("JOB_ID", "poisoned")
    fleet = Fleet(RewardSettings(), "reward", "r0")
    try:
        with pytest.raises(JobOver, match="algorithm.lr"):
            next(fleet.jobs())
    finally:
        fleet.close()
    # The whole service start, as `python -m reward_svc` runs it: exit 0, so no restart loop.
    monkeypatch.setattr("shared.entry.setup_logging", lambda *a, **k: None)  # keep pytest's log capture
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert run_service("reward", RewardSettings, "reward_svc.service:run") == 0
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    with Ledger(url, migrate=False) as ledger:
        job = ledger.get_job("poisoned")
    assert job["state"] == "failed" and "algorithm.lr" in job["error"]


def test_a_service_restarted_into_an_ended_job_exits_0_without_serving_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer that failed its job exits 1 and its supervisor restarts it: the restart must not
    take over the job's pending entries and replay them into the same error (issue 31)."""
    url = f"sqlite:///{tmp_path}/ledger.db"
    with Ledger(url) as ledger:
        ledger.create_job("ended", "e", SPEC, state="running")
        ledger.move_job("ended", ("running",), "failed", error="trainer: ValueError('temperature must be > 0')")
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("REDIS_URL", REDIS_URL)
    monkeypatch.setenv("JOB_ID", "ended")
    fleet = Fleet(TrainerSettings(), "trainer", "t0")
    try:
        with pytest.raises(JobOver, match=r"job ended is already failed: trainer: ValueError\('temperature"):
            next(fleet.jobs())
    finally:
        fleet.close()


# -- the edge: body size, auth before the body ---------------------------------------------------


def _raw_request(port: int, head: str, body: Iterator[bytes]) -> tuple[int | None, int]:
    """Send `head` then `body` chunk by chunk, stopping once the server answers or closes.

    Returns:
        (the answer's status, or None when the server closed without one reaching us; bytes of
        body sent).
    """
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode())
        try:
            # A server that answers on the headers alone does so before any body is sent.
            select.select([s], [], [], 0.3)
            for chunk in body:
                if select.select([s], [], [], 0)[0]:
                    break  # an answer (or a close) is waiting
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            data = s.recv(4096)
        except ConnectionResetError:
            return None, sent
    if not data.startswith(b"HTTP/1.1 "):
        return None, sent
    return int(data.split()[1]), sent


def _zeros(total: int, chunk: int = 256 * 1024, *, chunked: bool = False) -> Iterator[bytes]:
    piece = b"0" * chunk
    for _ in range(total // chunk):
        yield (f"{chunk:x}\r\n".encode() + piece + b"\r\n") if chunked else piece
    if chunked:
        yield b"0\r\n\r\n"


BIG = 200 * MIB
# Far below the +600 MiB a 200 MB body used to cost: reading stops at the 1 MiB cap, or never starts.
RSS_BOUND_MIB = 20


@pytest.fixture(scope="module")
def probe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own, so that its memory peak is these probes' alone."""
    tmp = tmp_path_factory.mktemp("hostile-probe")
    with broker_server(tmp, f"sqlite:///{tmp}/ledger.db") as server:
        yield server


@pytest.mark.parametrize(
    ("token", "chunked", "expected"),
    [
        (None, False, 401),  # anonymous, Content-Length: 200 MB
        (None, True, 401),  # anonymous, chunked
        (RO, False, 403),  # a read-only token asking to write
        (RW, False, 413),  # authorized, Content-Length over the cap
        (RW, True, 413),  # authorized, chunked past the cap
    ],
)
def test_a_200mb_post_is_refused_before_it_is_read(
    probe_server: Server, token: str | None, chunked: bool, expected: int
) -> None:
    before = probe_server.hwm_mib()
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    length = "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {BIG}\r\n"
    head = f"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}{length}\r\n"
    start = time.perf_counter()
    status, sent = _raw_request(probe_server.port, head, _zeros(BIG, chunked=chunked))
    elapsed = time.perf_counter() - start
    time.sleep(0.2)
    growth = probe_server.hwm_mib() - before
    SEEN.answers.append(("POST", "/jobs", status or 0))
    who = {None: "anon", RO: "ro", RW: "rw"}[token]
    SEEN.figures[f"big_post_{who}_{'chunked' if chunked else 'length'}"] = {
        "status": status,
        "body_mib_sent": round(sent / MIB, 1),
        "rss_growth_mib": round(growth, 1),
        "seconds": round(elapsed, 2),
    }
    assert status == expected, (status, sent)
    assert growth < RSS_BOUND_MIB, f"+{growth:.0f} MiB for a refused body"
    assert sent < 64 * MIB  # the server answered long before 200 MB went through
    assert probe_server.call("GET", "/health", token=None).status_code == 200


def _many_keys(n: int) -> bytes:
    return b'{"model_path": "m", ' + b", ".join(b'"k%d": 0' % i for i in range(n)) + b"}"


def test_1m_unknown_keys_are_refused_at_the_default_cap(probe_server: Server) -> None:
    body = _many_keys(1_000_000)
    before = probe_server.hwm_mib()
    head = (
        f"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {RW}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    status, _ = _raw_request(probe_server.port, head, iter([body[i : i + MIB] for i in range(0, len(body), MIB)]))
    SEEN.answers.append(("POST", "/jobs", status or 0))
    assert status == 413
    assert probe_server.hwm_mib() - before < RSS_BOUND_MIB


@pytest.fixture(scope="module")
def big_cap_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server configured to read 32 MiB bodies: the 1 M keys reach validation."""
    tmp = tmp_path_factory.mktemp("hostile-bigcap")
    with broker_server(tmp, f"sqlite:///{tmp}/ledger.db", BROKER_MAX_BODY_BYTES=str(32 * MIB)) as server:
        yield server


# Parsing 12 MB of JSON into a 1 M-key dict costs what it costs (~200 MiB in CPython); before, the
# 1 M error records on top of it took the process to 1.7 GB.
UNKNOWN_KEYS_RSS_BOUND_MIB = 400


def test_1m_unknown_keys_are_one_small_422(big_cap_server: Server) -> None:
    body = _many_keys(1_000_000)
    before = big_cap_server.hwm_mib()
    start = time.perf_counter()
    resp = big_cap_server.call("POST", "/jobs", content=body, headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - start
    growth = big_cap_server.hwm_mib() - before
    SEEN.figures["unknown_keys_1m"] = {
        "status": resp.status_code,
        "response_bytes": len(resp.content),
        "rss_growth_mib": round(growth, 1),
        "seconds": round(elapsed, 2),
    }
    assert resp.status_code == 422
    assert len(resp.content) < 4096, len(resp.content)
    assert "1000000 unknown fields" in resp.json()["error"]
    assert growth < UNKNOWN_KEYS_RSS_BOUND_MIB, f"+{growth:.0f} MiB"


def test_a_422_lists_at_most_20_fields(sqlite_server: Server) -> None:
    # 19 unknown keys (under the one-error threshold) and many invalid values: each reported,
    # the list cut at 20 and the rest counted.
    spec = {
        **SPEC,
        **{f"unknown_{i}": 1 for i in range(19)},
        "algorithm": {"lr": -1, "rho": -1, "clip_low": -1, "clip_high": -1, "kl_coef": -1, "weight_decay": -1},
        "sampling": {"temperature": -1, "top_p": -1, "max_tokens": -1},
    }
    resp = sqlite_server.call("POST", "/jobs", json=spec)
    assert resp.status_code == 422
    body = resp.json()
    assert len(body["fields"]) == 20 and body["more_errors"] == 19 + 6 + 3 - 20, body
    assert len(resp.content) < 16 * 1024


def test_long_field_names_and_messages_are_cut(sqlite_server: Server) -> None:
    resp = sqlite_server.call("POST", "/jobs", json={**SPEC, "k" * 100_000: 1, "reward": "x" * 3000})
    assert resp.status_code == 422
    assert len(resp.content) < 4096, len(resp.content)


# -- NUL bytes on every route, both ledgers -------------------------------------------------------

OFF_SCHEMA_ROUTES = [("GET", "/status/data/{job_id}"), ("GET", "/status/static/{name}")]


def _routes(server: Server) -> list[tuple[str, str]]:
    paths = server.call("GET", "/openapi.json", token=None).json()["paths"]
    return [(m.upper(), p) for p, ops in paths.items() for m in ops] + OFF_SCHEMA_ROUTES


def _fill(template: str, value: str) -> str:
    import re

    return re.sub(r"\{[^}]+\}", value, template)


def test_nul_in_path_or_query_is_4xx_on_every_route(server: Server) -> None:
    routes = _routes(server)
    assert len(routes) >= 18
    job_id = server.submit()
    answers = {}
    for method, template in routes:
        probes = []
        if "{" in template:
            probes += [_fill(template, "a%00b"), _fill(template, "%00")]
            probes.append(
                template.replace("{job_id}", job_id)
                .replace("{step}", "0")
                .replace("{task_id}", "t")
                .replace("{name}", "n")
                + "?x=%00"
            )
        else:
            probes += [template + "?limit=%00", template + "?token=%00&x=1"]
        for path in probes:
            for token in (RW, RO):
                resp = server.call(method, template, path=path, token=token)
                answers[(method, path, token)] = resp.status_code
                assert 400 <= resp.status_code < 500, (method, path, resp.status_code, resp.text)
    assert set(answers.values()) == {400}, answers  # the edge refuses them before auth or routing


NUL_BODIES: list[tuple[str, str, Any]] = [
    ("POST", "/jobs", {**SPEC, "name": "a\x00b"}),
    ("POST", "/jobs", {**SPEC, "model_path": "\x00"}),
    ("POST", "/jobs", {**SPEC, "\x00": 1}),
    ("POST", "/jobs", {**SPEC, "task": {"name": "dataset", "path": "d\x00.jsonl"}}),
    ("POST", "/jobs", {**SPEC, "sampling": {"stop": ["\x00"]}}),
    ("POST", "/jobs", {**SPEC, "reward": {"kind": "python", "function": "m:f", "kwargs": {"s": "\x00"}}}),
    ("POST", "/jobs", {**SPEC, "chat_template_kwargs": {"\x00": "x"}}),
    ("PATCH", "/jobs/{job_id}", {"lr": "\x00"}),
    ("PATCH", "/jobs/{job_id}", {"\x00": 1}),
    ("POST", "/jobs/{job_id}/checkpoints/{step}/export", {"name": "a\x00b"}),
]
# Routes that take no body ignore one, NUL or not.
IGNORED_BODIES = [
    ("POST", "/jobs/{job_id}/checkpoints/{step}/evaluate", {"\x00": "\x00"}),
    ("POST", "/jobs/{job_id}/stop", {"\x00": "\x00"}),
]


@pytest.mark.parametrize(("method", "template", "body"), NUL_BODIES + IGNORED_BODIES)
def test_nul_in_body_strings_is_4xx(server: Server, method: str, template: str, body: Any) -> None:
    job_id = server.submit()
    path = template.replace("{job_id}", job_id).replace("{step}", "0")
    resp = server.call(method, template, path=path, json=body)
    if (method, template, body) in IGNORED_BODIES:
        assert resp.status_code in (202, 404), (resp.status_code, resp.text)  # 404: no checkpoint at step 0
    else:
        assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    assert server.call("GET", "/jobs/{job_id}", path=f"/jobs/{job_id}").status_code == 200


# -- outages: fast /health, request threads free --------------------------------------------------


@pytest.fixture(scope="module")
def dead_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("hostile-dead-redis")
    with broker_server(tmp, f"sqlite:///{tmp}/ledger.db", REDIS_URL=f"redis://127.0.0.1:{_free_port()}/0") as server:
        server.outage = True
        yield server


def _timed(call: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    start = time.perf_counter()
    resp = call()
    return resp, time.perf_counter() - start


def test_health_is_a_fast_503_when_redis_is_down(dead_redis_server: Server) -> None:
    resp, seconds = _timed(lambda: dead_redis_server.call("GET", "/health", token=None))
    # A dead Redis is a refused connection: the request-path client answers at once, where a
    # service-style client would retry for REDIS_OUTAGE_S (minutes). The bound leaves room for a
    # loaded CI box; the figure is recorded in results/hostile.json.
    assert resp.status_code == 503 and seconds < 3.0, (resp.status_code, seconds)
    body = resp.json()
    assert body["ok"] is False and body["redis"] is False and "redis" in body["error"]
    assert body["ledger_revision"] == HEAD
    SEEN.figures["health_redis_down_s"] = round(seconds, 3)


def test_requests_stay_fast_while_redis_is_down(dead_redis_server: Server) -> None:
    job_id = dead_redis_server.submit()  # the ledger alone: fine
    with Ledger(dead_redis_server.ledger_url, migrate=False) as ledger:
        ledger.set_job_state(job_id, "running")  # a trainer took it: pause is a Redis command now
    stop = threading.Event()
    statuses: list[int] = []

    def hammer(method: str, template: str, path: str) -> None:
        while not stop.is_set():
            statuses.append(dead_redis_server.call(method, template, path=path).status_code)
            stop.wait(0.5)

    # More clients than the server has request threads (40): before, each held one for the
    # whole Redis retry budget and a ledger-only GET /jobs waited behind them.
    targets = [
        ("GET", "/health", "/health"),
        ("GET", "/jobs/{job_id}", f"/jobs/{job_id}"),
        ("POST", "/jobs/{job_id}/pause", f"/jobs/{job_id}/pause"),
    ]
    threads = [threading.Thread(target=hammer, args=targets[i % 3], daemon=True) for i in range(48)]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)
        latencies = []
        for _ in range(10):
            resp, seconds = _timed(lambda: dead_redis_server.call("GET", "/jobs"))
            assert resp.status_code == 200
            latencies.append(seconds)
        health, health_s = _timed(lambda: dead_redis_server.call("GET", "/health", token=None))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    SEEN.figures["list_jobs_redis_down_s"] = {
        "max": round(max(latencies), 3),
        "median": round(sorted(latencies)[len(latencies) // 2], 3),
    }
    # Held behind the Redis retry budget, a ledger-only request would wait for minutes; the bounds
    # only tell that from "answered" on a loaded 2-core box (the figures go to results/hostile.json).
    assert max(latencies) < 10.0 and sorted(latencies)[len(latencies) // 2] < 2.0, latencies
    assert health.status_code == 503 and health_s < 3.0
    assert set(statuses) <= {503}, set(statuses)  # Redis-backed routes: 503, quickly, never 500


def test_health_is_a_fast_503_when_the_ledger_is_down(
    tmp_path: Path, postgres_database: Callable[[], AbstractContextManager[str]]
) -> None:
    with postgres_database() as url, broker_server(tmp_path, url) as server:
        assert server.call("GET", "/health", token=None).status_code == 200
        admin = make_url(url).set(drivername="postgresql", database="test").render_as_string(hide_password=False)
        server.outage = True
        with psycopg.connect(admin, autocommit=True) as conn:  # the database goes away under the API
            conn.execute(f'DROP DATABASE "{make_url(url).database}" WITH (FORCE)')
        resp, seconds = _timed(lambda: server.call("GET", "/health", token=None))
        assert resp.status_code == 503 and seconds < 3.0, (resp.status_code, seconds, resp.text)
        assert resp.json()["ok"] is False and "ledger" in resp.json()["error"]
        jobs = server.call("GET", "/jobs")
        assert jobs.status_code == 503, jobs.text
        metrics = server.call("GET", "/metrics", token=None)
        assert metrics.status_code == 200 and "asyncrl_ledger_up 0.0" in metrics.text
        SEEN.figures["health_ledger_down_s"] = round(seconds, 3)


# -- logs: no tokens, no forged lines -------------------------------------------------------------


def test_the_status_page_token_stays_out_of_the_access_log(sqlite_server: Server) -> None:
    secret = f"tok-{uuid4().hex}"
    assert sqlite_server.call("GET", "/status", path=f"/status?job=x&token={secret}", token=None).status_code == 200
    assert sqlite_server.call("GET", "/status", path=f"/status?token={secret}", token=None).status_code == 200
    # the key percent-encoded (issue 31): the app reads `token` all the same, and so does the filter
    assert sqlite_server.call("GET", "/status", path=f"/status?tok%65n={secret}", token=None).status_code == 200
    time.sleep(0.2)
    log = sqlite_server.log()
    assert secret not in log
    assert "GET /status?job=x&token=*** HTTP/1.1" in log
    assert "GET /status?tok%65n=*** HTTP/1.1" in log


def test_a_job_name_with_a_newline_forges_no_log_line(sqlite_server: Server) -> None:
    forged = "2026-01-01 00:00:00,000 INFO service=broker FORGED-LINE admin logged in"
    resp = sqlite_server.call("POST", "/jobs", json={**SPEC, "name": f"x\n{forged}"})
    assert resp.status_code == 422 and resp.json()["fields"][0]["field"] == "name"
    resp = sqlite_server.call("POST", "/jobs", json={**SPEC, "name": "x\x1b[2Jcleared\u2028" + forged})
    assert resp.status_code == 422
    resp = sqlite_server.call("GET", "/jobs/{job_id}", path="/jobs/x%0A" + forged.replace(" ", "%20"))
    assert resp.status_code == 400
    sqlite_server.submit({**SPEC, "name": "fine name"})  # a job name reaches the log (the submit line)
    time.sleep(0.2)
    lines = sqlite_server.log().splitlines()
    assert not [line for line in lines if line.startswith(forged[:10])], lines[-5:]
    assert "\u2028" not in sqlite_server.log()
    assert any("(fine name) submitted by rw token" in line for line in lines)
    assert "\x1b" not in sqlite_server.log()


# -- /metrics: bounded, fast; metrics ports on loopback -------------------------------------------


def test_metrics_job_gauges_are_bounded_and_fast(sqlite_server: Server) -> None:
    with Ledger(sqlite_server.ledger_url, migrate=False) as ledger:
        for i in range(1000):
            ledger.create_job(f"m{i:04d}", "m", SPEC, state="running")
    sqlite_server.call("GET", "/metrics", token=None)  # warm
    resp, seconds = _timed(lambda: sqlite_server.call("GET", "/metrics", token=None))
    ids = {line.split('job_id="')[1].split('"')[0] for line in resp.text.splitlines() if 'job_id="' in line}
    SEEN.figures["metrics_scrape_1000_running_jobs"] = {"seconds": round(seconds, 3), "job_ids": len(ids)}
    assert resp.status_code == 200
    assert len(ids) <= 50, len(ids)
    # The cap keeps the scrape one bounded query whatever the number of jobs; the bound catches a
    # scrape that grows with them, with room for a loaded box (the figure is recorded).
    assert seconds < 2.0, seconds


def _listening_address(port: int) -> str:
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
            return c.laddr.ip
    raise AssertionError(f"nothing listens on {port}")


def test_metrics_ports_listen_on_loopback_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    assert serve_metrics(port, "reward") is not None
    assert _listening_address(port) == "127.0.0.1"
    monkeypatch.setenv("METRICS_HOST", "0.0.0.0")
    port = _free_port()
    serve_metrics(port, "reward")
    assert _listening_address(port) == "0.0.0.0"


# -- every answer is documented --------------------------------------------------------------------


def test_every_status_seen_is_documented(sqlite_server: Server) -> None:
    """Each (route, status) this module saw is in the OpenAPI document (the schemathesis test
    checks the same for generated requests)."""
    paths = sqlite_server.call("GET", "/openapi.json", token=None).json()["paths"]
    off_schema = {t for _, t in OFF_SCHEMA_ROUTES} | {"/openapi.json"}
    undocumented = sorted(
        {
            (m, t, s)
            for m, t, s in SEEN.answers
            if t not in off_schema and s and str(s) not in paths[t][m.lower()]["responses"]
        }
    )
    assert not undocumented, undocumented
    assert SEEN.server_errors == 0, [a for a in SEEN.answers if a[2] >= 500 and a[2] != 503]
