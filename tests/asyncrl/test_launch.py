"""The one-box launcher: the process plan, supervision, and a clean stop (SIGTERM, grace, SIGKILL).

Fast cases run trivial modules written into the test's folder; the CLI cases run the real
`python -m asyncrl.launch` with the real broker and reward service against the real Redis (a fresh
key prefix) and a SQLite ledger: no model, no vLLM.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from asyncrl.launch import JobEnd, JobState, RestartPolicy, Supervisor, main, plan, supervise

ROOT = Path(__file__).resolve().parents[2]

# Exits 0 on SIGTERM, like a service; leaves a grandchild in its process group and writes its pid.
POLITE = """
import signal, subprocess, sys, time
child = subprocess.Popen(["sleep", "300"])
open(sys.argv[1], "w").write(str(child.pid))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.1)
"""
# Ignores SIGTERM: only SIGKILL stops it.
STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def modules(tmp_path, monkeypatch) -> Path:
    (tmp_path / "polite_mod.py").write_text(POLITE)
    (tmp_path / "stubborn_mod.py").write_text(STUBBORN)
    (tmp_path / "ok_mod.py").write_text("print('done')\n")
    (tmp_path / "bad_mod.py").write_text("raise SystemExit('boom')\n")
    # fails the first two times it runs (a counter file next to it), then exits 0
    (tmp_path / "flaky_mod.py").write_text(
        "import pathlib, sys\n"
        "c = pathlib.Path(__file__).with_suffix('.count')\n"
        "n = int(c.read_text()) if c.exists() else 0\n"
        "c.write_text(str(n + 1))\n"
        "sys.exit(3 if n < 2 else 0)\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return tmp_path


def test_stop_all_terms_then_kills_and_leaves_no_process_group_behind(modules, tmp_path):
    sup = Supervisor(tmp_path / "logs", {})
    pidfile = tmp_path / "grandchild.pid"
    polite = sup.start("polite", "polite_mod", args=[str(pidfile)])
    stubborn = sup.start("stubborn", "stubborn_mod")
    _wait_for(lambda: pidfile.exists() and pidfile.read_text() and "ready" in sup.tail("stubborn"))
    grandchild = int(pidfile.read_text())
    t0 = time.monotonic()
    sup.stop_all(grace_s=1.5)
    took = time.monotonic() - t0
    assert polite.popen.returncode == 0  # it took the SIGTERM
    assert stubborn.popen.returncode == -signal.SIGKILL  # it needed the SIGKILL, after the grace
    assert 1.0 < took < 10
    _wait_for(lambda: not _alive(grandchild), 5)  # the polite one's orphan went with its group
    assert sup.failed() == [stubborn]


def test_supervise_returns_on_failure_on_job_end_and_on_stop(modules, tmp_path):
    stop = threading.Event()
    done = Supervisor(tmp_path / "a", {})
    done.start("generator-0", "ok_mod")
    done.start("trainer", "ok_mod")
    assert supervise(done, stop, poll_s=0.05) == 0

    bad = Supervisor(tmp_path / "b", {})
    bad.start("reward", "stubborn_mod")
    bad.start("trainer", "bad_mod")
    assert supervise(bad, stop, poll_s=0.05) == 1
    bad.stop_all(grace_s=0.5)

    # A long-lived process (the API) that exits, even with 0, is a failure: control is gone.
    api_gone = Supervisor(tmp_path / "c", {})
    api_gone.start("broker", "ok_mod")
    api_gone.start("trainer", "stubborn_mod")
    assert supervise(api_gone, stop, poll_s=0.05) == 1
    api_gone.stop_all(grace_s=0.5)

    running = Supervisor(tmp_path / "d", {})
    running.start("broker", "stubborn_mod")
    threading.Timer(0.3, stop.set).start()
    assert supervise(running, stop, poll_s=0.05) == 130
    running.stop_all(grace_s=0.5)


def test_on_failure_restarts_within_the_budget_and_logs_why(modules, tmp_path, caplog):
    stop = threading.Event()
    sup = Supervisor(tmp_path / "a", {})
    sup.start("trainer", "flaky_mod")
    policy = RestartPolicy(on_failure=True, max_restarts=3, window_s=60, backoff_s=0.05)
    with caplog.at_level("WARNING", logger="asyncrl.launch"):
        assert supervise(sup, stop, poll_s=0.02, policy=policy) == 0  # failed twice, then done
    assert (modules / "flaky_mod.count").read_text() == "3"
    assert [p.name for p in sup.procs] == ["trainer"] and len(sup.procs[0].restarts) == 2
    assert sum("trainer exited with code 3; restarting" in r.message for r in caplog.records) == 2

    # past the budget the failure stops the run, saying so
    (modules / "flaky_mod.count").unlink()
    sup = Supervisor(tmp_path / "b", {})
    sup.start("reward", "bad_mod")
    with caplog.at_level("ERROR", logger="asyncrl.launch"):
        assert supervise(sup, stop, poll_s=0.02, policy=RestartPolicy(True, 2, 60, 0.05)) == 1
    assert len(sup.procs[0].restarts) == 2
    assert any("restart budget spent" in r.message for r in caplog.records)
    assert "boom" in sup.tail("reward")


def test_a_service_of_an_ended_job_is_not_restarted(modules, tmp_path, caplog):
    """A `--spec` job the trainer failed: restarting the trainer would only replay the job's last
    batch into the same error (issue 31); the run ends 1 at once, naming the job's error."""
    stop = threading.Event()
    policy = RestartPolicy(on_failure=True, max_restarts=5, window_s=60, backoff_s=0.05)
    sup = Supervisor(tmp_path / "a", {})
    sup.start("trainer", "bad_mod")
    ended = JobEnd("j1", "failed", "trainer: ValueError: temperature must be > 0, got 0.0")
    with caplog.at_level("ERROR", logger="asyncrl.launch"):
        assert supervise(sup, stop, poll_s=0.02, policy=policy, job_end=lambda: ended) == 1
    assert sup.procs[0].restarts == []
    assert any("not restarted: its job j1 is failed: trainer: ValueError" in r.message for r in caplog.records)
    # while the job is live (or the API cannot say) the restart policy decides, as before
    flaky = Supervisor(tmp_path / "b", {})
    flaky.start("trainer", "flaky_mod")
    assert supervise(flaky, stop, poll_s=0.02, policy=policy, job_end=lambda: None) == 0
    assert len(flaky.procs[0].restarts) == 2


def test_job_state_reads_the_jobs_end_from_the_api(monkeypatch):
    answers = {"j1": {"state": "running"}, "j2": {"state": "failed", "error": "trainer: boom"}}

    def get(url: str, **_: object) -> httpx.Response:
        job = url.rsplit("/", 1)[1]
        if job not in answers:
            return httpx.Response(404, json={"detail": "no such job"})
        return httpx.Response(200, json=answers[job])

    monkeypatch.setattr(httpx, "get", get)
    assert JobState("http://api", "j1")() is None
    assert JobState("http://api", "j2")() == JobEnd("j2", "failed", "trainer: boom")
    assert JobState("http://api", "j3")() is None  # the API cannot say: decided as without it


def test_plan_names_unique_generators_and_the_admin_worker():
    services = plan(
        ["broker", "generator", "reward", "trainer", "admin"],
        3,
        {"GEN_METRICS_PORT": "9100", "ADMIN_QUEUE": "evals"},
        host="box1",
    )
    assert [s.name for s in services] == [
        "broker",
        "generator-0",
        "generator-1",
        "generator-2",
        "reward",
        "trainer",
        "admin",
    ]
    gens = [s for s in services if s.module == "generator_svc"]
    assert [g.env["GEN_GENERATOR_ID"] for g in gens] == ["box1-gen-0", "box1-gen-1", "box1-gen-2"]
    assert [g.env["GEN_METRICS_PORT"] for g in gens] == ["9100", "9101", "9102"]
    admin = services[-1]
    assert admin.module == "celery" and admin.args[:4] == ("-A", "broker.admin", "worker", "-Q")
    assert admin.args[4] == "evals"
    # metrics off: no port is handed out
    assert "GEN_METRICS_PORT" not in plan(["generator"], 1, {})[0].env
    with pytest.raises(ValueError, match="unknown role.*valid: broker"):
        plan(["brokr"], 1, {})


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--generators", "-1"])
    with pytest.raises(SystemExit):
        main(["--spec", "x.json", "--roles", "trainer"])
    assert "keep 'broker' in --roles" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher_env(tmp_path) -> tuple[dict[str, str], int]:
    port = _free_port()
    env = {
        **os.environ,
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'ledger.db'}",
        "STREAM_PREFIX": f"launch-{uuid.uuid4().hex[:8]}:",
        "BROKER_PORT": str(port),
        "JOB_ID": f"no-such-job-{uuid.uuid4().hex[:6]}",
    }
    return env, port


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.timeout(120)
def test_cli_starts_the_real_services_and_stops_them_on_sigterm(tmp_path):
    env, port = _launcher_env(tmp_path)
    env["REWARD_JOB_WAIT_S"] = "600"  # the reward service waits for its job until stopped
    logdir = tmp_path / "logs"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.launch", "--roles", "broker,reward", "--logdir", str(logdir), "--grace", "15"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def up() -> bool:
            assert launcher.poll() is None, launcher.stdout.read() if launcher.stdout else ""
            try:
                ok = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
            # a logged line: the reward service is past start-up and handles SIGTERM
            reward_log = logdir / "reward.log"
            return ok and reward_log.exists() and reward_log.stat().st_size > 0

        _wait_for(up, 60)
        kids = _children(launcher.pid)
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, out
    assert not [k for k in kids if _alive(k)], out
    assert (logdir / "broker.log").exists() and (logdir / "reward.log").exists()
    assert f"logs in {logdir}" in out
    assert "reward interrupted" in (logdir / "reward.log").read_text()  # SIGTERM, not SIGKILL


@pytest.mark.timeout(120)
def test_cli_stops_everything_when_a_service_fails_and_shows_its_log(tmp_path):
    env, port = _launcher_env(tmp_path)
    env["REWARD_JOB_WAIT_S"] = "0"  # the job does not exist: the reward service fails at once
    res = subprocess.run(
        # one restart (the budget's own tests are RestartPolicy's), not the default five with back-off
        [
            sys.executable,
            "-m",
            "asyncrl.launch",
            "--roles",
            "broker,reward",
            "--max-restarts",
            "1",
            "--logdir",
            str(tmp_path / "logs"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert res.returncode == 1, res.stderr
    assert "reward exited with code 1" in res.stderr
    assert "no job 'no-such-job" in res.stderr  # the tail of its log
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)  # the API went down with it


@pytest.mark.timeout(120)
def test_a_fleet_with_exit_when_idle_exits_0_once_nothing_is_queued_or_running(tmp_path):
    env, port = _launcher_env(tmp_path)
    env.pop("JOB_ID")  # a fleet serving the queue
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncrl.launch",
            "--roles",
            "broker",
            "--exit-when-idle",
            "--logdir",
            str(tmp_path / "logs"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    api = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert launcher.poll() is None, launcher.stdout.read() if launcher.stdout else ""
            try:
                return httpx.get(f"{api}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        _wait_for(up, 60)
        spec = {"name": "waits", "model_path": str(tmp_path / "no-model")}
        job_id = httpx.post(f"{api}/jobs", json=spec, timeout=10).json()["id"]
        time.sleep(3)  # no trainer: the job stays queued, and the fleet stays up
        assert launcher.poll() is None
        assert httpx.post(f"{api}/jobs/{job_id}/cancel", timeout=10).json()["state"] == "cancelled"
        out, _ = launcher.communicate(timeout=120)  # it stops the broker first: slow on a loaded box
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out
    assert "no job is queued or running" in out
