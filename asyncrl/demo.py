"""The demo job: build a tiny model, warm-start it, and run an RL job on a fleet of services
started for it, every service a process (broker/fleet.py), the job submitted through the API.

Needs no set-up: Redis is REDIS_URL, else a local Redis on 6379, else a private redis-server this
process starts; the ledger is SQLite in the work directory unless DATABASE_URL is set. Shows a
progress bar while the job runs, then prints a summary and writes a PNG of reward and staleness
(asyncrl/report.py: what `asyncrl run` shows of any job).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from asyncrl.launch import Supervisor, wait_healthy
from asyncrl.report import follow, plot, show_summary
from broker.fleet import LIVE_STATES
from broker.job_summary import job_summary
from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from shared.placement import plan_placement

log = logging.getLogger(__name__)
console = Console()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The model tools' output goes to a log file, where progress bars are carriage-return noise.
TOOL_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def run_tool(argv: Sequence[str], log_path: Path, what: str) -> str:
    """Run a tool (`argv`) with its stderr (library progress bars, warnings, log lines) appended
    to `log_path`, then its stdout: none of it reaches the terminal. Returns its stdout.

    Raises:
        RuntimeError: the tool failed; the message names `what` and the log and holds its tail.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as fh:
        fh.write(f"$ {' '.join(argv)}\n")
        fh.flush()
        proc = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=fh, text=True, env={**os.environ, **TOOL_ENV})
        fh.write(proc.stdout)
    if proc.returncode:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}); last lines of {log_path}:\n{tail}")
    return proc.stdout


def warmstart_command(base: Path, out: Path, *args: str) -> list[str]:
    """The command line of a supervised warm start (asyncrl.warmstart): `base` -> `out`, with its
    other options in `args`."""
    return [sys.executable, "-m", "asyncrl.warmstart", "--model", str(base), "--out", str(out), *args]


def prepare_model(workdir: Path, seed: int, *, log_path: Path | None = None, warm_args: Sequence[str] = ()) -> Path:
    """Tiny random-init Llama + char tokenizer, then a short supervised warm start (both cached).

    The tools' output goes to `log_path` (default `workdir/logs/model.log`); the terminal gets a
    line per stage and the warm start's accuracy. `warm_args`: more asyncrl.warmstart options.
    """
    base, warm = workdir / "tiny-base", workdir / "tiny-warm"
    log_path = log_path or workdir / "logs" / "model.log"
    if not (base / "config.json").exists():
        console.print(f"[bold]building tiny model[/] -> {base}", soft_wrap=True)
        run_tool(
            [sys.executable, "-m", "asyncrl.tiny_model", "--out", str(base), "--seed", str(seed)],
            log_path,
            "building the tiny model",
        )
    if not (warm / "config.json").exists():
        console.print(f"[bold]supervised warm start[/] -> {warm} (a minute or two; log {log_path})", soft_wrap=True)
        out = run_tool(
            warmstart_command(base, warm, "--seed", str(seed), *warm_args),
            log_path,
            "the supervised warm start",
        )
        console.print(_warm_line(out), soft_wrap=True)
    return warm


def _warm_line(stdout: str) -> str:
    """asyncrl.warmstart's result (its last stdout line, JSON) as a sentence."""
    try:
        m = json.loads(stdout.strip().splitlines()[-1])
        return (
            f"warm start: held-out greedy accuracy {m['greedy_acc']:.2f}, pass@8 {m['pass_at_8']:.2f} "
            f"({m['seconds']:.0f} s)"
        )
    except (IndexError, ValueError, KeyError, TypeError):
        return f"warm start done: {stdout.strip()}"


@dataclass
class JobRun:
    job_id: str
    db_url: str
    state: str
    error: str | None
    wall_s: float


def cancel_leftovers(ledger: Ledger) -> list[str]:
    """Cancel the jobs an earlier run left live in this run's own ledger (a run stopped by Ctrl-C
    leaves its job running for a successor, as SIGTERM does; a killed one leaves it in any live
    state), so that the new job is the only one its fleet serves. Returns their ids."""
    left = [j["id"] for j in ledger.list_jobs(limit=1000, states=LIVE_STATES)]
    for job_id in left:
        ledger.move_job(
            job_id,
            LIVE_STATES,
            "cancelled",
            error="left live by an earlier run of this work directory; cancelled when the next run started",
        )
    return left


def run_job(
    wd: Path,
    spec: dict[str, Any],
    *,
    generators: int = 1,
    progress: bool = True,
    logdir: Path | None = None,
) -> JobRun:
    """Run one job end to end on a fleet started on this box for it: Redis (found or private),
    the broker API, N generators, reward and trainer as processes serving the ledger's queue
    (broker/fleet.py: no JOB_ID; generators pinned to the first core, the trainer to the last; a
    `placement: colocated` spec: both on every core, by shared.placement). The job is submitted
    through the API and followed there, as `asyncrl run` does with any fleet.

    The ledger is SQLite in `wd` unless DATABASE_URL is set. Jobs an earlier run left live in the
    work directory's own ledger are cancelled first (`cancel_leftovers`): the ledger keeps every
    earlier run's record (benches read them all), but nothing of theirs runs ahead of this job.
    A DATABASE_URL is the user's ledger: its queue is left alone, and the job takes its turn.
    Each process logs to `logdir/<name>.log` (default `wd/logs/<timestamp>`).

    Returns when the job has ended and every process has stopped.
    """
    t0 = time.monotonic()
    redis_url, embedded = resolve_redis_url(os.environ.get("REDIS_URL"), allow_embedded=True)
    db_url = os.environ.get("DATABASE_URL") or f"sqlite:///{wd / 'ledger.db'}"
    port = free_port()
    env = {
        "REDIS_URL": redis_url,
        "DATABASE_URL": db_url,
        "STREAM_PREFIX": f"run-{os.getpid()}-{port}:",
        "BROKER_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
    }
    if not os.environ.get("DATABASE_URL"):
        ledger = Ledger(db_url)
        left = cancel_leftovers(ledger)
        ledger.close()
        if left and progress:
            console.print(
                f"cancelled {len(left)} job(s) an earlier run left live in {db_url}: {', '.join(left)}", soft_wrap=True
            )
    sup = Supervisor(logdir or wd / "logs" / time.strftime("%Y%m%d-%H%M%S"), env)
    if progress:
        # soft_wrap: addresses and paths stay whole, to be copied
        console.print(
            f"redis {redis_url}{' (private server)' if embedded else ''}; ledger {db_url}; services' logs {sup.logdir}",
            soft_wrap=True,
        )
    api = f"http://127.0.0.1:{port}"
    job_id = ""
    try:
        # Every process starts at once: the services import, build their engine and model and wait
        # for a job while the API starts.
        sup.start("broker", "broker")
        for name, module, extra, cpus in _placed(spec, generators, {**os.environ, **env}):
            # placed here: no service re-places itself
            sup.start(name, module, {"NODE_PLACEMENT": "off", **extra}, cpus=cpus)
        wait_healthy(f"{api}/health", sup, "broker", 60)
        resp = httpx.post(f"{api}/jobs", json=spec, timeout=30)
        if resp.status_code != 201:
            raise RuntimeError(f"job submission failed ({resp.status_code}): {resp.text}")
        job_id = resp.json()["id"]
        if progress:
            console.print(
                f"job [bold]{job_id}[/] submitted ({spec.get('mode', 'async')}, {spec['steps']} steps); "
                f"status page {api}/status?job={job_id}",
                soft_wrap=True,
            )
        final = follow(api, job_id, show=progress, check=lambda: _check_processes(sup), console=console)
    except KeyboardInterrupt:
        if job_id:  # else the stop below would leave it running for a successor
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{api}/jobs/{job_id}/cancel", timeout=5)
        raise
    finally:
        sup.stop_all()
        if embedded:
            embedded.close()
    return JobRun(job_id, db_url, final["state"], final.get("error"), time.monotonic() - t0)


def _check_processes(sup: Supervisor) -> None:
    """Raises RuntimeError when a process of the run's fleet exited (none is restarted here)."""
    bad = sup.failed()
    if bad:
        raise RuntimeError(f"{bad[0].name} exited with {bad[0].popen.returncode}:\n{sup.tail(bad[0].name)}")


def _placed(
    spec: dict[str, Any], generators: int, env: dict[str, str]
) -> list[tuple[str, str, dict[str, str], set[int] | None]]:
    """(name, module, env, cores) of each job service run_job starts. Split: the bench's hand
    placement (two roles, two cores: vLLM's OpenMP threads on the first, torch on the last).
    `placement: colocated`: shared.placement's rule, generators and trainer on every core."""
    cores = sorted(os.sched_getaffinity(0))
    gen_names = [(f"generator-{i}", "generator_svc") for i in range(generators)]
    if spec.get("placement") == "colocated":
        names = [*gen_names, ("reward", "reward_svc"), ("trainer", "trainer_svc")]
        plan = plan_placement(names, cores, env, mode="colocated")
        out = []
        for n, m in names:
            ids = {"GEN_GENERATOR_ID": f"gen-{n.rsplit('-', 1)[1]}"} if m == "generator_svc" else {}
            pin = plan[n].cpus
            out.append((n, m, {**plan[n].env, **ids}, set(pin) if pin else None))
        return out
    gen_cores, train_cores = ({cores[0]}, {cores[-1]}) if len(cores) > 1 else (None, None)
    bind = ",".join(map(str, sorted(gen_cores))) if gen_cores else "auto"
    return [
        *(
            (n, m, {"GEN_GENERATOR_ID": f"gen-{i}", "VLLM_CPU_OMP_THREADS_BIND": bind}, gen_cores)
            for i, (n, m) in enumerate(gen_names)
        ),
        ("reward", "reward_svc", {}, None),
        ("trainer", "trainer_svc", {"TRAINER_THREADS": str(len(train_cores or cores))}, train_cores),
    ]


def run_demo(
    *,
    workdir: str = "runs/demo",
    steps: int = 50,
    mode: str = "async",
    max_staleness: int = 1,
    generators: int = 1,
    seed: int = 0,
    extra_spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    t0 = time.monotonic()
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    logdir = wd / "logs" / time.strftime("%Y%m%d-%H%M%S")  # this run's: the model tools' and every service's
    model = prepare_model(wd, seed, log_path=logdir / "model.log")
    spec = {
        "name": f"demo-{mode}",
        "model_path": str(model),
        "mode": mode,
        "max_staleness": max_staleness,
        "steps": steps,
        "seed": seed,
        "eval_every": max(1, steps // 10),
        "algorithm": {"lr": 1e-4},  # tiny model: 1e-3 collapses the policy within a few steps
        "sampling": {"temperature": 1.0, "max_tokens": 8},
        **(extra_spec or {}),
    }
    run = run_job(wd, spec, generators=generators, logdir=logdir)
    summary = summarize(Ledger(run.db_url), run.job_id, wd, time.monotonic() - t0)
    summary["state"] = run.state
    (wd / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if run.state != "finished":
        raise RuntimeError(f"job ended in state {run.state}: {run.error}")
    return summary


def summarize(ledger: Ledger, job_id: str, wd: Path, wall_s: float) -> dict[str, Any]:
    """The job's summary (broker.job_summary) printed as `asyncrl run` prints it, with `wall_s`
    and the plot written to `wd/demo.png`."""
    summary = {**job_summary(ledger, job_id), "wall_s": wall_s}
    show_summary(summary, wall_s, console)
    summary["plot"] = str(plot(summary, wd / "demo.png"))
    console.print(f"plot: {summary['plot']}", soft_wrap=True)
    return summary
