"""The `asyncrl` job commands against a real job API server (uvicorn on a free port)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from asyncrl.cli import TERMINAL_STATES, app
from broker import api as broker_api
from broker.api import create_app
from broker.fleet import Beacon
from broker.ledger import Ledger
from broker.streams import connect
from shared.drop_skew import step_metrics
from shared.settings import AdminSettings, BrokerSettings

REDIS_URL = "redis://127.0.0.1:6379/0"
SPEC = {"name": "tiny", "model_path": "models/tiny", "group_size": 4, "steps": 3, "max_staleness": 1}
RW = "rw-secret-token"


class Api:
    def __init__(self, url: str, ledger: Ledger, runner: CliRunner, prefix: str) -> None:
        self.url, self.ledger, self.runner, self.prefix = url, ledger, runner, prefix

    def cli(self, *args: str, **env: str) -> Any:
        # Wide columns so that rich tables keep ids on one line.
        env = {"ASYNCRL_API": self.url, "ASYNCRL_TOKEN": RW, "COLUMNS": "200", **env}
        return self.runner.invoke(app, list(args), env=env)

    def get(self, path: str) -> Any:
        r = httpx.get(self.url + path, headers={"Authorization": f"Bearer {RW}"}, timeout=10)
        r.raise_for_status()
        return r.json()

    def submit(self, tmp_path: Path, **spec: Any) -> str:
        spec_file = tmp_path / f"spec-{uuid4().hex[:6]}.json"
        spec_file.write_text(json.dumps({**SPEC, **spec}))
        result = self.cli("submit", str(spec_file), "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["id"]


@pytest.fixture
def api(tmp_path) -> Iterator[Api]:
    prefix = f"test-{uuid4().hex}:"
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    settings = BrokerSettings(redis_url=REDIS_URL, stream_prefix=prefix, tokens=RW)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings, ledger=ledger, admin=AdminSettings(redis_url=REDIS_URL, key_prefix=prefix)),
            log_level="warning",
            lifespan="off",
        )
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; the server serves this socket
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the API server did not start"
        time.sleep(0.02)
    try:
        yield Api(f"http://127.0.0.1:{port}", ledger, CliRunner(), prefix)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        ledger.close()
        r = connect(REDIS_URL)
        keys = list(r.scan_iter(match=f"{prefix}*"))
        if keys:
            r.delete(*keys)


def test_terminal_states_match_the_api():
    assert TERMINAL_STATES == broker_api.TERMINAL_STATES


def test_submit_prints_the_id_state_and_place_in_the_queue(api, tmp_path):
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(SPEC))
    first = api.cli("submit", str(spec_file))
    second = api.cli("submit", str(spec_file))
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    ids = [job["id"] for job in api.get("/jobs")][::-1]  # newest first
    page = f"{api.url}/status?job="
    assert first.stdout == f"job {ids[0]} queued, position 1 in the queue; status page {page}{ids[0]}\n"
    assert second.stdout == f"job {ids[1]} queued, position 2 in the queue; status page {page}{ids[1]}\n"
    # --json: the API's whole answer, the stored spec with every default filled in
    scripted = api.cli("submit", str(spec_file), "--json")
    body = json.loads(scripted.stdout)
    assert body["state"] == "queued" and body["position"] == 3 and body["spec"]["algorithm"]["lr"] > 0


def test_submit_list_and_control_a_job(api, tmp_path):
    job, behind = api.submit(tmp_path), api.submit(tmp_path)
    result = api.cli("list")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if job in line)
    assert "tiny" in row and "queued" in row and "#1" in row
    assert "#2" in next(line for line in result.stdout.splitlines() if behind in line)

    result = api.cli("pause", job)  # queued: nothing to pause
    assert result.exit_code == 1 and "is queued, not running" in result.stderr, result.output
    assert api.ledger.claim_next()["id"] == job  # as the fleet's trainer takes the head of the queue
    for command, state in (("pause", "paused"), ("resume", "running")):
        result = api.cli(command, job)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout) == {"id": job, "state": state}
    result = api.cli("set", job, "--lr", "1e-5", "--generation-batch", "3", "--top-k", "20")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"id": job, "changed": {"lr": 1e-5, "top_k": 20, "generation_batch": 3}}
    assert api.get(f"/jobs/{job}")["spec"]["algorithm"]["lr"] == 1e-5
    assert api.get(f"/jobs/{job}")["spec"]["sampling"]["top_k"] == 20

    changes = [c["changes"] for c in api.get(f"/jobs/{job}/changes")]
    assert changes == [
        {"command": "pause"},
        {"command": "resume"},
        {"command": "set", "settings": {"lr": 1e-5, "top_k": 20, "generation_batch": 3}},
    ]
    # a queued job cancelled never starts: it leaves the queue at once
    result = api.cli("cancel", behind)
    assert result.exit_code == 0 and json.loads(result.stdout)["state"] == "cancelled", result.output
    assert api.get("/queue")["queued"] == [] and api.ledger.claim_next() is None
    result = api.cli("cancel", job)
    assert result.exit_code == 0 and json.loads(result.stdout)["state"] == "cancelled", result.output
    result = api.cli("status", job)
    assert result.exit_code == 0 and json.loads(result.stdout)["state"] == "cancelled", result.output


def test_status_without_a_job_shows_the_queue_and_the_fleet(api, tmp_path):
    result = api.cli("status")
    assert result.exit_code == 0, result.output
    assert "running: no job" in result.stdout and "queued: no job" in result.stdout
    assert "fleet: no service is up" in result.stdout
    running, first, second = api.submit(tmp_path), api.submit(tmp_path), api.submit(tmp_path)
    api.ledger.claim_next()
    beacon = Beacon(connect(REDIS_URL), api.prefix, "trainer", "box-trainer")  # as a trainer of the fleet says so
    try:
        beacon.set("serving", running)
        for command in (("status",), ("queue",)):
            result = api.cli(*command)
            assert result.exit_code == 0, result.output
            out = result.stdout.splitlines()
            assert "running" in out[0]
            assert all(cell in next(ln for ln in out if running in ln and "tiny" in ln) for cell in ("running", "0/3"))
            assert f"job {running} to end" in next(ln for ln in out if first in ln)
            assert "1 job(s) ahead of it" in next(ln for ln in out if second in ln)
            # the running job names its trainer; the fleet table says what the trainer serves
            assert "trainer box-trainer" in next(ln for ln in out if running in ln and "tiny" in ln)
            fleet = out[next(i for i, ln in enumerate(out) if ln.strip() == "fleet") :]
            trainer = next(ln for ln in fleet if "box-trainer" in ln)
            assert all(cell in trainer for cell in ("trainer", "serving", running))
    finally:
        beacon.close()
    assert api.cli("status", "--watch").exit_code == 1


def test_status_and_list_show_shares_who_serves_which_job_and_usage(api, tmp_path):
    """Two running jobs served by one generator: `status` (no job) and `list` show each job's share
    and its services, the fleet table each service's jobs and load; `status JOB` its usage line."""
    a, b = api.submit(tmp_path), api.submit(tmp_path, share=2.5)
    api.ledger.claim_next(), api.ledger.claim_next()
    redis = connect(REDIS_URL)
    now = time.time()
    entry = {"host": "box", "pid": 1, "state": "serving", "since": now, "jobs_served": 0, "ts": now}
    load = {a: {"share": 1.0, "seconds": 1.5, "tokens": 300}, b: {"share": 2.5, "seconds": 0.75, "tokens": 40}}
    for m in (
        {"role": "generator", "id": "gen-x", "job": a, "jobs": [a, b], "load": load},
        {"role": "reward", "id": "rew-y", "job": b, "jobs": [b]},
    ):
        redis.hset(f"{api.prefix}fleet", f"{m['role']}:{m['id']}", json.dumps({**entry, **m}))
    result = api.cli("status")
    assert result.exit_code == 0, result.output
    out = result.stdout.splitlines()
    row_b = next(ln for ln in out if b in ln and "tiny" in ln)
    assert "generator gen-x; reward rew-y" in row_b and " 2.5 " in row_b
    row_a = next(ln for ln in out if a in ln and "tiny" in ln)
    assert "generator gen-x " in row_a and " 1 " in row_a and "rew-y" not in row_a
    gen = next(ln for ln in out if "gen-x" in ln and "box" in ln)
    assert f"{a} (share 1, 1.5 s, 300 tok), {b} (share 2.5, 0.8 s, 40 tok)" in gen
    assert b in next(ln for ln in out if "rew-y" in ln and "box" in ln)
    result = api.cli("list")
    assert result.exit_code == 0, result.output
    listed = next(ln for ln in result.stdout.splitlines() if b in ln)
    assert "generator gen-x; reward rew-y" in listed and " 2.5 " in listed

    api.ledger.record_generated(
        [
            {
                "msg_id": f"{a}/g0/{i}",
                "job_id": a,
                "group_id": f"{a}/g0",
                "sample_index": i,
                "prompt_index": 0,
                "generator_id": "gen-x",
                "gen_version_min": 0,
                "num_prompt_tokens": 2,
                "num_completion_tokens": 3,
                "completion": "x",
                "gen_seconds": 0.25,
            }
            for i in range(4)
        ]
    )
    result = api.cli("status", a)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["usage"]["generator_seconds"] == 1.0
    # 4 x 0.25 s; 4 x 2 prompt, 4 x 3 completion tokens
    assert "usage: 1.0 generator-seconds, 4 samples, 8 prompt + 12 completion tokens on 1 generator(s)" in result.stderr
    assert "usage" not in api.cli("status", b).stderr  # nothing generated yet


def test_samples_prints_a_table_of_the_filtered_page(api, tmp_path):
    job = api.submit(tmp_path)
    base = {
        "job_id": job,
        "sample_index": 0,
        "prompt_index": 1,
        "generator_id": "gen-0",
        "gen_version_min": 0,
        "num_prompt_tokens": 5,
        "num_completion_tokens": 9,
    }
    api.ledger.record_generated(
        [
            {**base, "msg_id": f"msg-{i}", "group_id": f"g{i}", "completion": f"[bold]answer {i}[/bold]\nok"}
            for i in range(5)
        ]
    )
    api.ledger.record_scored([(f"msg-{i}", i / 4) for i in range(5)])
    api.ledger.record_used([{"msg_id": f"msg-{i}", "status": "trained", "trainer_version": 2} for i in range(4)])

    result = api.cli("samples", job, "--status", "trained", "--min-reward", "0.25", "--limit", "2")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "msg-1" in out and "msg-2" in out and "msg-3" not in out and "msg-0" not in out
    assert "samples 1-2 of 3" in out
    assert "[bold]answer 1[/bold]\\nok" in out  # completions are shown literally, on one line
    row = next(line for line in out.splitlines() if "msg-2" in line)
    assert all(cell in row for cell in ("train", "trained", "0.500"))

    result = api.cli("samples", job, "--status", "trained", "--limit", "2", "--offset", "2")
    assert result.exit_code == 0, result.output
    assert "msg-2" in result.stdout and "msg-3" in result.stdout and "samples 3-4 of 4" in result.stdout


def test_status_watch_returns_when_the_job_ends(api, tmp_path):
    job = api.submit(tmp_path)
    api.ledger.set_job_state(job, "running")
    api.ledger.record_train_step(job, 3, 3, {"reward/mean": 0.625, "off_policy/mean": 0.5})
    api.ledger.set_job_step(job, 3)
    api.ledger.record_eval(job, 3, 3, 3, 0.75, 8)
    finisher = threading.Timer(1.0, api.ledger.set_job_state, args=(job, "finished"))
    start = time.monotonic()
    finisher.start()
    try:
        result = api.cli("status", job, "--watch", "--interval", "0.2")
    finally:
        finisher.cancel()
    elapsed = time.monotonic() - start
    assert result.exit_code == 0, result.output
    assert 1.0 <= elapsed < 10, elapsed
    out = result.stdout
    assert f"job {job} finished at step 3" in out
    assert "3/3" in out and "reward 0.625" in out and "held-out 0.750" in out and "staleness 0.50" in out

    # Already ended: the first poll returns.
    start = time.monotonic()
    result = api.cli("status", job, "--watch")
    assert result.exit_code == 0 and time.monotonic() - start < 5, result.output

    failed = api.submit(tmp_path)
    api.ledger.set_job_state(failed, "failed", error="trainer: CUDA out of memory")
    result = api.cli("status", failed, "--watch")
    assert result.exit_code == 1 and "CUDA out of memory" in result.stderr, result.output


def test_status_shows_the_collapse_guards_trips(api, tmp_path):
    job = api.submit(tmp_path)
    result = api.cli("status", job)
    assert result.exit_code == 0 and "collapse guard" not in result.stderr, result.output
    api.ledger.record_change(
        job,
        "trainer collapse guard",
        {  # as trainer_svc/train.py records one
            "reason": "reward collapse: mean of the last 5 steps 0.010 < 0.5 x best 0.300",
            "kind": "reward_collapse",
            "step": 143,
            "action": "initial",
            "note": "no checkpoint to go back to: restarted from the initial model",
            "rolled_back_to_step": 0,
            "discarded_steps": list(range(1, 143)),
            "lr": 5e-5,
            "max_staleness": 1,
        },
    )
    api.ledger.record_change(job, "api", {"lr": 1e-4})  # not the guard's
    result = api.cli("status", job)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["id"] == job  # stdout stays the job's JSON
    assert "collapse guard tripped 1 time(s)" in result.stderr
    assert (
        "step 143: reward collapse: mean of the last 5 steps 0.010 < 0.5 x best 0.300 -> no checkpoint to go "
        "back to: restarted from the initial model; steps 1-142 discarded; lr now 5e-05"
    ) in result.stderr
    api.ledger.set_job_state(job, "finished")
    result = api.cli("status", job, "--watch")
    assert result.exit_code == 0 and "restarted from the initial model" in result.stderr, result.output


def test_api_errors_print_the_message_and_exit_1(api, tmp_path):
    for args in (
        ("status", "nope"),
        ("status", "nope", "--watch"),
        ("pause", "nope"),
        ("samples", "nope"),
        ("set", "nope", "--lr", "1e-5"),
        ("stop", "nope"),
    ):
        result = api.cli(*args)
        assert result.exit_code == 1, (args, result.output)
        assert "error: no job 'nope'; GET /jobs lists the known ones" in result.stderr, (args, result.output)
        assert result.stdout == ""

    job = api.submit(tmp_path)
    result = api.cli("resume", job)
    assert result.exit_code == 1 and "not paused; nothing to resume" in result.stderr
    result = api.cli("samples", job, "--limit", "0")
    assert result.exit_code == 1 and "limit" in result.stderr
    result = api.cli("set", job, "--top-p", "2")
    assert result.exit_code == 1 and "top_p" in result.stderr
    result = api.cli("set", job)
    assert result.exit_code == 1 and "--lr" in result.stderr
    result = api.cli("pause", job, ASYNCRL_TOKEN="wrong")
    assert result.exit_code == 1 and "invalid bearer token" in result.stderr

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**SPEC, "group_size": "many"}))
    result = api.cli("submit", str(bad))
    assert result.exit_code == 1 and "group_size" in result.stderr
    bad.write_text("{not json")
    result = api.cli("submit", str(bad))
    assert result.exit_code == 1 and "cannot read the job spec" in result.stderr

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    result = api.cli("list", "--api", closed)
    assert result.exit_code == 1 and "cannot reach the job API" in result.stderr
    # run: a fleet named (--api or ASYNCRL_API) that does not answer is an error, not a cue to start one
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    for args, env in ((("--api", closed), {}), ((), {"ASYNCRL_API": closed})):
        result = api.cli("run", str(spec), *args, **env)
        assert result.exit_code == 1 and f"no job API answers at {closed}" in result.stderr, result.output
        assert "starting one" not in result.stdout
    result = api.cli("run", str(bad))
    assert result.exit_code == 1 and "cannot read the job spec" in result.stderr


def test_eval_and_export_pick_the_newest_checkpoint_and_report_the_task(api, tmp_path):
    job = api.submit(tmp_path)
    result = api.cli("eval", job)
    assert result.exit_code == 1 and "has no checkpoint yet" in result.stderr
    for step in (2, 4):
        api.ledger.record_checkpoint(job, step, step, str(tmp_path / f"step-{step}"))
    # The API enqueues on the admin queue (no worker here: the tasks stay queued).
    result = api.cli("eval", job)
    assert result.exit_code == 0, result.output
    task = json.loads(result.stdout)
    assert task["kind"] == "evaluate" and task["params"]["step"] == 4 and task["state"] == "queued"
    result = api.cli("export", job, "--step", "2", "--name", "release/a")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["params"] == {"job_id": job, "step": 2, "name": "release/a"}
    result = api.cli("export", job, "--name", "../x")
    assert result.exit_code == 1 and "relative folder name" in result.stderr
    result = api.cli("task", task["id"])
    assert result.exit_code == 0 and json.loads(result.stdout)["id"] == task["id"], result.output
    api.ledger.finish_admin_task(task["id"], error="RuntimeError: no engine")
    result = api.cli("task", task["id"], "--wait")
    assert result.exit_code == 1 and "failed: RuntimeError: no engine" in result.stderr
    result = api.cli("task", "nope")
    assert result.exit_code == 1 and "no admin task" in result.stderr


def test_verify_reports_the_ledger_invariants_and_fails_on_a_violation(api, tmp_path):
    job = api.submit(tmp_path)
    result = api.cli("verify", job)
    assert result.exit_code == 0, result.output
    assert "staleness" in result.stdout and "trained_once" in result.stdout
    base = {
        "job_id": job,
        "sample_index": 0,
        "prompt_index": 1,
        "generator_id": "gen-0",
        "group_id": "g",
        "gen_version_min": 3,
        "num_prompt_tokens": 5,
        "num_completion_tokens": 9,
        "completion": "x",
    }
    api.ledger.record_generated([{**base, "msg_id": "m-0"}])
    api.ledger.record_scored([("m-0", 1.0)])
    # trained at version 4 from generation version 3 but recorded as 0 versions stale
    api.ledger.record_used([{"msg_id": "m-0", "status": "trained", "trainer_version": 4, "staleness": 0}])
    result = api.cli("verify", job)
    assert result.exit_code == 1, result.output
    assert "violation: staleness" in result.stdout
    body = api.get(f"/jobs/{job}/verify")
    assert body["ok"] is False and body["checks"]["staleness"] == 1 and body["counts"] == {"trained": 1}
    assert api.cli("verify", "nope").exit_code == 1


def test_phases_reads_the_services_metrics_pages():
    """`asyncrl phases URL...` prints each role's phases from its live /metrics page."""
    from shared.metrics import GeneratorMetrics, TrainerMetrics, serve_metrics

    ports = []
    for role, cls in (("generator", GeneratorMetrics), ("trainer", TrainerMetrics)):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        m = cls(serve_metrics(port, role), "j1")
        m.phases.observe("ledger", 0.004)
        m.phases.observe("ledger", 0.004)
        ports.append(port)
    urls = [f"http://127.0.0.1:{p}/metrics" for p in ports]
    runner = CliRunner()
    out = runner.invoke(app, ["phases", *urls, "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [(r["role"], r["phase"], r["count"]) for r in rows] == [("generator", "ledger", 2), ("trainer", "ledger", 2)]
    table = runner.invoke(app, ["phases", *urls])
    assert table.exit_code == 0 and "trainer" in table.output and "ledger" in table.output
    bad = runner.invoke(app, ["phases", "http://127.0.0.1:1/metrics"])
    assert bad.exit_code == 1 and "127.0.0.1:1" in bad.output


def test_status_shows_the_reward_error_fraction(api, tmp_path):
    """A job with four scored samples, one reward an error: `asyncrl status JOB` says 25 % on stderr
    (stdout stays the JSON, `reward_errors` in it), the queue view's running table too."""
    job = api.submit(tmp_path)
    result = api.cli("status", job)
    assert result.exit_code == 0 and "reward errors" not in result.stderr, result.output  # nothing scored
    ids = [f"{job}/g0/{i}" for i in range(4)]
    api.ledger.record_generated(
        [
            {
                "msg_id": m,
                "job_id": job,
                "group_id": f"{job}/g0",
                "sample_index": i,
                "prompt_index": 0,
                "generator_id": "gen-0",
                "gen_version_min": 0,
                "num_prompt_tokens": 2,
                "num_completion_tokens": 3,
                "completion": "x",
            }
            for i, m in enumerate(ids)
        ]
    )
    api.ledger.record_scored_ids([(m, 1.0, "ok", None) for m in ids[:3]] + [(ids[3], 0.0, "error", None)])
    api.ledger.set_job_state(job, "running")
    result = api.cli("status", job)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["reward_errors"] == {"by_status": {"error": 1, "ok": 3}, "fraction": 0.25}
    assert "reward errors: 25.0% of 4 scored samples (error 1, ok 3)" in result.stderr
    result = api.cli("status")
    assert result.exit_code == 0 and "reward errors" in result.stdout and "25.0%" in result.stdout, result.output


def test_status_shows_what_dropping_skewed(api, tmp_path):
    """A step that dropped 70 over-long samples (20 tokens) and trained 10 (10 tokens): `asyncrl
    status JOB` says so on stderr with the warning (default drop_skew: shift 1.0 > 0.2, 70 >= 64
    dropped), the queue view's running table names the quantity; a job that dropped nothing prints
    no drop skew."""
    job = api.submit(tmp_path)
    api.ledger.set_job_state(job, "running")
    api.ledger.record_train_step(job, 1, 1, step_metrics([(10, 1.0)] * 10, {}))
    result = api.cli("status", job)
    assert result.exit_code == 0 and "drop skew" not in result.stderr, result.output
    api.ledger.record_train_step(job, 2, 2, step_metrics([(10, 1.0)] * 10, {"overlong": [(20, 1.0)] * 70}))
    result = api.cli("status", job)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["drop_skew"]["dropped"]["count"] == 70
    assert "drop skew: 70 dropped (overlong 70) against 20 trained; shift length +1.00, reward +0.00" in result.stderr
    assert "warning: dropping biases completion length: the 70 dropped samples average 20 tokens" in result.stderr
    result = api.cli("status")
    assert result.exit_code == 0 and "completion length" in result.stdout, result.output
