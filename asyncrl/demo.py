"""The demo job: build a tiny model, warm-start it, run an RL job with every service as a process.

Needs no set-up: Redis is REDIS_URL, else a local Redis on 6379, else a private redis-server this
process starts; the ledger is SQLite in the work directory unless DATABASE_URL is set. Shows a
progress bar while the job runs, then prints a summary and writes a PNG of reward and staleness.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from asyncrl.http_retry import get_json
from asyncrl.launch import Supervisor
from broker.guard_report import describe, guard_trips
from broker.ledger import Ledger
from broker.ledger.rows import EvalRow, TrainStepRow
from broker.redis_server import resolve_redis_url
from shared.placement import plan_placement

log = logging.getLogger(__name__)
console = Console()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_model(workdir: Path, seed: int) -> Path:
    """Tiny random-init Llama + char tokenizer, then a short supervised warm start (both cached)."""
    base, warm = workdir / "tiny-base", workdir / "tiny-warm"
    if not (base / "config.json").exists():
        console.print(f"[bold]building tiny model[/] -> {base}")
        subprocess.run([sys.executable, "-m", "trainer_svc.tiny_model", "--out", str(base), "--seed", str(seed)], check=True)
    if not (warm / "config.json").exists():
        console.print(f"[bold]supervised warm start[/] -> {warm}")
        subprocess.run(
            [sys.executable, "-m", "trainer_svc.warmstart", "--model", str(base), "--out", str(warm), "--seed", str(seed)],
            check=True,
        )
    return warm


def wait_http(url: str, timeout_s: float, sup: Supervisor) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if sup.failed():
            raise RuntimeError(f"{sup.failed()[0].name} exited early:\n{sup.tail(sup.failed()[0].name)}")
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


@dataclass
class JobRun:
    job_id: str
    db_url: str
    state: str
    error: str | None
    wall_s: float


def run_job(
    wd: Path,
    spec: dict[str, Any],
    *,
    generators: int = 1,
    progress: bool = True,
) -> JobRun:
    """Run one job end to end on this box: Redis (found or private), broker API, N generators,
    reward and trainer as processes (generators pinned to the first core, the trainer to the last;
    a `placement: colocated` spec: both on every core, by shared.placement).
    Returns when the job has ended and every process has stopped."""
    t0 = time.monotonic()
    redis_url, embedded = resolve_redis_url(os.environ.get("REDIS_URL"), allow_embedded=True)
    db_url = os.environ.get("DATABASE_URL") or f"sqlite:///{wd / 'ledger.db'}"
    port = _free_port()
    env = {"REDIS_URL": redis_url, "DATABASE_URL": db_url, "STREAM_PREFIX": f"run-{os.getpid()}-{port}:",
           "BROKER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
    if progress:
        console.print(f"redis {redis_url}{' (private server)' if embedded else ''}; ledger {db_url}")
    sup = Supervisor(wd / "logs" / time.strftime("%Y%m%d-%H%M%S"), env)
    api = f"http://127.0.0.1:{port}"
    # The job's id is chosen here, so every process starts at once (asyncrl.launch does the same):
    # the services import, build their engine and model and wait for the job while the API starts.
    job_id = uuid.uuid4().hex[:12]
    try:
        sup.start("broker", "broker")
        job_env = {"JOB_ID": job_id, "NODE_PLACEMENT": "off"}  # placed here: no service re-places itself
        for name, module, extra, cpus in _placed(spec, generators, {**os.environ, **env}):
            sup.start(name, module, {**job_env, **extra}, cpus=cpus)
        wait_http(f"{api}/health", 60, sup)
        resp = httpx.post(f"{api}/jobs", json=spec, params={"job_id": job_id}, timeout=30)
        if resp.status_code != 201:
            raise RuntimeError(f"job submission failed ({resp.status_code}): {resp.text}")
        if progress:
            console.print(f"job [bold]{job_id}[/] submitted ({spec.get('mode', 'async')}, {spec['steps']} steps)")
        final = _watch(api, job_id, spec["steps"], sup, progress)
        # The trainer's end-of-job stop makes generators and rewarders exit by themselves.
        sup.wait_all(30, exclude=("broker",))
    finally:
        sup.stop_all()
        if embedded:
            embedded.close()
    return JobRun(job_id, db_url, final["state"], final.get("error"), time.monotonic() - t0)


def _placed(spec: dict[str, Any], generators: int, env: dict[str, str]) -> list[tuple[str, str, dict[str, str],
                                                                                    set[int] | None]]:
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
    return [*((n, m, {"GEN_GENERATOR_ID": f"gen-{i}", "VLLM_CPU_OMP_THREADS_BIND": bind}, gen_cores)
              for i, (n, m) in enumerate(gen_names)),
            ("reward", "reward_svc", {}, None),
            ("trainer", "trainer_svc", {"TRAINER_THREADS": str(len(train_cores or cores))}, train_cores)]


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
    model = prepare_model(wd, seed)
    spec = {
        "name": f"demo-{mode}", "model_path": str(model), "mode": mode, "max_staleness": max_staleness,
        "steps": steps, "seed": seed, "eval_every": max(1, steps // 10),
        "algorithm": {"lr": 1e-4},  # tiny model: 1e-3 collapses the policy within a few steps
        "sampling": {"temperature": 1.0, "max_tokens": 8},
        **(extra_spec or {}),
    }
    run = run_job(wd, spec, generators=generators)
    summary = summarize(Ledger(run.db_url), run.job_id, wd, time.monotonic() - t0)
    summary["state"] = run.state
    (wd / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if run.state != "finished":
        raise RuntimeError(f"job ended in state {run.state}: {run.error}")
    return summary


def _watch(api: str, job_id: str, steps: int, sup: Supervisor, show: bool = True) -> dict[str, Any]:
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, disable=not show,
    ) as progress:
        task = progress.add_task("training", total=steps, info="starting services...")
        while True:
            job = get_json(httpx.get, f"{api}/jobs/{job_id}", timeout=30)  # rides out an outage
            if "status_code" in job:
                raise RuntimeError(f"GET /jobs/{job_id}: {job}")
            m = job.get("last_metrics") or {}
            ev = job.get("evals") or []
            info = (
                f"reward {m.get('reward/mean', float('nan')):.2f} "
                f"held-out {ev[-1]['reward_mean'] if ev else float('nan'):.2f} "
                f"stale {m.get('off_policy/mean', float('nan')):.2f}"
            )
            if m.get("guard/trips"):
                info += f" [bold red]guard trips {int(m['guard/trips'])}[/]"
            progress.update(task, completed=job["step"], info=info)
            if job["state"] in ("finished", "failed", "stopped", "cancelled"):
                return job
            bad = [p for p in sup.failed()]
            if bad:
                raise RuntimeError(f"{bad[0].name} exited with {bad[0].popen.returncode}:\n{sup.tail(bad[0].name)}")
            time.sleep(1.0)


def summarize(ledger: Ledger, job_id: str, wd: Path, wall_s: float) -> dict[str, Any]:
    steps = ledger.train_steps(job_id)
    evals = ledger.evals(job_id, source="pipeline")
    hist = ledger.staleness_histogram(job_id)
    counts = ledger.status_counts(job_id)
    # Steady state: the first step also waits for the engines to start.
    steady = steps[1:] or steps
    step_s = sum(s["metrics"]["time/step_s"] for s in steady)
    swaps = [dt for v, dt in ledger.swap_latencies(job_id).items() if v > 0]
    summary: dict[str, Any] = {
        "job_id": job_id,
        "generators": len({r["generator_id"] for r in ledger.generator_loads(job_id)}),
        "swap_latency_s_median": statistics.median(swaps) if swaps else None,
        "wall_s": wall_s,
        "steps": len(steps),
        "reward_per_step": [round(s["metrics"]["reward/mean"], 3) for s in steps],
        # the first evaluation set's curve (the task's held-out split unless eval_sets say otherwise)
        "held_out": [(e["step"], round(e["reward_mean"], 3)) for e in evals if e["name"] == evals[0]["name"]],
        "eval_sets": {name: [{"step": e["step"], "reward": round(e["reward_mean"], 3), "wall_s": e["wall_s"],
                              **(e["metrics"] or {})} for e in evals if e["name"] == name]
                      for name in dict.fromkeys(e["name"] for e in evals)},
        "staleness_histogram": hist,
        "sample_status": counts,
        "samples_per_s": sum(s["metrics"]["samples"] for s in steady) / step_s if step_s else 0.0,
        "tokens_per_s": sum(s["metrics"]["tokens"] for s in steady) / step_s if step_s else 0.0,
        "mean_step_s": step_s / len(steady) if steady else 0.0,
    }
    held = dict(summary["held_out"])
    table = Table(title=f"job {job_id}: reward and staleness per block of steps")
    for col in ("steps", "train reward", "held-out reward (at end)", "staleness mean / max", "dropped"):
        table.add_column(col, justify="right")
    block = max(1, len(steps) // 10)
    for lo in range(0, len(steps), block):
        chunk = steps[lo : lo + block]
        last = chunk[-1]["step"]
        table.add_row(
            f"{chunk[0]['step']}-{last}",
            f"{sum(s['metrics']['reward/mean'] for s in chunk) / len(chunk):.3f}",
            f"{held[last]:.3f}" if last in held else "",
            f"{sum(s['metrics']['off_policy/mean'] for s in chunk) / len(chunk):.2f} / "
            f"{max(int(s['metrics']['off_policy/max']) for s in chunk)}",
            f"{sum(int(s['metrics']['off_policy/dropped']) for s in chunk)}",
        )
    console.print(table)
    if evals:
        console.print("held-out reward: " + " -> ".join(f"{r:.2f} (step {s})" for s, r in summary["held_out"]))
    console.print(f"staleness of trained samples (versions: count): {hist}")
    console.print(f"samples by status: {counts}")
    # every collapse-guard trip, from the trainer's records in the change log (a roll-back, a
    # kept policy or a restart changes what the curves above mean)
    trips = guard_trips(ledger.job_changes(job_id))
    summary["guard_trips"] = [describe(t) for t in trips]
    if trips:
        console.print(f"[bold red]collapse guard tripped {len(trips)} time(s):[/]")
        for line in summary["guard_trips"]:
            console.print(f"  [red]{escape(line)}[/]")
    else:
        console.print("collapse guard: no trips")
    if swaps:
        console.print(f"weight swap, publish -> every generator ({summary['generators']}) serving it: "
                      f"median {statistics.median(swaps):.3f} s, max {max(swaps):.3f} s")
    console.print(
        f"throughput (steady state): {summary['samples_per_s']:.1f} samples/s, "
        f"{summary['tokens_per_s']:.0f} tokens/s, {summary['mean_step_s']:.2f} s/step; wall time {wall_s:.0f} s"
    )
    summary["plot"] = str(plot(steps, evals, wd / "demo.png"))
    console.print(f"plot: {summary['plot']}")
    return summary


def plot(steps: list[TrainStepRow], evals: list[EvalRow], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    xs = [s["step"] for s in steps]
    ax1.plot(xs, [s["metrics"]["reward/mean"] for s in steps], label="train reward (sampled)", alpha=0.6)
    if evals:
        ax1.plot([e["step"] for e in evals], [e["reward_mean"] for e in evals], "o-", label="held-out reward (greedy)")
    ax1.set_ylabel("reward")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend(loc="lower right")
    ax2.plot(xs, [s["metrics"]["off_policy/mean"] for s in steps], label="staleness mean")
    ax2.plot(xs, [s["metrics"]["off_policy/max"] for s in steps], label="staleness max", linestyle="--")
    ax2.set_ylabel("policy versions")
    top = max([s["metrics"]["off_policy/max"] for s in steps] + [1.0])
    ax2.set_ylim(-0.05, top * 1.6)  # room for the legend above the curves
    ax2.set_xlabel("trainer step")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
