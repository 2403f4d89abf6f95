"""Start-up: seconds from the user's command to the first trained step, and where they go.

`python -m bench startup`: runs the one-job command of docs/deployment.md, `python -m asyncrl.launch
--spec deploy/jobs/arithmetic-async.json` (model_path pointed at the tiny warm model of
asyncrl.demo, a fresh SQLite ledger, a few steps), `reps` times. Start-up is the first trained
step's ledger timestamp minus the moment the command was started (it includes that step, as TRL's
figure of imports + model load + first step does). The breakdown per service comes from the first
timestamp of the log lines and ledger rows each process writes on its way: process start (launcher),
interpreter and imports, job opened (Redis, ledger), engine or model built, first weight publish and
load, first generation, first scored sample, first step. Then one longer job per code version gives
the steady-state seconds per step (median step-to-step interval after the tenth step), so that a
faster start is not paid for in the steps.

`--before DIR` runs the same with the code checked out in DIR (its launcher and services, on
PYTHONPATH) first: "before", this checkout "after". Results: results/startup.json and .md.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from asyncrl.demo import prepare_model
from bench.claims import machine
from broker.ledger import Ledger
from broker.ledger.models import GeneratorLoad, PolicyVersion, Sample

console = Console()
ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "deploy" / "jobs" / "arithmetic-async.json"

# (service log, phase, pattern of the first line that ends it). The launcher's own lines carry
# the process starts; every service log is `<logdir>/<name>.log`. Lines that only one code
# version writes are simply absent from the other's breakdown.
MARKS: list[tuple[str, str, str]] = [
    ("launcher", "broker.start", r"started broker \(pid"),
    ("launcher", "broker.api_healthy", r"broker API at"),
    ("launcher", "broker.submitted", r"submitted .* as job"),
    ("launcher", "generator.start", r"started generator-0 \(pid"),
    ("launcher", "reward.start", r"started reward \(pid"),
    ("launcher", "trainer.start", r"started trainer \(pid"),
    ("broker", "broker.imported", r"imported broker\.serve"),
    ("generator-0", "generator.imported", r"imported generator_svc\.service"),
    ("generator-0", "generator.job_open", r"serving job"),
    ("generator-0", "generator.vllm_imported", r"engine: vllm imported"),
    ("generator-0", "generator.engine_ready", r"generator \S+ ready"),
    ("generator-0", "generator.first_generation", r"^v\d+: \d+ groups"),
    ("reward", "reward.imported", r"imported reward_svc\.service"),
    ("reward", "reward.job_open", r"serving job"),
    ("reward", "reward.ready", r"reward \S+ ready"),
    ("trainer", "trainer.imported", r"imported trainer_svc\.train"),
    ("trainer", "trainer.job_open", r"serving job"),
    ("trainer", "trainer.model_loaded", r"trainer: model loaded"),
    ("trainer", "trainer.parts_built", r"trainer: ready in"),
]
# Our log lines: "2026-12-01 23:30:01,123 INFO service=... name: message"
_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ service=\S+ .*?\S+: (.*)$")
# vLLM's: "(EngineCore pid=1) INFO 12-01 23:30:01 [file.py:12] message" (seconds only): durations
_VLLM = [
    ("generator.vllm_model_load_s", re.compile(r"Model loading took .*? and ([\d.]+) seconds")),
    ("generator.vllm_engine_init_s", re.compile(r"init engine .*? took ([\d.]+) sec")),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stamp(text: str) -> float:
    """Epoch seconds of a log timestamp (written in local time by logging)."""
    base, ms = text.split(",")
    return time.mktime(datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timetuple()) + int(ms) / 1000


def first_marks(logs: dict[str, str]) -> dict[str, float]:
    """The time of the first line matching each of MARKS (epoch s), and vLLM's own durations (s)."""
    out: dict[str, float] = {}
    for source, phase, pattern in MARKS:
        rx = re.compile(pattern)
        for line in logs.get(source, "").splitlines():
            m = _LINE.match(line)
            if m and rx.search(m.group(2)):
                out[phase] = _stamp(m.group(1))
                break
    for key, rx in _VLLM:
        if found := rx.search(logs.get("generator-0", "")):
            out[key] = float(found.group(1))
    return out


def ledger_marks(db_url: str) -> tuple[str, dict[str, float], list[float]]:
    """(job id, first-row times (epoch s) of the ledger's start-up facts, every step's end time)."""
    from sqlalchemy import func, select

    ledger = Ledger(db_url)  # upgraded to this code's schema: a run of older code wrote it
    try:
        job = ledger.list_jobs(limit=1)[0]
        steps = [s["created_at"].timestamp() for s in ledger.train_steps(job["id"])]
        out: dict[str, float] = {"broker.job_created": job["created_at"].timestamp()}
        if job.get("started_at"):
            out["trainer.job_started"] = job["started_at"].timestamp()
        queries = {
            "trainer.v0_published": select(func.min(PolicyVersion.created_at)).where(PolicyVersion.job_id == job["id"]),
            "generator.v0_loaded": select(func.min(GeneratorLoad.loaded_at)).where(GeneratorLoad.job_id == job["id"]),
            "generator.first_sample": select(func.min(Sample.created_at)).where(Sample.job_id == job["id"]),
            "reward.first_scored": select(func.min(Sample.scored_at)).where(Sample.job_id == job["id"]),
        }
        with ledger.engine.connect() as conn:
            for key, q in queries.items():
                t = conn.execute(q).scalar()
                if t is not None:
                    out[key] = t.timestamp()
        if steps:
            out["trainer.first_step"] = steps[0]
        return job["id"], out, steps
    finally:
        ledger.close()


def run_launch(code: Path, wd: Path, model: Path, steps: int, label: str) -> dict[str, Any]:
    """One job started the README's way with the code in `code`; its start-up marks (seconds since
    the command started) and step end times."""
    run = wd / f"{label}-{time.time_ns()}"
    run.mkdir(parents=True)
    spec = {**json.loads(SPEC.read_text()), "model_path": str(model), "steps": steps}
    (run / "spec.json").write_text(json.dumps(spec))
    db = f"sqlite:///{run / 'ledger.db'}"
    env = {
        **os.environ,
        "PYTHONPATH": str(code),
        "DATABASE_URL": db,
        "STREAM_PREFIX": f"startup-{time.time_ns()}:",
        "BROKER_PORT": str(_free_port()),
        "PYTHONUNBUFFERED": "1",
    }
    t0 = time.time()
    with open(run / "launcher.log", "w") as fh:
        proc = subprocess.run(
            [sys.executable, "-m", "asyncrl.launch", "--spec", str(run / "spec.json"), "--logdir", str(run / "logs")],
            cwd=code,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    wall = time.time() - t0
    logs = {"launcher": (run / "launcher.log").read_text(errors="replace")}
    for f in (run / "logs").glob("*.log"):
        logs[f.stem] = f.read_text(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: launcher exited {proc.returncode}; logs in {run}:\n{logs['launcher'][-3000:]}")
    job_id, marks, ends = ledger_marks(db)
    found = {**first_marks(logs), **marks}
    rel = {k: (v if k.endswith("_s") else v - t0) for k, v in found.items()}
    intervals = [b - a for a, b in zip(ends[10:], ends[11:], strict=False)]
    return {
        "job_id": job_id,
        "dir": str(run),
        "wall_s": wall,
        "startup_s": rel.get("trainer.first_step"),
        "marks": dict(sorted(rel.items(), key=lambda kv: (kv[0].endswith("_s"), kv[1]))),
        "step_s_median": statistics.median(intervals) if intervals else None,
        "steps": len(ends),
    }


def median_marks(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = dict.fromkeys(k for r in runs for k in r["marks"])
    out = {k: statistics.median([r["marks"][k] for r in runs if k in r["marks"]]) for k in keys}
    return dict(sorted(out.items(), key=lambda kv: (kv[0].endswith("_s"), kv[1])))


def phases(m: dict[str, float]) -> dict[str, float]:
    """Per service, the seconds between its consecutive marks (in time order) from the median
    marks, starting from the command; vLLM's own durations as they are."""
    out: dict[str, float] = {}
    for svc in ("broker", "generator", "reward", "trainer"):
        prev, t_prev = "command", 0.0
        for k, t in sorted(
            ((k, t) for k, t in m.items() if k.startswith(f"{svc}.") and not k.endswith("_s")), key=lambda kv: kv[1]
        ):
            out[f"{prev} -> {k}"] = t - t_prev
            prev, t_prev = k, t
    out.update({k: v for k, v in m.items() if k.endswith("_s")})
    return out


def bench_startup(
    *,
    reps: int = 3,
    compare: str | None = None,
    steady_steps: int = 40,
    startup_steps: int = 3,
    out_dir: str = "results",
    workdir: str = "runs/bench-startup",
) -> dict[str, Any]:
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    model = prepare_model(wd, 0)
    versions = ([("before", Path(compare).resolve())] if compare else []) + [("after", ROOT)]
    result: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "reps": reps,
        "command": "python -m asyncrl.launch --spec deploy/jobs/arithmetic-async.json "
        f"(model_path: the tiny warm model; steps: {startup_steps})",
        "definition": "startup_s: first trained step's ledger time minus the command's start "
        "(median over reps); the first step itself is included",
    }
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in versions}
    for i in range(reps):  # interleaved, so that a change in the box's load hits both alike
        for label, code in versions:
            console.print(f"[bold]start-up[/] {label} {i + 1}/{reps}")
            runs[label].append(run_launch(code, wd, model, startup_steps, label))
    for label, code in versions:
        rs = runs[label]
        marks = median_marks(rs)
        console.print(f"[bold]steady state[/] {label}: {steady_steps} steps")
        steady = run_launch(code, wd, model, steady_steps, f"{label}-steady")
        result[f"startup_s_{label}"] = statistics.median([r["startup_s"] for r in rs])
        result[f"startup_runs_s_{label}"] = [r["startup_s"] for r in rs]
        result[f"marks_{label}"] = marks
        result[f"breakdown_{label}"] = phases(marks)
        result[f"steady_step_s_{label}"] = steady["step_s_median"]
        result[f"runs_{label}"] = [*rs, steady]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "startup.md").write_text(markdown(result, [label for label, _ in versions]))
    return result


def markdown(r: dict[str, Any], labels: list[str]) -> str:
    lines = [
        f"# Start-up: command -> first trained step ({r['date']}, {r['machine']['cores']} cores)",
        "",
        f"Command: `{r['command']}`; {r['reps']} repetitions each. {r['definition']}.",
        "",
    ]
    lines += ["| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    lines.append("| start-up s (median) | " + " | ".join(f"{r[f'startup_s_{x}']:.2f}" for x in labels) + " |")
    lines.append(
        "| start-up s (each run) | "
        + " | ".join(", ".join(f"{v:.2f}" for v in r[f"startup_runs_s_{x}"]) for x in labels)
        + " |"
    )
    lines.append(
        "| steady s/step (median, 40-step job) | "
        + " | ".join(f"{r[f'steady_step_s_{x}']:.3f}" if r[f"steady_step_s_{x}"] else "-" for x in labels)
        + " |"
    )
    lines += [
        "",
        "Timeline (median seconds since the command; first time each line or ledger row appears):",
        "",
        "| mark | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    keys = dict.fromkeys(k for x in labels for k in r[f"marks_{x}"])
    for k in keys:
        lines.append(
            f"| {k} | "
            + " | ".join(f"{r[f'marks_{x}'][k]:.2f}" if k in r[f"marks_{x}"] else "-" for x in labels)
            + " |"
        )
    for x in labels:
        lines += ["", f"Phases, {x} (seconds):", "", "| phase | s |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in r[f"breakdown_{x}"].items()]
    return "\n".join(lines) + "\n"
