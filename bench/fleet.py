"""The standing fleet beside TRL: how soon a submitted job trains, cold and warm, and what start-up
costs in time to reward.

`python -m bench fleet`, in one run on this machine (the own task of bench.own_task: a user's data
file, reward plug-in and stop string; its tiny warm model):

- TRL GRPOTrainer on the task (`trl_startup_s`: imports, model load, first step; its held-out
  curve, counted from its command's start);
- cold: `python -m asyncrl.launch --spec` (fresh processes, the one-job command of
  docs/deployment.md) on the same task: `cold_start_s` (command -> first trained step) with the
  start-up breakdown per service (bench.startup's marks), and its curve from the command's start;
- warm: `python -m asyncrl.launch` (a fleet serving the queue) that ran one job on the model
  before: `warm_submit_to_first_step_s`, the median over `jobs` jobs submitted one after another
  (each once every service left the one before: GET /fleet all idle) of submit -> first trained
  step; the task's job submitted to
  it (its curve from the submit); a running job cancelled -> the next job's start
  (`cancel_to_next_start_s`); then `rss_jobs` more short jobs with every service's resident
  memory (its process tree) after each: `rss_growth_mib_over_20_jobs` per service (last minus
  first).
- `time_to_reward_vs_trl_{cold,warm}`: TRL's seconds to its final held-out reward divided by ours
  to reach the same reward, both counting start-up (> 1: we get there first).

Results: results/fleet.json and results/fleet.md, with the load average beside the figures.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console

from bench.claims import machine
from bench.own_task import N_TEST, own_spec, prepare_own_model, trl_curve, write_task
from bench.runs import ours_curve, trl_python
from bench.startup import first_marks, ledger_marks
from broker.ledger import Ledger

console = Console()
ROOT = Path(__file__).resolve().parents[1]
ROLES = ("broker", "generator_svc", "reward_svc", "trainer_svc")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(run: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JOB_ID"}
    return {
        **env,
        "DATABASE_URL": f"sqlite:///{run / 'ledger.db'}",
        "STREAM_PREFIX": f"fleet-{time.time_ns()}:",
        "BROKER_PORT": str(_free_port()),
        "PYTHONUNBUFFERED": "1",
        "TRAINER_CHECKPOINT_DIR": str(run / "ckpt"),
    }


def _time_to(curve: list[dict[str, float]], target: float) -> float | None:
    return next((p["t_s"] for p in curve if p["reward"] >= target - 1e-9), None)


def cold_run(wd: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """One job the one-job way (`asyncrl.launch --spec`, fresh processes): start-up marks (seconds
    since the command), its curve from the command's start."""
    run = wd / f"cold-{time.time_ns()}"
    run.mkdir(parents=True)
    (run / "spec.json").write_text(json.dumps(spec))
    env = _env(run)
    t0 = time.time()
    with open(run / "launcher.log", "w") as fh:
        proc = subprocess.run(
            [sys.executable, "-m", "asyncrl.launch", "--spec", str(run / "spec.json"), "--logdir", str(run / "logs")],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"cold run: launcher exited {proc.returncode}; see {run}")
    logs = {"launcher": (run / "launcher.log").read_text(errors="replace")}
    for f in (run / "logs").glob("*.log"):
        logs[f.stem] = f.read_text(errors="replace")
    job_id, marks, _ = ledger_marks(env["DATABASE_URL"])
    found = {**first_marks(logs), **marks}
    rel = {k: v - t0 for k, v in found.items() if not k.endswith("_s")}
    with Ledger(env["DATABASE_URL"]) as ledger:
        curve, ends, _ = ours_curve(ledger, job_id, t0)
    return {
        "job_id": job_id,
        "startup_s": rel.get("trainer.first_step"),
        "marks": dict(sorted(rel.items(), key=lambda kv: kv[1])),
        "curve": curve,
        "durations_s": {k: v for k, v in found.items() if k.endswith("_s")},
        "final_reward": curve[-1]["reward"] if curve else None,
    }


class WarmFleet:
    """`python -m asyncrl.launch` serving the queue, and what the bench does with it."""

    def __init__(self, wd: Path, args: Sequence[str] = ()):
        self.run = wd / f"warm-{time.time_ns()}"
        self.run.mkdir(parents=True)
        self.env = _env(self.run)
        self.api = f"http://127.0.0.1:{self.env['BROKER_PORT']}"
        self.log = open(self.run / "launcher.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.launch", "--logdir", str(self.run / "logs"), *args],
            cwd=ROOT,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.ledger = Ledger(self.env["DATABASE_URL"])
        deadline = time.monotonic() + 180
        while True:
            try:
                services = httpx.get(f"{self.api}/fleet", timeout=2).json()["services"]
                if {s["role"] for s in services if s["state"] == "idle"} >= {"trainer", "generator", "reward"}:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fleet did not come up; see {self.run}")
            time.sleep(0.2)

    def idle(self, timeout: float = 60) -> None:
        """Until every service of the fleet says it is idle (the last job left by all of them)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            services = httpx.get(f"{self.api}/fleet", timeout=5).json()["services"]
            if services and all(s["state"] == "idle" for s in services if s["role"] != "broker"):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the fleet did not go idle; see {self.run}")

    def submit(self, spec: dict[str, Any]) -> tuple[str, float]:
        t = time.time()
        r = httpx.post(f"{self.api}/jobs", json=spec, timeout=30)
        if r.status_code != 201:
            raise RuntimeError(f"submit: {r.status_code} {r.text}")
        return str(r.json()["id"]), t

    def wait(
        self,
        job_id: str,
        states: tuple[str, ...] = ("finished", "failed", "stopped", "cancelled"),
        timeout: float = 600,
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (job := self.ledger.get_job(job_id)) is None or job["state"] not in states:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} did not reach {states}; see {self.run}")
            time.sleep(0.05)
        return dict(job)

    def first_step_at(self, job_id: str) -> float:
        while not (steps := self.ledger.train_steps(job_id)):
            time.sleep(0.05)
        return float(steps[0]["created_at"].timestamp())

    def rss_mib(self) -> dict[str, float]:
        """Resident memory of each service's process tree (MiB)."""
        out: dict[str, float] = {}
        for child in psutil.Process(self.proc.pid).children():
            cmd = child.cmdline()
            role = next((r for r in ROLES if r in cmd), None)
            if role is None:
                continue
            tree = [child, *child.children(recursive=True)]
            out[role] = sum(p.memory_info().rss for p in tree if p.is_running()) / 2**20
        return out

    def close(self) -> None:
        self.proc.send_signal(2)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        self.ledger.close()


def bench_fleet(
    *,
    workdir: str = "runs/bench-fleet",
    out_dir: str = "results",
    jobs: int = 5,
    rss_jobs: int = 20,
    steps: int = 150,
    eval_every: int = 10,
    trl_venv: str = "runs/bench/trl-venv",
) -> dict[str, Any]:
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    data, reward = write_task(wd)
    model = prepare_own_model(wd, data)
    trl_py = trl_python(Path(trl_venv).resolve())
    task = own_spec(model, data, reward, "async", 1, 0, steps, eval_every)
    short = {**own_spec(model, data, reward, "async", 1, 0, 3, 0), "name": "short"}
    load_before = os.getloadavg()

    console.print("[bold]fleet bench[/]: TRL on the own task")
    trl = trl_curve(trl_py, wd, model, data, reward, 0, steps, eval_every)
    target = trl["curve"][-1]["reward"]
    trl_time = _time_to(trl["curve"], target)

    console.print("[bold]fleet bench[/]: cold (asyncrl.launch --spec)")
    cold = cold_run(wd, task)

    console.print("[bold]fleet bench[/]: warm fleet")
    fleet = WarmFleet(wd)
    try:
        fleet.wait(fleet.submit(short)[0])  # the fleet has run a job on this model before
        warm_s = []
        for _ in range(jobs):
            fleet.idle()
            job_id, t = fleet.submit(short)
            warm_s.append(fleet.first_step_at(job_id) - t)
            fleet.wait(job_id)
        fleet.idle()
        job_id, t_submit = fleet.submit(task)
        fleet.wait(job_id)
        warm_curve, _, _ = ours_curve(fleet.ledger, job_id, t_submit)
        # a running job cancelled: how soon the next one starts
        fleet.idle()
        long_id, _ = fleet.submit({**short, "steps": 1000, "name": "long"})
        nxt, _ = fleet.submit(short)
        while not fleet.ledger.train_steps(long_id):
            time.sleep(0.05)
        t_cancel = time.time()
        httpx.post(f"{fleet.api}/jobs/{long_id}/cancel", timeout=30)
        while (started := fleet.ledger.get_job(nxt)["started_at"]) is None:  # type: ignore[index]
            time.sleep(0.05)
        cancel_to_next = started.timestamp() - t_cancel
        fleet.wait(nxt)
        rss = []
        for _ in range(rss_jobs):
            fleet.wait(fleet.submit(short)[0])
            time.sleep(0.5)
            rss.append(fleet.rss_mib())
    finally:
        fleet.close()
    load_after = os.getloadavg()

    cold_time = _time_to(cold["curve"], target)
    warm_time = _time_to(warm_curve, target)
    trl_startup = trl["startup_s"]
    result: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "load_avg_before": load_before,
        "load_avg_after": load_after,
        "task": {
            "what": "bench.own_task: two-digit add/sub from a user's JSONL, reward plug-in, stop '\\n'",
            "steps": steps,
            "eval_every": eval_every,
            "n_test": N_TEST,
            "seed": 0,
        },
        "trl_startup_s": trl_startup,
        "trl_version": trl["trl_version"],
        "trl_target_reward": target,
        "trl_time_to_target_s": trl_time,
        "cold_start_s": cold["startup_s"],
        "cold_over_trl": cold["startup_s"] / trl_startup,
        "cold_breakdown_s": cold["marks"],
        "cold_durations_s": cold["durations_s"],
        "warm_submit_to_first_step_s": statistics.median(warm_s),
        "warm_submit_to_first_step_runs_s": warm_s,
        "cancel_to_next_start_s": cancel_to_next,
        "cold_time_to_target_s": cold_time,
        "warm_time_to_target_s": warm_time,
        "time_to_reward_vs_trl_cold": trl_time / cold_time if trl_time and cold_time else None,
        "time_to_reward_vs_trl_warm": trl_time / warm_time if trl_time and warm_time else None,
        "final_reward": {
            "trl": target,
            "cold": cold["final_reward"],
            "warm": warm_curve[-1]["reward"] if warm_curve else None,
        },
        "rss_mib_per_job": rss,
        "rss_growth_mib_over_20_jobs": {r: rss[-1][r] - rss[0][r] for r in rss[0]} if rss else {},
        "curves": {"trl": trl["curve"], "cold": cold["curve"], "warm": warm_curve},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "fleet.md").write_text(report(result))
    console.print(report(result))
    return result


def _f(v: Any, d: int = 2) -> str:
    return "-" if v is None else f"{v:.{d}f}" if isinstance(v, float) else str(v)


def report(r: dict[str, Any]) -> str:
    lb, la = r["load_avg_before"], r["load_avg_after"]
    lines = [
        "# The standing fleet beside TRL (`python -m bench fleet`)",
        "",
        f"{r['machine']['cores']} cores ({r['machine']['cpu']}), {r['date']}; load average before "
        f"{lb[0]:.1f} / {lb[1]:.1f} / {lb[2]:.1f}, after {la[0]:.1f} / {la[1]:.1f} / {la[2]:.1f}. Task: "
        f"{r['task']['what']}, {r['task']['steps']} steps, held-out every {r['task']['eval_every']}; TRL "
        f"{r['trl_version']}.",
        "",
        "| figure | value | goal |",
        "|---|---|---|",
        f"| warm_submit_to_first_step_s (median of {len(r['warm_submit_to_first_step_runs_s'])}) | "
        f"{_f(r['warm_submit_to_first_step_s'])} ({', '.join(_f(x) for x in r['warm_submit_to_first_step_runs_s'])}) "
        "| <= 1.0 |",
        f"| trl_startup_s | {_f(r['trl_startup_s'])} | |",
        f"| cold_start_s | {_f(r['cold_start_s'])} | |",
        f"| cold_over_trl | {_f(r['cold_over_trl'])} | <= 1.5 |",
        f"| time_to_reward_vs_trl_warm (TRL / ours) | {_f(r['time_to_reward_vs_trl_warm'])} | >= 1.5 |",
        f"| time_to_reward_vs_trl_cold | {_f(r['time_to_reward_vs_trl_cold'])} | |",
        f"| cancel_to_next_start_s | {_f(r['cancel_to_next_start_s'])} | <= 2 |",
        *(
            f"| rss_growth_mib_over_20_jobs, {k} | {_f(v, 1)} | <= 50 |"
            for k, v in r["rss_growth_mib_over_20_jobs"].items()
        ),
        "",
        f"Target: TRL's final held-out reward {_f(r['trl_target_reward'], 3)}, reached by TRL in "
        f"{_f(r['trl_time_to_target_s'], 1)} s from its command, by ours in {_f(r['cold_time_to_target_s'], 1)} s "
        f"cold (from the command) and {_f(r['warm_time_to_target_s'], 1)} s warm (from the submit).",
        "",
        "Cold start, seconds since the command (first time each mark appears):",
        "",
        "| mark | s |",
        "|---|---|",
        *(f"| {k} | {v:.2f} |" for k, v in r["cold_breakdown_s"].items()),
    ]
    return "\n".join(lines) + "\n"
