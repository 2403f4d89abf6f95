"""`python -m bench steps`: where one step's time goes, per role and phase, at the demo's size.

Each run measures, on the demo's model and batch (16 prompts x 8 samples, 8-token completions):
T_gen (the engine alone on one step's batch) and T_train (the trainer alone: step + publish), both
pinned as `bench async` pins them; then an async job (k = 1, no evaluation rounds) with every
service's /metrics scraped, giving the per-phase breakdown (shared.metrics.Phases) of the
generator, the reward service and the trainer, and the step time against max(T_gen, T_train).

The step time is the trainer's step period: seconds between consecutive steps' ledger records
(everything the loop does, the step's own ledger writes and acks included), median over the
steady steps; `time/step_s` (from the top of the loop to the step's metrics) is beside it.

`--before DIR` runs the same measurement with the services (and T_gen, T_train) imported from
another checkout of the code, interleaved with this one's (before, after, before, after, ...), so
the two are measured under the same load. Results: results/steps.json and results/steps.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from asyncrl.demo import free_port, prepare_model, run_job
from bench.claims import machine, run_pinned, split_cores
from bench.runs import environment
from broker.ledger import Ledger
from shared.metrics import PHASES, phase_summary

console = Console()

SHAPE = {"prompts": 16, "n": 8, "max_tokens": 8}  # the demo's (asyncrl.demo.run_demo)
ROLES = {"generator": "GEN_METRICS_PORT", "reward": "REWARD_METRICS_PORT", "trainer": "TRAINER_METRICS_PORT"}


class _Pages:
    """Keeps the last /metrics page of each URL, polled in a thread (the services exit with the job)."""

    def __init__(self, urls: dict[str, str]):
        self.urls, self.pages = urls, {k: "" for k in urls}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            for k, url in self.urls.items():
                try:
                    self.pages[k] = httpx.get(url, timeout=1.0).text
                except httpx.HTTPError:
                    continue

    def __enter__(self) -> _Pages:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def measure(wd: Path, model: Path, steps: int, code: str | None) -> dict[str, Any]:
    """One run: T_gen, T_train, then the async job with its phases. `code`: the checkout the
    services import (None: this one)."""
    env = {"PYTHONPATH": code} if code else {}
    gen_core, train_core = split_cores()
    shape = ["--prompts", str(SHAPE["prompts"]), "--n", str(SHAPE["n"]), "--max-tokens", str(SHAPE["max_tokens"])]
    with environment(**env):
        run_pinned(
            [
                sys.executable,
                "-m",
                "bench.t_gen",
                "--model",
                str(model),
                *shape,
                "--reps",
                "10",
                "--out",
                str(wd / "t_gen.json"),
            ],
            gen_core,
            {"VLLM_CPU_OMP_THREADS_BIND": str(gen_core) if gen_core is not None else "auto"},
        )
        run_pinned(
            [
                sys.executable,
                "-m",
                "bench.t_train",
                "--model",
                str(model),
                *shape,
                "--threads",
                "1",
                "--reps",
                "10",
                "--out",
                str(wd / "t_train.json"),
            ],
            train_core,
        )
    t_gen = json.loads((wd / "t_gen.json").read_text())
    t_train = json.loads((wd / "t_train.json").read_text())
    ports = {role: free_port() for role in ROLES}
    spec = {
        "name": "bench-steps",
        "model_path": str(model),
        "steps": steps,
        "group_size": SHAPE["n"],
        "prompts_per_step": SHAPE["prompts"],
        "eval_every": 0,
        "mode": "async",
        "max_staleness": 1,
        "algorithm": {"lr": 1e-4},
        "sampling": {"temperature": 1.0, "max_tokens": SHAPE["max_tokens"]},
    }
    with (
        environment(**env, **{ROLES[r]: str(p) for r, p in ports.items()}),
        _Pages({r: f"http://127.0.0.1:{p}/metrics" for r, p in ports.items()}) as pages,
    ):
        run = run_job(wd, spec, progress=False)
    if run.state != "finished":
        raise RuntimeError(f"steps run ended {run.state}: {run.error}")
    rows = Ledger(run.db_url).train_steps(run.job_id)
    steady = rows[3:] if len(rows) > 5 else rows[1:]  # after the engine's start and the first loads
    periods = [(b["created_at"] - a["created_at"]).total_seconds() for a, b in zip(rows[2:], rows[3:], strict=False)]
    bound = max(t_gen["t_gen_s"], t_train["t_train_s"])
    period = statistics.median(periods)
    trainer_keys = sorted({k for r in steady for k in r["metrics"] if k.startswith(("time/", "phase/"))})
    phases: dict[str, dict[str, dict[str, float]]] = {}
    for role in ROLES:
        for p in phase_summary(pages.pages[role]):
            if p["role"] == role:
                phases.setdefault(role, {})[str(p["phase"])] = {
                    k: float(p[k]) for k in ("count", "mean_s", "median_s", "total_s")
                }
    return {
        "code": code or "this checkout",
        "t_gen_s": t_gen["t_gen_s"],
        "t_train_s": t_train["t_train_s"],
        "t_step_s": t_train["t_step_s"],
        "t_publish_s": t_train["t_publish_s"],
        "async_period_s": period,
        "async_step_s": _median([r["metrics"]["time/step_s"] for r in steady]),
        "async_over_max": period / bound,
        # trainer: median seconds per step in each phase, steady steps only (from its step metrics)
        "trainer_per_step_s": {
            k: _median([r["metrics"][k] for r in steady if k in r["metrics"]]) for k in trainer_keys
        },
        # every role: its spans over the whole job (Prometheus), start-up included
        "phases": phases,
        "steps": len(rows),
        "job_id": run.job_id,
    }


def bench_steps(
    out_dir: str = "results",
    steps: int = 40,
    runs: int = 2,
    before: str | None = None,
    workdir: str = "runs/bench-steps",
) -> dict[str, Any]:
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    model = prepare_model(wd, 0)
    labels = [("before", before), ("after", None)] if before else [("after", None)]
    result: dict[str, Any] = {label: [] for label, _ in labels}
    for i in range(runs):
        for label, code in labels:
            console.print(f"[bold]steps[/] {label} run {i + 1}/{runs}")
            result[label].append(measure(wd, model, steps, code))
    for label, _ in labels:
        result[f"{label}_async_over_max"] = statistics.mean(r["async_over_max"] for r in result[label])
        result[f"{label}_async_period_s"] = statistics.mean(r["async_period_s"] for r in result[label])
    result.update(
        shape={**SHAPE, "steps": steps, "model": "the demo's tiny warm-started llama"},
        machine=machine(),
        date=time.strftime("%Y-%m-%d"),
        pinning="generator (vLLM OpenMP) on the first core, trainer (1 torch thread) on the last core",
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "steps.md").write_text(report(result, [label for label, _ in labels]))
    console.print(report(result, [label for label, _ in labels]))
    return result


def _ms(x: float | None) -> str:
    return "" if x is None else f"{1000 * x:.1f}"


def report(r: dict[str, Any], labels: list[str]) -> str:
    md = [
        "| run | T_gen (s) | T_train (s) | async step period (s) | async / max(T_gen, T_train) |",
        "|---|---|---|---|---|",
    ]
    for label in labels:
        for i, x in enumerate(r[label]):
            md.append(
                f"| {label} {i + 1} | {x['t_gen_s']:.3f} | {x['t_train_s']:.3f} | {x['async_period_s']:.3f} | "
                f"{x['async_over_max']:.3f} |"
            )
        md.append(
            f"| **{label}, mean** | | | {r[f'{label}_async_period_s']:.3f} | **{r[f'{label}_async_over_max']:.3f}** |"
        )
    md += [
        "",
        "Trainer, median ms per steady step in each phase (its step metrics):",
        "",
        "| phase | " + " | ".join(f"{label} {i + 1}" for label in labels for i in range(len(r[label]))) + " |",
        "|---|" + "---|" * sum(len(r[label]) for label in labels),
    ]
    keys = sorted({k for label in labels for x in r[label] for k in x["trainer_per_step_s"]})
    for k in keys:
        md.append(
            f"| {k} | " + " | ".join(_ms(x["trainer_per_step_s"].get(k)) for label in labels for x in r[label]) + " |"
        )
    md += [
        "",
        "Every role, median ms per span over the whole job (Prometheus `asyncrl_{role}_phase_seconds`, "
        "buckets interpolated; start-up included; the code before has no spans):",
        "",
        "| role | phase | " + " | ".join(f"{label} {i + 1}" for label in labels for i in range(len(r[label]))) + " |",
        "|---|---|" + "---|" * sum(len(r[label]) for label in labels),
    ]
    for role, names in PHASES.items():
        for name in names:
            cells = [x["phases"].get(role, {}).get(name) for label in labels for x in r[label]]
            if any(cells):
                md.append(
                    f"| {role} | {name} | "
                    + " | ".join(f"{_ms(c['median_s'])} (x{int(c['count'])})" if c else "" for c in cells)
                    + " |"
                )
    md += ["", f"Machine: {r['machine']}; {r['pinning']}; {r['date']}. Other work may have shared the box."]
    return "\n".join(md) + "\n"
