"""`asyncrl run SPEC` on a real fleet: the launcher started for the job (real broker, vLLM
generator, reward and trainer processes), the real Redis under a fresh key prefix, a SQLite ledger,
a tiny locally built model and 2-step jobs."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from asyncrl.cli import app
from broker.ledger import Ledger
from broker.streams import connect
from broker.verify import verify

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REDIS_URL = "redis://127.0.0.1:6379/0"
STEPS = 2


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from asyncrl.tiny_model import build_tiny_model

    # vLLM CPU attention needs head_dim >= 32
    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0
    )


def _spec(tmp_path: Path, model: Path | str, name: str, steps: int = STEPS) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(
        json.dumps(
            {
                "name": name,
                "model_path": str(model),
                "steps": steps,
                "group_size": 4,
                "prompts_per_step": 4,
                "eval_every": steps,
                "task": {"n_train": 64, "n_test": 16},
                "sampling": {"max_tokens": 8},
            }
        )
    )
    return str(path)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _answers(api: str) -> bool:
    try:
        httpx.get(f"{api}/health", timeout=2)
    except httpx.TransportError:
        return False
    return True


@pytest.fixture
def box(tmp_path, monkeypatch) -> Any:
    """Runs `asyncrl ...` as a user of this box would, with no ASYNCRL_API: the fleet's API goes on
    a free BROKER_PORT (the command's default address), its logs and plot under tmp_path."""
    socks = [socket.socket() for _ in range(4)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    port, trainer_metrics, reward_metrics, gen_metrics = (s.getsockname()[1] for s in socks)
    for s in socks:
        s.close()
    prefix = f"run-{uuid.uuid4().hex[:8]}:"
    db_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    # metrics ports set as every deployment sets them: a service serves them across its jobs
    env = {
        "BROKER_PORT": str(port),
        "STREAM_PREFIX": prefix,
        "DATABASE_URL": db_url,
        "REDIS_URL": REDIS_URL,
        "COLUMNS": "200",
        "TRAINER_METRICS_PORT": str(trainer_metrics),
        "REWARD_METRICS_PORT": str(reward_metrics),
        "GEN_METRICS_PORT": str(gen_metrics),
    }
    monkeypatch.delenv("ASYNCRL_API", raising=False)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    launchers: list[int] = []

    def cli(*args: str) -> Any:
        result = runner.invoke(app, list(args), env=env)
        launchers.extend(int(p) for p in re.findall(r"launcher pid (\d+)", result.stdout))
        return result

    cli.api, cli.db_url, cli.env = f"http://127.0.0.1:{port}", db_url, env  # type: ignore[attr-defined]
    cli.trainer_metrics = f"http://127.0.0.1:{trainer_metrics}/metrics"  # type: ignore[attr-defined]
    try:
        yield cli
    finally:
        # a failed test must not leave a fleet behind: the launchers it named, and any other
        # started in this test's folder (its --logdir is under tmp_path)
        for proc in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                argv = proc.read_bytes().split(b"\0")
            except OSError:
                continue
            if b"asyncrl.launch" in argv and any(str(tmp_path).encode() in a for a in argv):
                launchers.append(int(proc.parent.name))
        for pid in launchers:
            if _alive(pid):
                os.kill(pid, signal.SIGTERM)
        for pid in launchers:
            deadline = time.monotonic() + 60
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        r = connect(REDIS_URL)
        keys = list(r.scan_iter(match=f"{prefix}*"))
        if keys:
            r.delete(*keys)


def test_run_starts_a_fleet_follows_the_job_and_stops_the_fleet(box, tiny_model, tmp_path):
    result = box("run", _spec(tmp_path, tiny_model, "first"), "--plot", str(tmp_path / "first.png"))
    out = result.stdout
    assert result.exit_code == 0, out + result.stderr
    assert "starting one on this box" in out
    (job_id,) = re.findall(r"job (\w+) finished at step 2", out)
    assert f"job {job_id}: reward and staleness per block of steps" in out and "throughput (steady state)" in out
    assert "stopping the fleet started for this job" in out
    # the fleet's services and libraries write to its logs, not to the terminal
    chatter = ("Loading weights", "it/s]", "%|", "INFO", "WARNING", "setup plugin", "Triton", "vLLM")
    assert not [w for w in chatter if w in out + result.stderr], out + result.stderr
    (pid,) = (int(p) for p in re.findall(r"launcher pid (\d+)", out))
    assert not _alive(pid) and not _answers(box.api)  # nothing left up
    assert (tmp_path / "first.png").stat().st_size > 10_000
    ledger = Ledger(box.db_url)
    assert ledger.get_job(job_id)["state"] == "finished"
    assert [s["step"] for s in ledger.train_steps(job_id)] == [1, 2]
    assert verify(ledger, job_id).ok
    ledger.close()


def test_run_keep_leaves_the_fleet_up_for_the_next_jobs(box, tiny_model, tmp_path):
    # A job that cannot run (no model there) fails alone, with its reason; the fleet stays up (--keep).
    bad = box("run", _spec(tmp_path, tmp_path / "no-such-model", "broken"), "--keep")
    assert bad.exit_code == 1, bad.stdout + bad.stderr
    assert re.search(r"error: job \w+ failed at step 0: .*no-such-model", bad.stderr), bad.stderr
    assert "the fleet stays up" in bad.stdout and "stop it with: kill" in bad.stdout
    (pid,) = (int(p) for p in re.findall(r"launcher pid (\d+)", bad.stdout))
    # The next `asyncrl run` finds that fleet at the default address and runs there.
    good = box("run", _spec(tmp_path, tiny_model, "second"))
    assert good.exit_code == 0, good.stdout + good.stderr
    assert "starting one" not in good.stdout and "stopping the fleet" not in good.stdout
    assert re.search(r"job \w+ finished at step 2", good.stdout)
    # one metrics server for the trainer's life (a second bind of its port failed the next job);
    # a job's series go with the job
    page = httpx.get(box.trainer_metrics, timeout=5).text
    assert 'asyncrl_service_info{service="trainer"} 1.0' in page and "asyncrl_trainer_step{" not in page
    assert f"export ASYNCRL_API={box.api}" in bad.stdout  # not the CLI's default address
    # each service leaves the job when it reads the trainer's drain, just after the job's end
    # (the ledger's "finished", which `run` followed): the fleet shows idle soon after, not at once
    deadline = time.monotonic() + 60
    while True:
        shown = box("status", "--api", box.api)
        assert shown.exit_code == 0, shown.output
        fleet = shown.stdout[shown.stdout.index("fleet") :]
        idle = [re.search(rf"{role} .* idle ", fleet) for role in ("trainer", "generator", "reward")]
        if all(idle):
            break
        assert time.monotonic() < deadline, fleet
        time.sleep(0.5)
    assert re.search(r"reward .* idle .* [1-9] │", fleet), fleet  # it served the good job to its end
    assert _alive(pid)
    os.kill(pid, signal.SIGTERM)  # what the command said stops it
    deadline = time.monotonic() + 90
    while _alive(pid):
        assert time.monotonic() < deadline, "the launcher did not stop on SIGTERM"
        time.sleep(0.2)
    assert not _answers(box.api)


def test_ctrl_c_cancels_the_job_on_the_fleet_run_started_and_stops_it(box, tiny_model, tmp_path):
    """Ctrl-C (SIGINT to the command, as a terminal sends it) while the job trains: the job is
    cancelled, not left running for the next fleet on this ledger, and the fleet stops."""
    env = {k: v for k, v in os.environ.items() if k != "ASYNCRL_API"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "run", _spec(tmp_path, tiny_model, "long", 20_000)],
        cwd=tmp_path,
        env={**env, **box.env, "PYTHONUNBUFFERED": "1"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Ctrl-C reaches the command as at a terminal: a suite started in the background (`cmd &` in a
        # script) runs with SIGINT ignored, a child inherits that, and Python then installs no
        # KeyboardInterrupt handler: the command never saw the test's SIGINT and followed on
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    polls: list[str] = []  # what each poll of the API saw: the story of a failure

    def stuck(what: str) -> str:
        """The command's threads' stacks (it registers faulthandler on SIGUSR1), its output, the polls
        and the fleet's logs."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            proc.kill()
        out, err = proc.communicate(timeout=60)
        logs = "\n".join(
            f"== {f}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:])
            for f in sorted((tmp_path / "runs" / "launch").glob("*/*.log"))
        )
        return f"{what}\nstdout:\n{out}\nstderr:\n{err}\npolls: {polls[-20:]}\n{logs}"

    try:
        deadline = time.monotonic() + 300
        while True:  # until its job trains
            assert proc.poll() is None and time.monotonic() < deadline, stuck("the job never trained")
            try:
                jobs = httpx.get(f"{box.api}/jobs", timeout=10).json()
                polls.append(f"{time.strftime('%X')} {[(j['id'], j['state'], j['step']) for j in jobs]}")
            except (httpx.TransportError, ValueError) as exc:
                polls.append(f"{time.strftime('%X')} {exc!r}")
                jobs = []
            if jobs and jobs[0]["step"] >= 1:
                break
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(stuck("no exit within 180 s of Ctrl-C"))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    job_id = jobs[0]["id"]
    assert f"interrupted: job {job_id} cancelled" in err
    (pid,) = (int(p) for p in re.findall(r"launcher pid (\d+)", out))
    assert not _alive(pid) and not _answers(box.api)
    ledger = Ledger(box.db_url)
    assert ledger.get_job(job_id)["state"] == "cancelled"
    ledger.close()


def test_the_demo_job_runs_on_a_fleet_ahead_of_what_an_earlier_run_left(tiny_model, tmp_path, monkeypatch):
    """asyncrl.demo.run_job (the README's demo): an earlier run stopped mid-job left its job
    running and another queued in the work directory's ledger; the new job runs, and they are
    cancelled, not served first."""
    from asyncrl.demo import run_job, summarize

    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("REDIS_URL", REDIS_URL)
    spec = json.loads(Path(_spec(tmp_path, tiny_model, "demo")).read_text())
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    for job_id in ("0000000000a1", "0000000000a2"):
        ledger.create_job(job_id, "earlier", {**spec, "name": "earlier"})
    ledger.claim_next()  # the earlier run's trainer had taken the first
    ledger.close()
    try:
        run = run_job(tmp_path, spec, progress=False)
    finally:
        r = connect(REDIS_URL)
        keys = list(r.scan_iter(match=f"run-{os.getpid()}-*"))  # run_job's key prefix
        if keys:
            r.delete(*keys)
    assert run.state == "finished", run.error
    ledger = Ledger(run.db_url)
    for job_id in ("0000000000a1", "0000000000a2"):
        job = ledger.get_job(job_id)
        assert job["state"] == "cancelled" and "earlier run" in job["error"] and job["step"] == 0
    summary = summarize(ledger, run.job_id, tmp_path, run.wall_s)
    assert summary["steps"] == STEPS and (tmp_path / "demo.png").exists()
    ledger.close()
